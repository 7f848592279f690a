#!/usr/bin/env bash
# The GPU test tier (tests/gpu), for a machine with one CUDA GPU; CI machines have none, so there
# it is skipped. It scores against HF on the GPU, and runs short GSPO / GRPO+R3 jobs with the
# Megatron trainer on the GPU and the built-in rollout server on the CPU through each weight-sync
# transport, each checked against the same job with the GPU hidden.
#   bash scripts/gpu_checks.sh            (PYTHON=... to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print(torch.__version__, torch.cuda.get_device_name())'
exec "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/gpu "$@"
