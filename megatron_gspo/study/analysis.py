"""Reading a study's runs: collapse events, and the per-run and per-algorithm summary numbers.

A collapse event is either the greedy eval reward falling more than `margin` below its running
best (one event per fall: it ends when eval comes back within the margin), or a non-finite
policy loss or gradient norm (one event per stretch of such steps).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

NON_FINITE_KEYS = ("loss/policy", "grad_norm")
# summary column -> (metrics key, how a run's steps reduce to one number)
MEANS = {
    "ratio_std": "ratio/std",
    "clip_tokens": "ratio/clip_fraction_tokens",
    "clip_seqs": "ratio/clip_fraction_seqs",
    "routing_changed": "routing/changed_fraction",
    "mismatch": "mismatch/logprob_abs_diff",
    "agreement": "routing/rollout_train_agreement",
    # the mechanism: routing drift per token, and the token log-ratio's std split by it
    "tokens_changed": "routing/tokens_changed_any",
    "std_routing_same": "ratio/token_std_routing_same",
    "std_routing_changed": "ratio/token_std_routing_changed",
    "mismatch_routing_same": "mismatch/logprob_abs_diff_routing_same",
    "mismatch_routing_differs": "mismatch/logprob_abs_diff_routing_differs",
}


@dataclass(frozen=True)
class Event:
    step: int
    kind: str  # "eval drop" | "non-finite"
    detail: str


@dataclass
class RunSummary:
    algo: str
    seed: int
    steps_done: int
    values: dict[str, float]  # summary column -> number (absent when the run never logged it)
    events: list[Event] = field(default_factory=list)


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def collapse_events(rows: list[dict], margin: float) -> list[Event]:
    events: list[Event] = []
    best: float | None = None
    fallen = bad = False
    for row in sorted(rows, key=lambda r: r["step"]):
        broken = [k for k in NON_FINITE_KEYS if (v := _num(row.get(k))) is not None
                  and not math.isfinite(v)]  # fmt: skip
        if broken and not bad:
            detail = ", ".join(f"{k} = {row[k]}" for k in broken)
            events.append(Event(row["step"], "non-finite", detail))
        bad = bool(broken)
        ev = _num(row.get("eval/reward"))
        if ev is None or not math.isfinite(ev):
            continue
        below = best is not None and ev < best - margin
        if below and not fallen:
            detail = f"eval {ev:.3f} < best {best:.3f} - {margin:g}"
            events.append(Event(row["step"], "eval drop", detail))
        fallen = below
        best = ev if best is None else max(best, ev)
    return events


def summarize_run(algo: str, seed: int, rows: list[dict], margin: float) -> RunSummary:
    trained = [r for r in rows if r["step"] > 0]
    evals = [(r["step"], v) for r in rows if (v := _num(r.get("eval/reward"))) is not None]
    values: dict[str, float] = {}
    if evals:
        values |= {"eval_start": evals[0][1], "eval_final": evals[-1][1]}
        values["eval_best"] = max(v for _, v in evals)
    rewards = _column(trained, "reward/mean")
    if rewards:
        values["reward_last5"] = statistics.fmean(rewards[-5:])
    for name, key in MEANS.items():
        if col := _column(trained, key):
            values[name] = statistics.fmean(col)
    if steps := _column(trained, "time/step_s"):
        values["step_s"] = statistics.median(steps)
    done = max((r["step"] for r in rows), default=0)
    return RunSummary(algo, seed, done, values, collapse_events(rows, margin))


def _column(rows: list[dict], key: str) -> list[float]:
    return [v for r in rows if (v := _num(r.get(key))) is not None and math.isfinite(v)]


@dataclass(frozen=True)
class Spread:
    mean: float
    lo: float
    hi: float
    n: int

    def text(self, fmt: str = ".3f") -> str:
        if self.n == 1:
            return format(self.mean, fmt)
        return f"{self.mean:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"

    def overlaps(self, other: Spread) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi


def spread(runs: list[RunSummary], name: str) -> Spread | None:
    vals = [r.values[name] for r in runs if name in r.values]
    if not vals:
        return None
    return Spread(statistics.fmean(vals), min(vals), max(vals), len(vals))
