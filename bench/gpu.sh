#!/usr/bin/env bash
# The GPU checks (G1-G9, bench/README.md) on the lent GPU machine as it is, in parts that each fit one
# call of a few minutes, the most important first:
#     bash bench/gpu.sh --part 1    # G1 bf16 matmul ceiling, G2 our trainer vs a nanoGPT-style loop
#     bash bench/gpu.sh --part 2    # G9 checkpoint cost, G3 DDP (1 rank, NCCL) vs bare, G4 stats sync
#     bash bench/gpu.sh --part 3    # G5 loader, G6 logits memory, G7 gradient memory, G8 eval timing
#     bash bench/gpu.sh             # all three
#     bash bench/gpu.sh --smoke     # the same code on CPU with tiny shapes (the suite runs it so)
# Each check's lines go to stdout and, as they come, to $OUT/gpu-bench.txt when $OUT is set (the device
# tool's folder that comes back), so a call cut off by its time limit keeps what ran.
# The machine's python3 (3.12, torch 2.11) lacks jsonschema and its dependencies and cannot reach PyPI:
# run `bash bench/gpu_wheels.sh` here first and carry bench/wheels; they are installed below into a
# private temporary folder on PYTHONPATH, beside this repository (the project is not installed there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
part=all smoke=()
while [ $# -gt 0 ]; do
    case $1 in
        --smoke) smoke=(--smoke) ;;
        --part) part=${2:-}; shift ;;
        *) echo "gpu.sh: unknown argument '$1' (--part 1|2|3, --smoke)" >&2; exit 2 ;;
    esac
    shift
done
case $part in 1 | 2 | 3 | all) ;; *) echo "gpu.sh: --part is 1, 2 or 3, not '$part'" >&2; exit 2 ;; esac

deps=""
if ! "$PY" -c 'import jsonschema' 2>/dev/null; then
    tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if ! compgen -G "bench/wheels/$tag/*.whl" >/dev/null; then
        echo "gpu.sh: $PY has no jsonschema and bench/wheels/$tag holds no wheels: run" \
            "'bash bench/gpu_wheels.sh ${tag:2:1}.${tag:3}' where PyPI is reachable and carry bench/wheels" >&2
        exit 2
    fi
    deps=$(mktemp -d "${TMPDIR:-/tmp}/ddp-gpu-bench.XXXXXX")  # mode 0700: no other user's code on our path
    trap 'rm -rf "$deps"' EXIT
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$deps" \
        "bench/wheels/$tag"/*.whl
fi
export PYTHONPATH="$PWD${deps:+:$deps}${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1
log=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    log=$OUT/gpu-bench.txt
fi

run() { "$PY" "$@" "${smoke[@]}" 2>&1 | tee -a "$log"; }
one_rank() { run -m torch.distributed.run --standalone --nproc-per-node 1 "$@"; }

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))' | tee -a "$log"
"$PY" -c 'import ddp_train.config, ddp_train.trainer' # every import the trainer needs, before any check
if [ "$part" = 1 ] || [ "$part" = all ]; then
    run bench/gpu_bench.py matmul
    run bench/gpu_bench.py trainer-vs-minimal
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
    run bench/gpu_bench.py checkpoint-cost
    one_rank bench/gpu_bench.py ddp-vs-bare
    run bench/gpu_bench.py stats-sync
fi
if [ "$part" = 3 ] || [ "$part" = all ]; then
    run bench/gpu_bench.py loader
    run bench/gpu_bench.py logits-memory
    one_rank bench/gpu_bench.py grad-memory
    run bench/gpu_bench.py eval-timing
fi
