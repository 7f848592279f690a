"""DIR/report.md: settings, the summary table per algorithm, findings in plain words, collapse
events, the runs, and the figures. Written atomically after every invocation (also a partial
study: what has run so far)."""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.outputs import temp_file_for
from megatron_gspo.study.analysis import RunSummary, Spread, spread, summarize_run
from megatron_gspo.study.figures import CAPTIONS, write_figures
from megatron_gspo.study.plan import RunSpec, Study
from megatron_gspo.train.metrics import METRICS_FILE, read_metrics
from megatron_gspo.train.report import aggregate_seeds

SUMMARY = (  # column title, summary name, format
    ("eval start", "eval_start", ".3f"),
    ("eval final", "eval_final", ".3f"),
    ("eval best", "eval_best", ".3f"),
    ("train reward (last 5 steps)", "reward_last5", ".3f"),
    ("ratio std", "ratio_std", ".2g"),
    ("clipped tokens", "clip_tokens", ".2%"),
    ("clipped seqs", "clip_seqs", ".2%"),
    ("routing changed", "routing_changed", ".2%"),
    ("train-rollout logp gap", "mismatch", ".2g"),
    ("s/step", "step_s", ".2f"),
)
MECHANISM = (  # the second table: what ties ratio noise to routing
    ("tokens with moved routing", "tokens_changed", ".2%"),
    ("token log-ratio std, routing same", "std_routing_same", ".2g"),
    ("token log-ratio std, routing changed", "std_routing_changed", ".2g"),
    ("rollout-train routing agreement (R3)", "agreement", ".2%"),
    ("logp gap, routing agrees", "mismatch_routing_same", ".2g"),
    ("logp gap, routing differs", "mismatch_routing_differs", ".2g"),
)


def load(study: Study) -> dict[str, list[tuple[int, list[dict]]]]:
    """label (the arm, with the sweep point) -> [(seed, rows)] for the runs that have logged."""
    out: dict[str, list[tuple[int, list[dict]]]] = {label: [] for label in labels(study)}
    for run in study.runs:
        if (run.run_dir / METRICS_FILE).is_file():
            last = run.steps or study.steps
            rows = [r for r in read_metrics(run.run_dir) if r["step"] <= last]
            out[run.label].append((run.seed, rows))
    return out


def check_logged(study: Study) -> None:
    """--report-only: a UserError, before anything is written, where no run of the study has
    logged a step (no DIR, or a DIR of other runs): there is nothing to report."""
    for run in study.runs:
        if (run.run_dir / METRICS_FILE).is_file() and read_metrics(run.run_dir):
            return
    why = f" (none of its {len(study.runs)} run(s) has logged a step)" if study.out.exists() else ""
    raise UserError(f"no study in {study.out}{why}: run it without --report-only")


def labels(study: Study) -> list[str]:
    """The labels the report compares: per sweep value, every arm."""
    if study.sweep is None:
        return list(study.algos)
    return [f"{a} @ {study.sweep.point(v)}" for v in study.sweep.values for a in study.algos]


def write_report(study: Study, margin: float, command: str, failed: list[str]) -> Path:
    per_seed = load(study)
    summaries = {a: [summarize_run(a, s, rows, margin) for s, rows in runs]
                 for a, runs in per_seed.items()}  # fmt: skip
    events = {(r.algo, r.seed): r.events for runs in summaries.values() for r in runs}
    by_algo = [(a, aggregate_seeds([rows for _, rows in runs]))
               for a, runs in per_seed.items() if runs]  # fmt: skip
    arm_of = {r.label: r.algo for r in study.runs}
    levels = {a: study.algos[arm_of.get(a, a)]["level"] for a in per_seed if arm_of.get(a, a)
              in study.algos}  # fmt: skip
    figures = write_figures(study.out, by_algo, levels, per_seed, events)
    text = "\n".join([
        *_header(study, margin, command),
        *_settings(study),
        *_summary(study, summaries, margin),
        *_scaling(study, summaries, per_seed, figures),
        *_mechanism(summaries),
        *_findings(study, summaries, levels, margin),
        *_events(summaries, margin),
        *_runs(study, summaries, failed),
        *_figures(figures),
    ])  # fmt: skip
    path = study.out / "report.md"
    with temp_file_for(path) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return path


def _scaling(study: Study, summaries, per_seed, figures: list[str]) -> list[str]:
    """The sweep's table, and its figure (added to `figures`)."""
    from megatron_gspo.study import scaling

    if study.sweep is None:
        return []
    flops = {}
    for run in study.runs:
        rows = dict(per_seed.get(run.label, [])).get(run.seed)
        if rows is not None:
            n = scaling.active_params(_model_path(run) / "config.json")
            flops[(run.label, run.seed)] = scaling.run_flops(rows, n)
    pts = scaling.points(study, summaries, flops)
    figures.insert(0, scaling.figure(study, pts, study.out))
    return scaling.table(study, pts)


def _model_path(run: RunSpec) -> Path:
    from megatron_gspo.config import load_config

    # (the study's copy of the base config: what the run read, there when the source is gone)
    return Path(load_config(run.train_config, list(run.overrides)).model.path)


def _header(study: Study, margin: float, command: str) -> list[str]:
    model = (
        f"`{study.made_model}` (made by make-task-model)" if study.made_model else "from the config"
    )
    return [
        f"# Study report: {', '.join(study.algos)} on MoE"
        + (f", swept over `{study.sweep.key}`" if study.sweep else ""),
        "",
        f"Reproduce: `{command}` (running it again continues an interrupted study).",
        "",
        f"Base config `{study.config}`, {study.steps} steps, seeds {', '.join(map(str, study.seeds))}, "
        f"starting model {model}. Overrides for every run: "
        f"{', '.join(f'`{o}`' for o in study.common) or 'none'}. Collapse: eval reward more than "
        f"{margin:g} below its running best, or a non-finite loss or grad norm.",
        "",
    ]


