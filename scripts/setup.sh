#!/usr/bin/env bash
# Set up a virtual environment in .venv with the CPU build of torch and this project.
#   bash scripts/setup.sh            # CPU machine (torch 2.13.0 CPU build)
# Off machines that carry the CPU wheel locally, point pip at PyTorch's CPU wheel index:
#   TORCH_INDEX_URL=<pytorch cpu wheel index> bash scripts/setup.sh
# On a GPU machine use the Docker image (or your CUDA torch) and `pip install -e .` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip_install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
  else
    pip_install "torch==${TORCH_VERSION}"
  fi
fi
# The project and its test tools; torch is already satisfied, so nothing re-downloads it.
pip_install -e ".[test]"
# (-W ignore: megatron.core warns at import that Transformer Engine and Apex are missing, which
# the CPU build does without)
.venv/bin/python -W ignore - <<'PY'
import torch, megatron.core
print(f"ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"cuda={'yes' if torch.cuda.is_available() else 'no'}")
PY
