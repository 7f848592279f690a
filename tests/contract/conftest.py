"""The contract tier: the same client-level tests against the built-in server and real SGLang.

The built-in half runs in every test run. The real-SGLang half is collected only when the tier
is asked for — `pytest -m contract` or MEGATRON_GSPO_CONTRACT=1 — and then it FAILS (never skips)
when the SGLang venv is missing, naming the script that builds it. The venv is
$SGLANG_VENV or ~/.cache/megatron-gspo/sglang-venv (scripts/sglang_env.sh).

A test is real-SGLang when it carries the `real_sglang` mark, when its parameter id names
"sglang", or when it uses a fixture that starts SGLang (REAL_SGLANG_FIXTURES); all three are
marked `real_sglang` here, so `-m real_sglang` lists them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CONTRACT_ENV = "MEGATRON_GSPO_CONTRACT"
HERE = Path(__file__).parent


# Fixtures that start a real SGLang server: a test using one is real-SGLang whatever its name.
REAL_SGLANG_FIXTURES = frozenset({"sglang_url"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "contract: same client checks on built-in and real SGLang")
    config.addinivalue_line("markers", "real_sglang: needs real SGLang (the contract tier's venv)")


def contract_tier_selected(config: pytest.Config) -> bool:
    if os.environ.get(CONTRACT_ENV) == "1":
        return True
    markexpr = config.getoption("markexpr") or ""
    return any(m in markexpr and f"not {m}" not in markexpr for m in ("contract", "real_sglang"))


def needs_real_sglang(item: pytest.Item) -> bool:
    if not str(item.path).startswith(str(HERE)):
        return False
    return (
        item.get_closest_marker("real_sglang") is not None
        or "sglang" in getattr(item, "callspec", _NoSpec).id
        or bool(REAL_SGLANG_FIXTURES.intersection(getattr(item, "fixturenames", ())))
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    real = [it for it in items if needs_real_sglang(it)]
    for it in real:
        it.add_marker(pytest.mark.real_sglang)
    if contract_tier_selected(config):
        return
    dropped = real
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it not in dropped]


class _NoSpec:
    id = ""
