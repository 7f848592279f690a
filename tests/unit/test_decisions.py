"""The loop decides on typed results, never on metrics: no metric key (a string with a "/",
such as "update/nonfinite" or "rollout/stale_samples") is read anywhere in the loop, the
rollouts generated ahead, the rollout side or the non-finite guard. Writing metrics is fine;
renaming one must not be able to switch a decision off."""

import ast
from pathlib import Path

import pytest

import megatron_gspo.train as train

pytestmark = pytest.mark.unit

DECIDERS = ("loop.py", "ahead.py", "fleet.py", "producer.py", "share.py", "guard.py")


def metric_reads(source: str) -> list[str]:
    """Every read of a metric-like key: x["a/b"] loaded, x.get("a/b"), "a/b" in x."""

    def key(node) -> str | None:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value
        return node.value if ok else None

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and key(node.slice):
            found.append(f"[{key(node.slice)!r}]")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop")
            and node.args
            and key(node.args[0])
        ):
            found.append(f".{node.func.attr}({key(node.args[0])!r})")
        elif (
            isinstance(node, ast.Compare)
            and key(node.left)
            and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
        ):
            found.append(f"{key(node.left)!r} in")
    return found


@pytest.mark.parametrize("name", DECIDERS)
def test_no_metric_key_is_read(name):
    source = (Path(train.__file__).parent / name).read_text()
    assert metric_reads(source) == []


def test_the_check_finds_the_reads_it_forbids():
    """What the loop did before its typed results, each caught."""
    before = """
busy = metrics["time/rollout_s"]
stale = collected.metrics.get("rollout/stale_samples", 0.0)
if "update/nonfinite" in metrics: pass
metrics["time/train_s"] = 1.0
metrics |= {"a/b": 1.0}
"""
    assert metric_reads(before) == [
        "['time/rollout_s']",
        ".get('rollout/stale_samples')",
        "'update/nonfinite' in",
    ]
