"""The study's PNG figures: one line per algorithm (the mean over seeds, a band from the lowest
to the highest seed), drawn with the report command's panels (train/report.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megatron_gspo.study.analysis import Event
from megatron_gspo.train.report import (
    LAYER_KEY,
    Panel,
    build_figure,
    draw_layers,
    draw_panel,
    layer_keys,
    save_png,
)

Runs = list[tuple[str, list[dict]]]  # (label, rows aggregated over seeds)

REWARDS = (
    Panel("reward/mean (train, sampled)", ("reward/mean",)),
    Panel("eval/reward (greedy, held-out)", ("eval/reward",), markers=True),
)
RATIO = (
    Panel("ratio/std (log scale)", ("ratio/std",)),
    Panel("ratio/max - 1 (log scale)", ("ratio/max_minus_1",)),
)
CLIP = (
    Panel("clipped tokens (fraction)", ("ratio/clip_fraction_tokens",)),
    Panel("clipped sequences (fraction)", ("ratio/clip_fraction_seqs",)),
)
MECHANISM = (
    Panel("tokens whose routing moved (any MoE layer)", ("routing/tokens_changed_any",)),
    Panel("token log-ratio std, routing same", ("ratio/token_std_routing_same",)),
    Panel("token log-ratio std, routing changed", ("ratio/token_std_routing_changed",)),
    Panel(
        "|logp train - logp rollout| by routing agreement (R3)",
        ("mismatch/logprob_abs_diff_routing_same", "mismatch/logprob_abs_diff_routing_differs"),
        names=("routing agrees", "routing differs"),
    ),
)
MISMATCH = (
    Panel("mean |logp train - logp rollout|", ("mismatch/logprob_abs_diff",)),
    Panel("R3: rollout vs train routing agreement", ("routing/rollout_train_agreement",)),
    Panel("kl/old", ("kl/old",)),
)

CAPTIONS = {
    "rewards.png": "Train reward and greedy eval reward per step",
    "ratio_variance.png": "Importance-ratio spread: sequence-level for GSPO, token-level for GRPO",
    "clip_fractions.png": "Fraction of tokens and of sequences clipped",
    "routing.png": "Routing changed fraction (all layers, then per layer for each algorithm)",
    "mismatch.png": "Train-vs-rollout log-prob mismatch, R3 routing agreement, and KL to the old policy",
    "mechanism.png": "The mechanism: share of tokens whose routing moved, the token log-ratio std "
    "over those tokens and over the rest, and the train-rollout gap split by routing agreement",
    "collapse.png": "Eval reward of every seed, collapse events marked",
}


def write_figures(out: Path, by_algo: Runs, levels: dict[str, str], per_seed, events) -> list[str]:
    """Every figure into `out`; returns the file names in CAPTIONS order."""
    flat = _without_layers(by_algo)  # per-layer routing has its own figure
    save_png(build_figure(flat, REWARDS, ncols=2), out / "rewards.png")
    save_png(_ratio_figure(flat, levels), out / "ratio_variance.png")
    save_png(build_figure(flat, CLIP, ncols=2), out / "clip_fractions.png")
    save_png(_routing_figure(by_algo), out / "routing.png")
    save_png(build_figure(flat, MISMATCH, ncols=3), out / "mismatch.png")
    save_png(build_figure(flat, MECHANISM, ncols=2), out / "mechanism.png")
    save_png(_collapse_figure(per_seed, events), out / "collapse.png")
    return list(CAPTIONS)


def _without_layers(runs: Runs) -> Runs:
    return [(label, [{k: v for k, v in r.items() if not LAYER_KEY.match(k.split(":")[0])}
                     for r in rows]) for label, rows in runs]  # fmt: skip


def _ratio_figure(by_algo: Runs, levels: dict[str, str]):
    runs = []
    for label, rows in by_algo:
        shifted = [r | _minus_one(r) for r in rows]
        runs.append((f"{label} ({levels.get(label, '?')}-level)", shifted))
    fig = build_figure(runs, RATIO, ncols=2)
    for ax in fig.axes[: len(RATIO)]:
        if any((np.asarray(line.get_ydata(), float) > 0).any() for line in ax.lines):
            ax.set_yscale("log")
    return fig


def _minus_one(row: dict) -> dict:
    """ratio/max - 1 (and its band), so the largest excursion reads on a log axis."""
    out = {}
    for suffix in ("", ":min", ":max"):
        v = row.get("ratio/max" + suffix)
        if isinstance(v, int | float) and math.isfinite(v):
            out["ratio/max_minus_1" + suffix] = max(v - 1.0, 1e-12)
    return out


def _grid(n: int, ncols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.4 * nrows))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.55 / (3.4 * nrows),
                        top=1 - 0.35 / (3.4 * nrows), wspace=0.3, hspace=0.5)  # fmt: skip
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes


def _routing_figure(by_algo: Runs):
    layered = [(label, rows) for label, rows in by_algo if layer_keys(rows)]
    fig, axes = _grid(1 + len(layered), ncols=min(3, 1 + len(layered)))
    draw_panel(axes[0], Panel("routing/changed_fraction", ("routing/changed_fraction",)), by_algo)
    for ax, (label, rows) in zip(axes[1:], layered):
        draw_layers(ax, label, rows)
    return fig


def _collapse_figure(per_seed: dict[str, list[tuple[int, list[dict]]]], events) -> object:
    """One panel per algorithm: each seed's eval reward, a red x at each collapse event."""
    algos = list(per_seed)
    fig, axes = _grid(max(1, len(algos)), ncols=min(4, max(1, len(algos))))
    for ax, algo in zip(axes, algos):
        for n, (seed, rows) in enumerate(per_seed[algo]):
            pts = [(r["step"], r["eval/reward"]) for r in rows if _finite(r.get("eval/reward"))]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, color=f"C{n}", label=f"seed {seed}")
            _mark(ax, events.get((algo, seed), []), rows)
        ax.set_title(f"{algo}: eval/reward per seed", fontsize="medium")
        ax.set_xlabel("step", fontsize="small")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="x-small")
    return fig


def _mark(ax, events: list[Event], rows: list[dict]) -> None:
    evals = {r["step"]: r["eval/reward"] for r in rows if _finite(r.get("eval/reward"))}
    for e in events:
        y = evals.get(e.step, min(evals.values(), default=0.0))
        ax.plot([e.step], [y], marker="x", markersize=10, color="red", linestyle="none")
        ax.annotate(e.kind, (e.step, y), fontsize="x-small", color="red",
                    xytext=(4, -10), textcoords="offset points")  # fmt: skip


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
