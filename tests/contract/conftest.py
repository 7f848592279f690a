"""The contract tier: the same client-level tests against the built-in server and real SGLang.

The built-in half runs in every test run. The real-SGLang half is collected only when the tier
is asked for — `pytest -m contract` or MEGATRON_GSPO_CONTRACT=1 — and then it FAILS (never skips)
when the SGLang venv is missing, naming the script that builds it. The venv is
$SGLANG_VENV or ~/.cache/megatron-gspo/sglang-venv (scripts/sglang_env.sh).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CONTRACT_ENV = "MEGATRON_GSPO_CONTRACT"
HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "contract: same client checks on built-in and real SGLang")


def contract_tier_selected(config: pytest.Config) -> bool:
    if os.environ.get(CONTRACT_ENV) == "1":
        return True
    markexpr = config.getoption("markexpr") or ""
    return "contract" in markexpr and "not contract" not in markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if contract_tier_selected(config):
        return
    here = str(HERE)
    dropped = [
        it
        for it in items
        if str(it.path).startswith(here) and "sglang" in getattr(it, "callspec", _NoSpec).id
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it not in dropped]


class _NoSpec:
    id = ""
