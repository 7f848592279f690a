"""init_distributed on a layout this process had before: megatron's parallel state comes back with
that layout's own groups (the same objects, collectives on them still work), and changing
layouts again and again makes no more groups (no more gloo threads) after the first round."""

from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("layout_worker.py")
SIZES = {"tp2": (2, 1, 1), "tp1": (1, 1, 2), "pp2": (1, 2, 1)}  # tp, pp, dp of 2 processes


def test_a_layout_entered_again_has_its_own_groups_back(tmp_path):
    out = tmp_path / "rounds.json"
    rounds = run_distributed(WORKER, 2, str(out), out=out)
    first, *again = rounds
    for r in rounds:
        for name, (tp, pp, dp) in SIZES.items():
            got = r[name]
            assert (got["tp"], got["pp"], got["dp"]) == (tp, pp, dp), (name, got)
            assert (got["tp_sum"], got["dp_sum"]) == (tp, dp), (name, got)
    for r in again:
        for name in SIZES:
            assert r[name]["tp_group"] == first[name]["tp_group"], name
        assert r["pp2"]["threads"] == first["pp2"]["threads"], (first, r)
