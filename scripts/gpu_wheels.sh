#!/usr/bin/env bash
# Download, here (where the package registry is reachable), the wheels that the one-shot GPU check
# (scripts/gpu_check.sh) installs on the lent GPU machine, which has no network. That machine has
# Python 3.12 with torch (CUDA), transformers, safetensors, tokenizers, aiohttp, pyarrow,
# tensorboard, matplotlib, pytest, numpy and pyyaml; what the GPU path needs beyond those:
#   megatron-core  the trainer (0.16.1: the version the CPU machines run, tested here)
#   psutil         megatron-core's torch_dist checkpoint save needs it (it hangs without it)
#   setuptools     torch.utils.cpp_extension (imported by megatron-core) imports it; torch
#                  declares it on Python >= 3.12, so gpu_check.sh installs it only if missing
# math-verify is not among them: only the "math" reward imports it, lazily, and no GPU check uses it.
# Into the git-ignored .whl/ (carried to the GPU machine by the run tool's `carry: [".whl"]`);
# idempotent (pip skips what is there); fails if the wheels exceed 40 MiB in all.
#   bash scripts/gpu_wheels.sh            (PYTHON=... to use another interpreter with pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.whl
LIMIT_MIB=40
WHEELS=(megatron-core==0.16.1 psutil==7.2.2 setuptools==80.9.0)

mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --dest "$DEST" "${WHEELS[@]}"

# Wheels of other versions left by an earlier pin would be installed too: keep only the pinned.
for f in "$DEST"/*.whl; do
  keep=0
  for w in "${WHEELS[@]}"; do
    name=${w%%==*} version=${w##*==}
    case "$(basename "$f")" in "${name//-/_}-${version}-"*) keep=1 ;; esac
  done
  if [ "$keep" = 0 ]; then
    echo "removing $(basename "$f") (not pinned)"
    rm -f -- "$f"
  fi
done

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "total: $total bytes ($(( total / 1024 )) KiB) in $DEST/"
if [ "$total" -gt $(( LIMIT_MIB * 1024 * 1024 )) ]; then
  echo "error: the wheels exceed ${LIMIT_MIB} MiB; the run tool carries at most 64 MiB" >&2
  exit 1
fi
