"""A sweep's scaling axis: each arm's final and best greedy eval reward against the swept value,
and against training FLOPs where the value changes them, with the spread over seeds.

Training FLOPs of a run = 6 x N x (the tokens its steps trained on): the forward and backward of
every policy update (Kaplan et al. 2020's 6 N per token), N the parameters one token goes through
(attention, its top-k experts, the output layer: `active_params`, from the run's model
config.json). The old-log-prob forward and the generation are left out: they are the same share of
every run. A run's tokens per step are `tokens_per_s` x `time/step_s` of its metrics (the prompt
and response tokens of the step's batch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.study.analysis import RunSummary, Spread, spread
from megatron_gspo.study.plan import Study

FIGURE = "scaling.png"
CAPTION = (
    "Final and best eval reward per arm against the swept value (and training FLOPs): the mean"
    " over seeds, the seeds' range shaded"
)


def active_params(config_json: Path) -> float | None:
    """Parameters one token goes through, from an HF config.json (None: no such file)."""
    if not Path(config_json).is_file():
        return None
    c = json.loads(Path(config_json).read_text())
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads)
    attn = h * head_dim * (2 * heads + 2 * kv)  # q, o; k, v
    experts = c.get("num_experts") or c.get("num_local_experts")
    if experts:
        mlp = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"] + h * experts
    else:
        mlp = 3 * h * c["intermediate_size"]
    return float(c["num_hidden_layers"] * (attn + mlp) + c["vocab_size"] * h)


def run_flops(rows: list[dict], n_active: float | None) -> float | None:
    """6 N x the tokens trained over the run's steps (None without N or token counts)."""
    tokens = [r["tokens_per_s"] * r["time/step_s"] for r in rows
              if r.get("step", 0) > 0 and "tokens_per_s" in r and "time/step_s" in r]  # fmt: skip
    if n_active is None or not tokens:
        return None
    return 6.0 * n_active * sum(tokens)


@dataclass
class Point:
    value: str
    final: Spread | None
    best: Spread | None
    flops: float | None  # mean over the arm's seeds


def points(study: Study, summaries: dict[str, list[RunSummary]], flops: dict) -> dict:
    """{arm: [Point per sweep value]} (flops: {(label, seed): FLOPs})."""
    assert study.sweep is not None
    out: dict[str, list[Point]] = {}
    for arm in study.algos:
        out[arm] = []
        for v in study.sweep.values:
            label = f"{arm} @ {study.sweep.point(v)}"
            runs = summaries.get(label, [])
            f = [x for r in runs if (x := flops.get((label, r.seed))) is not None]
            out[arm].append(Point(v, spread(runs, "eval_final"), spread(runs, "eval_best"),
                                  sum(f) / len(f) if f else None))  # fmt: skip
    return out


def flops_change(pts: dict[str, list[Point]]) -> bool:
    """Whether the swept value changes the training FLOPs (by more than 5% between values)."""
    n = max((len(a) for a in pts.values()), default=0)
    per_value = []
    for j in range(n):
        f = [x for a in pts.values() if (x := a[j].flops)]
        if f:
            per_value.append(sum(f) / len(f))
    return len(per_value) > 1 and max(per_value) > 1.05 * min(per_value)


def table(study: Study, pts: dict[str, list[Point]]) -> list[str]:
    assert study.sweep is not None
    head = f"| arm | {study.sweep.key} | eval final | eval best | training FLOPs |"
    rows = ["## Scaling", "", f"Every arm at every value of `{study.sweep.key}`; mean over seeds "
            "[lowest, highest]. Training FLOPs: 6 x active parameters x trained tokens "
            "(study/scaling.py).", "", head, "|---|---|---|---|---|"]  # fmt: skip
    for arm, arm_pts in pts.items():
        for p in arm_pts:
            cells = [_cell(p.final), _cell(p.best), f"{p.flops:.3g}" if p.flops else "n/a"]
            rows.append(f"| {arm} | {p.value} | " + " | ".join(cells) + " |")
    return rows + [""]


def _cell(s: Spread | None) -> str:
    return "n/a" if s is None else s.text(".3f")


def figure(study: Study, pts: dict[str, list[Point]], out: Path) -> str:
    """scaling.png: final and best eval against the value (and FLOPs); returns its name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    assert study.sweep is not None
    with_flops = flops_change(pts)
    nrows = 2 if with_flops else 1
    fig = Figure(figsize=(10, 3.8 * nrows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 2, squeeze=False)
    xs, ticks = _positions(study.sweep.values)
    for col, (what, title) in enumerate((("final", "final eval reward"),
                                          ("best", "best eval reward"))):  # fmt: skip
        _draw(axes[0][col], pts, what, lambda j, p: xs[j], f"{title} vs {study.sweep.key}")
        if ticks is not None:
            axes[0][col].set_xticks(xs, ticks, fontsize="small")
        if with_flops:
            _draw(axes[1][col], pts, what, lambda j, p: p.flops, f"{title} vs training FLOPs")
            axes[1][col].set_xscale("log")
    fig.tight_layout()
    fig.savefig(out / FIGURE, dpi=100)
    return FIGURE


def _positions(values: tuple[str, ...]) -> tuple[list[float], list[str] | None]:
    """Numeric values as themselves; any other as 0, 1, ... with the values as tick labels."""
    try:
        nums = [float(v) for v in values]
        if all(math.isfinite(x) for x in nums):
            return nums, None
    except ValueError:
        pass
    return [float(j) for j in range(len(values))], [v.rsplit("/", 1)[-1] for v in values]


def _draw(ax, pts: dict[str, list[Point]], what: str, x_of, title: str) -> None:
    for n, (arm, arm_pts) in enumerate(pts.items()):
        got = [(x_of(j, p), getattr(p, what)) for j, p in enumerate(arm_pts)]
        got = [(x, s) for x, s in got if x is not None and s is not None]
        if not got:
            continue
        got.sort(key=lambda g: g[0])
        x = [g[0] for g in got]
        ax.plot(x, [s.mean for _, s in got], marker="o", color=f"C{n}", label=arm)
        # the seeds' range, shaded
        ax.fill_between(x, [s.lo for _, s in got], [s.hi for _, s in got], color=f"C{n}",
                        alpha=0.15, linewidth=0)  # fmt: skip
    ax.set_title(title, fontsize="medium")
    ax.set_ylabel("eval/reward", fontsize="small")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="x-small")
