"""`megatron-gspo report RUN_DIR [RUN_DIR ...] --out report.png`: one PNG, runs overlaid.

A grid of panels, x = step, one line per run (colour per run, labelled by the run directory name
or --labels). A panel whose keys no run has says "n/a". When a run logs per-layer routing drift
(`routing/changed_fraction/layer_<i>`), one more panel shows those layers for the first such run.

`build_figure` takes `(label, rows)` pairs, so other commands reuse it: rows made by
`aggregate_seeds` carry `<key>:min` / `<key>:max`, drawn as a band around the mean line.
Matplotlib is used through its object API on the Agg canvas (no pyplot, no global backend).
The command refuses an --out that exists (a figure the user kept is not replaced), whose
directory does not (a typo would scatter directories) or takes no new file (a file, /sys), and a
run with no metrics line yet, before drawing anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gspo.errors import UserError
from megatron_gspo.outputs import check_new_output, temp_file_for
from megatron_gspo.train.metrics import METRICS_FILE, read_metrics

Run = tuple[str, list[dict]]
LAYER_KEY = re.compile(r"^routing/changed_fraction/layer_(\d+)$")
LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # several keys: one line style each, named by `names`
    names: tuple[str, ...] = ()
    markers: bool = False  # sparse keys (eval) read better as points


PANELS = (
    Panel("reward/mean", ("reward/mean",)),
    Panel("eval/reward", ("eval/reward",), markers=True),
    Panel(
        "ratio/clip_fraction (tokens, seqs)",
        ("ratio/clip_fraction_tokens", "ratio/clip_fraction_seqs"),
        names=("tokens", "seqs"),
    ),
    Panel("ratio/std", ("ratio/std",)),
    Panel("routing/changed_fraction", ("routing/changed_fraction",)),
    Panel("mismatch/logprob_abs_diff", ("mismatch/logprob_abs_diff",)),
    Panel("kl/old", ("kl/old",)),
    Panel("entropy", ("entropy",)),
    Panel("response/length_mean", ("response/length_mean",)),
    Panel("time/step_s", ("time/step_s",)),
)


# ---- series ---------------------------------------------------------------------------------


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else math.nan


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a numeric `key`; non-finite values become NaN gaps."""
    pairs = [(r["step"], _number(r.get(key))) for r in rows]
    kept = [(s, v) for s, v in pairs if v is not None]
    return [s for s, _ in kept], [v for _, v in kept]


def layer_keys(rows: list[dict]) -> list[tuple[int, str]]:
    """(layer, key) of every `routing/changed_fraction/layer_<i>` in the rows, by layer."""
    found = {int(m.group(1)): k for r in rows for k in r if (m := LAYER_KEY.match(k))}
    return sorted(found.items())


def aggregate_seeds(seed_rows: Sequence[list[dict]]) -> list[dict]:
    """Rows of the per-step mean over seeds, with `<key>:min` / `<key>:max` for the band."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for rows in seed_rows:
        for row in rows:
            cell = by_step.setdefault(row["step"], {})
            for key, value in row.items():
                if key != "step" and (v := _number(value)) is not None and not math.isnan(v):
                    cell.setdefault(key, []).append(v)
    out = []
    for step in sorted(by_step):
        row = {"step": step}
        for key, vals in by_step[step].items():
            row[key] = sum(vals) / len(vals)
            row[f"{key}:min"], row[f"{key}:max"] = min(vals), max(vals)
        out.append(row)
    return out


# ---- drawing --------------------------------------------------------------------------------


def _draw_key(ax, rows: list[dict], key: str, label: str, **style) -> bool:
    steps, values = series(rows, key)
    if not steps:
        return False
    ax.plot(steps, values, label=label, **style)
    lo, hi = series(rows, key + ":min"), series(rows, key + ":max")
    if lo[0] and lo[0] == hi[0]:
        ax.fill_between(lo[0], lo[1], hi[1], color=style.get("color"), alpha=0.2, linewidth=0)
    return True


def _finish(ax, title: str, drawn: bool, legend: bool = True) -> None:
    ax.set_title(title, fontsize="medium")
    if drawn:
        ax.set_xlabel("step", fontsize="small")
        ax.grid(alpha=0.3)
        if legend:
            ax.legend(fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])


def draw_panel(ax, panel: Panel, runs: Sequence[Run]) -> bool:
    """One line per run and key; "n/a" when no run has any of the panel's keys."""
    drawn = False
    for i, (label, rows) in enumerate(runs):
        for j, key in enumerate(panel.keys):
            name = f"{label} ({panel.names[j]})" if panel.names else label
            style: dict[str, Any] = {
                "color": f"C{i % 10}",
                "linestyle": LINESTYLES[j % len(LINESTYLES)],
            }
            if panel.markers:
                style.update(marker="o", markersize=3)
            drawn |= _draw_key(ax, rows, key, name, **style)
    _finish(ax, panel.title, drawn)
    return drawn


