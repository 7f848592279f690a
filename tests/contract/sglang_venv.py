"""Where the contract tier finds real SGLang: the venv that scripts/sglang_env.sh builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.rollout.launcher import ServerConfig
from megatron_gspo.rollout.server_config import sglang_venv


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


def server_config(kind: str, model) -> ServerConfig:
    """A contract-test server of either kind on `model`, routed experts on, seeded."""
    common = dict(model_path=str(model), enable_return_routed_experts=True, random_seed=0)
    if kind == "builtin":
        return ServerConfig(threads=1, env={"OMP_NUM_THREADS": "1"}, **common)
    return ServerConfig(
        kind="sglang", python=str(sglang_python()), device="cpu", disable_cuda_graph=True,
        max_total_tokens=4096, max_running_requests=16, dtype="float32", sleep_on_idle=True,
        **common,
    )  # fmt: skip
