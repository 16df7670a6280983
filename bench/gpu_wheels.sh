#!/usr/bin/env bash
# The wheels the packaged trainer needs that the lent GPU machine's image lacks, for bench/gpu.sh to
# install there (the machine cannot reach PyPI). Run here, before the GPU call, and carry bench/wheels:
#     bash bench/gpu_wheels.sh            # bench/wheels/cp312: the image's Python 3.12 (device KINDS.md)
#     bash bench/gpu_wheels.sh 3.11       # another Python (the suite's dry run uses this venv's)
# What the image lacks (its package list, KINDS.md): jsonschema and what it pulls in that is not there
# (jsonschema-specifications, referencing, rpds-py; attrs and typing-extensions are there). Versions are
# constraints.txt's, the ones the suite tests. rpds-py is compiled: one wheel per Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
pyver=${1:-3.12}
[[ "$pyver" =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels.sh: '$pyver' is not a Python version like 3.12" >&2; exit 2; }
tag=cp${pyver/./}
dest=bench/wheels/$tag
pins=()
for name in jsonschema jsonschema-specifications referencing rpds-py; do
    pin=$(grep -E "^${name}==" constraints.txt) || { echo "gpu_wheels.sh: constraints.txt pins no $name" >&2; exit 2; }
    pins+=("$pin")
done
rm -rf "$dest"  # only the pinned versions: two of one package would make gpu.sh's install fail there
mkdir -p "$dest"
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$pyver" --implementation cp --abi "$tag" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}"
ls "$dest"