def draw_layers(ax, label: str, rows: list[dict]) -> None:
    """Per-layer routing drift of one run: a legend up to 10 layers, a colour bar beyond."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    layers = layer_keys(rows)
    few = len(layers) <= 10
    norm = Normalize(layers[0][0], layers[-1][0]) if layers else None
    for n, (layer, key) in enumerate(layers):
        assert norm is not None  # made whenever there are layers
        color = f"C{n}" if few else colormaps["viridis"](norm(layer))
        _draw_key(ax, rows, key, f"layer {layer}", color=color)
    _finish(ax, f"routing/changed_fraction per layer ({label})", bool(layers), legend=few)
    if layers and not few:
        ax.figure.colorbar(ScalarMappable(norm, "viridis"), ax=ax, label="layer")


def _grid(nrows: int, ncols: int):
    """An Agg-backed Figure and its axes, 4.2 x 3.2 inches per panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height = 3.2 * nrows
    fig = Figure(figsize=(4.2 * ncols, height))
    FigureCanvasAgg(fig)
    # Fixed margins (in inches: 0.55 below for ticks and "step", 0.3 above for the title); a
    # third of the cost of matplotlib's constrained layout, and the panels line up.
    grid = {"left": 0.045, "right": 0.99, "bottom": 0.55 / height, "top": 1 - 0.3 / height}
    grid.update(wspace=0.3, hspace=0.45)
    return fig, fig.subplots(nrows, ncols, squeeze=False, gridspec_kw=grid).ravel()


def build_figure(runs: Sequence[Run], panels: Sequence[Panel] = PANELS, ncols: int = 4):
    """A matplotlib Figure (Agg canvas) with one panel per entry of `panels`, runs overlaid."""
    layered = next(((label, rows) for label, rows in runs if layer_keys(rows)), None)
    n = len(panels) + (layered is not None)
    fig, axes = _grid(math.ceil(n / ncols), ncols)
    for ax, panel in zip(axes, panels):
        draw_panel(ax, panel, runs)
    if layered is not None:
        draw_layers(axes[len(panels)], *layered)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


# ---- the command ----------------------------------------------------------------------------


def default_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Directory names; where two runs share a name, the last two path parts (or the path)."""
    paths = [Path(d).resolve() for d in run_dirs]
    labels = [p.name for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(d) for d in run_dirs]
    return labels


def load_runs(run_dirs: Sequence[Path], labels: Sequence[str] | None = None) -> list[Run]:
    if not run_dirs:
        raise UserError("no run directory given; pass at least one RUN_DIR")
    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(f"{len(labels)} labels for {len(run_dirs)} run directories; pass one each")
    labels = list(labels) if labels is not None else default_labels(run_dirs)
    runs = [(label, read_metrics(Path(d))) for label, d in zip(labels, run_dirs)]
    for d, (_, rows) in zip(run_dirs, runs):
        if not rows:  # (a figure of nothing is not a report of the run)
            raise UserError(f"{Path(d) / METRICS_FILE} has no metrics yet (no complete line); "
                            "pass a run that has logged a step")  # fmt: skip
    return runs


def save_png(fig, out: Path) -> Path:
    """Write the figure to `out` atomically (temporary file in the same directory, then rename;
    an error, SIGINT or SIGTERM leaves nothing)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with temp_file_for(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return out


def make_report(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """Plot the runs' metrics.jsonl into one PNG at `out`; returns `out`."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: the report is a PNG; give a path ending in .png")
    if out.exists():
        raise UserError(f"--out {out} exists; pass a new path, or delete it to write it again")
    if not out.parent.exists() and not out.parent.is_symlink():
        raise UserError(f"--out {out}: directory {out.parent} does not exist; create it, or "
                        "give a path in an existing directory")  # fmt: skip
    check_new_output(out, "--out")  # (a file as the directory; /proc, /sys: no new files)
    return save_png(build_figure(load_runs(run_dirs, labels)), out)


def _cmd_report(args) -> None:
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    print(f"wrote {make_report(args.run_dirs, args.out, labels)}")


def register(subparsers) -> None:
    """Add the `report` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser("report", help="plot the metrics of one or more runs into a PNG")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    p.add_argument("--out", type=Path, default=Path("report.png"), help="PNG to write")
    p.add_argument(
        "--labels", default=None, help="comma-separated, one per RUN_DIR (default: directory names)"
    )
    p.set_defaults(func=_cmd_report)
