"""Where the contract tier finds real SGLang: the venv that scripts/sglang_env.sh builds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def sglang_venv() -> Path:
    default = Path.home() / ".cache" / "megatron-gspo" / "sglang-venv"
    return Path(os.environ.get("SGLANG_VENV") or default)


def sglang_python() -> Path:
    """The venv's python, or a test failure that says how to build the venv."""
    venv = sglang_venv()
    python = venv / "bin" / "python"
    marks = list(venv.glob(".megatron-gspo-sglang-*"))
    if not python.exists() or not marks:
        pytest.fail(
            f"the real-SGLang contract tests need the SGLang venv at {venv}, which is missing or "
            "incomplete; build it with `bash scripts/sglang_env.sh` (or point SGLANG_VENV at one)",
            pytrace=False,
        )
    return python
