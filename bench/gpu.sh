#!/usr/bin/env bash
# The GPU checks of issues 7 and 14 as one script (~7 minutes on one H200): G1 bf16 matmul ceiling, G2 our
# trainer vs a nanoGPT-style loop on GPT-124M (tokens/s, MFU), G3 DDP world_size 1 over NCCL vs bare,
# G4 step time with a per-step stats sync vs StepMeter, G5 loader-alone vs trainer tokens/s on a token
# file, G6 peak memory with vs without the logits.float() copy, G7 (issue 31) DDP gradient memory with
# zero_grad(set_to_none=True) vs in place. G2 is a wall-clock race: N steps, one sync, no eval or best.pt.
# `bench/gpu.sh --smoke` runs the same code on CPU with tiny shapes (what CI can check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
smoke=()
[ "${1:-}" = "--smoke" ] && smoke=(--smoke)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))'
"$PY" bench/gpu_bench.py matmul "${smoke[@]}"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_bench.py ddp-vs-bare "${smoke[@]}"
"$PY" bench/gpu_bench.py trainer-vs-minimal "${smoke[@]}"
# issue 14: G4 per-step stats sync vs StepMeter, G5 loader vs trainer tokens/s, G6 logits copy memory
"$PY" bench/gpu_bench.py stats-sync "${smoke[@]}"
"$PY" bench/gpu_bench.py loader "${smoke[@]}"
"$PY" bench/gpu_bench.py logits-memory "${smoke[@]}"
# issue 31: G7 DDP gradients as bucket views, zero_grad(set_to_none=True) vs in place (G2: a wall-clock race)
"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_bench.py grad-memory "${smoke[@]}"