def _settings(study: Study) -> list[str]:
    rows = ["## Settings per arm", "",
            "| algo | loss | ratio level | clip low | clip high | aggregation | adv norm | "
            "mismatch | overlong buffer | routing replay | minibatches | lr |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for a, s in study.algos.items():
        rows.append(f"| {a} | {s['loss']} | {s['level']} | {s['clip_low']:g} | {s['clip_high']:g} "
                    f"| {s['agg']} | {s['adv_norm']} | {s['mismatch']} | {s['overlong']} "
                    f"| {s['routing_replay']} | {s['minibatches']} | {s['lr']:g} |")  # fmt: skip
    if study.sweep is not None:
        rows += ["", f"Swept: `{study.sweep.key}` = " + ", ".join(study.sweep.values)
                 + " (every arm at every value)."]  # fmt: skip
    return rows + [""]


def _summary(study: Study, summaries: dict[str, list[RunSummary]], margin: float) -> list[str]:
    head = "| algo | runs | " + " | ".join(t for t, _, _ in SUMMARY) + " | runs with a collapse |"
    rows = ["## Summary", "", "Mean over seeds, [lowest, highest seed] where there are several. "
            "Ratio std: of the sequence-level ratio for GSPO, of the token-level ratio for GRPO, SAPO "
            "and CISPO. Clipped: for CISPO the tokens whose weight was truncated (they keep a "
            "gradient); SAPO clips nothing.",
            "", head, "|" + "---|" * (len(SUMMARY) + 3)]  # fmt: skip
    for a, runs in summaries.items():
        cells = [_cell(spread(runs, name), fmt) for _, name, fmt in SUMMARY]
        collapsed = sum(bool(r.events) for r in runs)
        rows.append(f"| {a} | {len(runs)}/{len(study.seeds)} | " + " | ".join(cells)
                    + f" | {collapsed}/{len(runs)} |")  # fmt: skip
    return rows + [""]


def _mechanism(summaries: dict[str, list[RunSummary]]) -> list[str]:
    """Per algorithm: the share of trained tokens whose routing moved between the old log-probs
    and an update (any MoE layer), the token log-ratio std over those tokens and over the rest,
    and (with the rollout routing, R3) the train-rollout gap split by routing agreement."""
    head = "| algo | " + " | ".join(t for t, _, _ in MECHANISM) + " |"
    rows = ["## Mechanism: routing drift and token-level ratio noise", "",
            "Per update, averaged over steps, then mean over seeds [lowest, highest]. A token's "
            "routing is the top-k sets, in every MoE layer, of the position that produced it; it "
            "moved when any set differs from the one the old log-probs saw. The log-ratio is "
            "log pi_theta - log pi_old of the token, whatever the loss; its std is left out of an "
            "update whose group has fewer than 2 tokens (n/a: never measured, e.g. the rollout "
            "routing exists under R3 only).", "", head,
            "|" + "---|" * (len(MECHANISM) + 1)]  # fmt: skip
    for a, runs in summaries.items():
        cells = [_cell(spread(runs, name), fmt) for _, name, fmt in MECHANISM]
        rows.append(f"| {a} | " + " | ".join(cells) + " |")
    return rows + [""]


def _cell(s: Spread | None, fmt: str) -> str:
    return "n/a" if s is None else s.text(fmt)


def _findings(study: Study, summaries: dict[str, list[RunSummary]], levels: dict[str, str],
              margin: float) -> list[str]:  # fmt: skip
    from megatron_gspo.study.findings import findings

    lines = findings(summaries, levels, margin)
    return ["## Findings", "", *[f"- {line}" for line in lines], ""]


def _events(summaries: dict[str, list[RunSummary]], margin: float) -> list[str]:
    rows = ["## Collapse events", ""]
    found = [(r, e) for runs in summaries.values() for r in runs for e in r.events]
    if not found:
        return rows + [f"None: no eval reward fell more than {margin:g} below its best and every "
                       "loss and grad norm was finite.", ""]  # fmt: skip
    rows += ["| algo | seed | step | kind | detail |", "|---|---|---|---|---|"]
    rows += [f"| {r.algo} | {r.seed} | {e.step} | {e.kind} | {e.detail} |" for r, e in found]
    return rows + [""]


def _runs(study: Study, summaries: dict[str, list[RunSummary]], failed: list[str]) -> list[str]:
    from megatron_gspo.study.runner import log_name

    done = {(r.algo, r.seed): r for runs in summaries.values() for r in runs}
    rows = ["## Runs", "", "| run | steps | final eval | status | log |", "|---|---|---|---|---|"]
    for run in study.runs:
        s = done.get((run.label, run.seed))
        steps, last = (s.steps_done if s else 0), run.steps or study.steps
        status = "failed" if run.name in failed else ("complete" if steps >= last
                                                      else "not finished")  # fmt: skip
        final = f"{s.values['eval_final']:.3f}" if s and "eval_final" in s.values else "n/a"
        log = Path("logs") / log_name(run)
        rows.append(f"| {run.name} | {steps}/{last} | {final} | {status} | `{log}` |")
    return rows + [""]


def _figures(names: list[str]) -> list[str]:
    rows = ["## Figures", ""]
    from megatron_gspo.study.scaling import CAPTION, FIGURE

    for name in names:
        caption = CAPTION if name == FIGURE else CAPTIONS[name]
        rows += [f"### {caption}", "", f"![{caption}]({name})", ""]
    return rows
