"""The study's findings as plain sentences, computed from the numbers (never hand-written), so
they say what the runs show, including "no difference" and "too few seeds to tell"."""

from __future__ import annotations

from megatron_gspo.study.analysis import RunSummary, Spread, spread


def findings(summaries: dict[str, list[RunSummary]], levels: dict[str, str], margin: float):
    ran = {a: runs for a, runs in summaries.items() if runs}
    if not ran:
        return ["No run has logged a step yet."]
    lines = _eval_lines(ran)
    lines += _collapse_lines(ran, margin)
    lines += _metric_line(ran, "ratio_std", "Mean importance-ratio std per step", ".2g", levels)
    lines += _metric_line(ran, "clip_tokens", "Clipped tokens", ".2%", {})
    lines += _metric_line(ran, "clip_seqs", "Clipped sequences", ".2%", {})
    lines += _metric_line(ran, "routing_changed", "Routing changed by the updates", ".2%", {})
    lines += _metric_line(ran, "mismatch", "Mean |logp train - logp rollout|", ".2g", {})
    lines += _metric_line(ran, "tokens_changed", "Trained tokens whose routing moved", ".2%", {})
    lines += _split_line(ran)
    return lines


SPLIT = ("std_routing_same", "std_routing_changed")


def _split_line(ran: dict[str, list[RunSummary]]) -> list[str]:
    """How much noisier the token log-ratio is where routing moved than where it did not, over
    the runs that measured both (a std over fewer than 2 tokens is not logged: a run whose moved
    group never had 2 is not compared, nor one seed's value against another's)."""
    parts = []
    for a, runs in ran.items():
        both = [r for r in runs if all(k in r.values for k in SPLIT)]
        same, moved = spread(both, SPLIT[0]), spread(both, SPLIT[1])
        if same is not None and moved is not None and same.mean > 0:
            parts.append(f"{a} {moved.mean / same.mean:.2g}x ({moved.mean:.2g} vs {same.mean:.2g})")
    if not parts:
        return []
    return ["Token log-ratio std where routing moved vs where it did not (ratio of the two): "
            + ", ".join(parts) + "."]  # fmt: skip


def _spreads(ran: dict[str, list[RunSummary]], name: str) -> dict[str, Spread]:
    return {a: s for a, runs in ran.items() if (s := spread(runs, name)) is not None}


def _eval_lines(ran: dict[str, list[RunSummary]]) -> list[str]:
    finals = _spreads(ran, "eval_final")
    if not finals:
        return ["No eval reward was logged (train.eval_every is 0)."]
    order = sorted(finals, key=lambda a: -finals[a].mean)
    starts = _spreads(ran, "eval_start")
    lines = ["Final greedy eval reward, highest first: "
             + ", ".join(f"{a} {finals[a].text()}" for a in order) + "."]  # fmt: skip
    changes = [f"{a} {finals[a].mean - starts[a].mean:+.3f}" for a in order if a in starts]
    if changes:
        lines.append("Change from the starting model's eval reward: " + ", ".join(changes) + ".")
    top = order[0]
    if min(s.n for s in finals.values()) < 2:
        lines.append("With one seed per algorithm there is no spread to judge these differences "
                     "against; rerun with --seeds 3 or more before concluding.")  # fmt: skip
    elif tied := [a for a in order[1:] if finals[a].overlaps(finals[top])]:
        lines.append(f"{top}'s lead over {', '.join(tied)} is within the seed spread (the ranges "
                     "overlap): these seeds do not separate them.")  # fmt: skip
    elif len(order) > 1:
        lines.append(f"{top}'s final eval range lies above every other algorithm's range.")
    return lines


def _collapse_lines(ran: dict[str, list[RunSummary]], margin: float) -> list[str]:
    hit = {a: [r for r in runs if r.events] for a, runs in ran.items()}
    if not any(hit.values()):
        return [f"No run collapsed (eval never fell more than {margin:g} below its best; every "
                "loss and grad norm was finite)."]  # fmt: skip
    parts = []
    for a, runs in ran.items():
        bad = hit[a]
        where = ", ".join(
            f"seed {r.seed} step {r.events[0].step} ({r.events[0].kind})" for r in bad
        )
        parts.append(f"{a} {len(bad)}/{len(runs)}" + (f" ({where})" if bad else ""))
    return ["Runs with a collapse event: " + "; ".join(parts) + "."]


def _metric_line(ran, name: str, title: str, fmt: str, levels: dict[str, str]) -> list[str]:
    vals = _spreads(ran, name)
    if not vals:
        return []
    parts = [f"{a} {s.text(fmt)}" + (f" ({levels[a]}-level)" if a in levels else "")
             for a, s in vals.items()]  # fmt: skip
    return [f"{title}: " + ", ".join(parts) + "."]
