"""The study's findings sentence on the token log-ratio std split by routing: only runs that
measured both stds are compared."""

from __future__ import annotations

import pytest

from megatron_gspo.study.analysis import summarize_run
from megatron_gspo.study.findings import findings

pytestmark = pytest.mark.unit
SAME, MOVED = "ratio/token_std_routing_same", "ratio/token_std_routing_changed"


def _split_line(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("Token log-ratio std where routing moved")]


def test_a_run_without_a_moved_std_is_not_compared():
    """gspo's moved group never had 2 tokens (no MOVED key in its rows: the std is undefined):
    it used to be logged as 0 and the findings said "gspo 0x (0 vs 0.05)". Now gspo is left
    out; grpo's two seeds: moved mean (0.2 + 0.3) / 2 = 0.25 over same (0.05 + 0.15) / 2 = 0.1,
    2.5x. grpo's seed 3 measured only SAME and is left out of both means."""
    rows = {
        ("gspo", 1): [{"step": s, SAME: 0.05} for s in (1, 2)],
        ("grpo", 1): [{"step": 1, SAME: 0.04, MOVED: 0.1}, {"step": 2, SAME: 0.06, MOVED: 0.3}],
        ("grpo", 2): [{"step": 1, SAME: 0.15, MOVED: 0.3}],
        ("grpo", 3): [{"step": 1, SAME: 9.0}],
    }
    summaries: dict = {"gspo": [], "grpo": []}
    for (algo, seed), r in rows.items():
        summaries[algo].append(summarize_run(algo, seed, r, margin=0.2))
    assert _split_line(findings(summaries, {}, 0.2)) == [
        "Token log-ratio std where routing moved vs where it did not (ratio of the two): "
        "grpo 2.5x (0.25 vs 0.1)."
    ]
    del summaries["grpo"]
    assert _split_line(findings(summaries, {}, 0.2)) == []
