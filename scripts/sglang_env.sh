#!/usr/bin/env bash
# A separate virtual environment with real SGLang 0.5.23 and sglang-router 0.3.2, for the
# contract tests only (tests/contract, `pytest -m contract`). Reuses the environment when it is
# there and complete.
#
#   bash scripts/sglang_env.sh            # path: $SGLANG_VENV or ~/.cache/megatron-gspo/sglang-venv
#
# SGLang pins torch 2.14.1 (a CUDA build that also runs on a CPU), so it cannot share the
# project's CPU-torch venv. Two CPU-only accommodations are installed into THIS venv only:
#  - an empty `vllm` package: a rotary-embedding import needs it to exist (nothing is called);
#  - sitecustomize.py: no-op patches of two CUDA-only calls SGLang makes on a CPU-only host
#    (pinning the host buffer of routed experts; the cuda synchronize in release_memory).
set -euo pipefail
VENV="${SGLANG_VENV:-$HOME/.cache/megatron-gspo/sglang-venv}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="0.5.23"
ROUTER_VERSION="0.3.2"
MARK="$VENV/.megatron-gspo-sglang-$SGLANG_VERSION"
HERE="$(cd "$(dirname "$0")" && pwd)"

if [[ -f "$MARK" ]] && "$VENV/bin/python" -c "import importlib.metadata as m
assert m.version('sglang') == '$SGLANG_VERSION'" 2>/dev/null; then
    echo "sglang venv: reusing $VENV"
else
    echo "sglang venv: building $VENV (pip install sglang==$SGLANG_VERSION, ~11 GB, a few minutes)"
    rm -f "$MARK"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install "sglang==$SGLANG_VERSION"
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m
assert m.version('sglang-router') == '$ROUTER_VERSION'" 2>/dev/null; then
    echo "sglang venv: pip install sglang-router==$ROUTER_VERSION"
    "$VENV/bin/python" -m pip install -q "sglang-router==$ROUTER_VERSION"
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm"
echo '"""Stand-in: SGLang imports vllm for a rotary embedding on CPU; nothing is called."""' \
    > "$SITE/vllm/__init__.py"
cat > "$SITE/vllm/_custom_ops.py" <<'PY'
"""Stand-in for vllm._custom_ops: SGLang imports rotary_embedding on a CPU-only host but runs its
own native rotary embedding there."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vllm stub: rotary_embedding is not available in the contract-test venv")
PY
cp "$HERE/../tests/contract/sglang_sitecustomize.py" "$SITE/sitecustomize.py"
if [[ ! -f "$MARK" ]]; then
    "$VENV/bin/python" -c "import sglang, vllm._custom_ops; print('sglang', sglang.__version__)"
    "$VENV/bin/python" -c "import importlib.metadata as m; print('torch', m.version('torch'))"
    touch "$MARK"
fi
echo "sglang venv: ready ($VENV)"
