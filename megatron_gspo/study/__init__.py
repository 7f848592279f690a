"""`megatron-gspo study`: any set of arms (GSPO, GRPO plain/R2/R3, SAPO, CISPO, ...) on the same
model, data and seeds, optionally swept over one config key.

    megatron-gspo study --config configs/tiny_moe_gspo.yaml --algos gspo,grpo,grpo_r3,sapo,cispo \\
        --seeds 2 --out runs/study [--sweep KEY=v1,v2] [key.sub=value ...] [ARM:key.sub=value ...]

An arm is a name with a config of the base config's family (configs/drift_moe_<arm>.yaml,
configs/tiny_moe_<arm>.yaml; plan.py). Each (arm, sweep value, seed) is one `megatron-gspo train`
run in DIR/runs/<arm>/[<j>_<value>/]seed<k>. Then DIR/report.md and the figures are written
(report_md.py, figures.py; with a sweep, scaling.py's table and figure). Running the same
command again skips the complete runs, continues the interrupted ones from their newest
checkpoint, and rebuilds the report from what finished.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from megatron_gspo.errors import UserError


def run_study(args: argparse.Namespace, command: str) -> Path:
    """Plan, run what is left, write the report; returns DIR/report.md."""
    from megatron_gspo.study import overrides, plan
    from megatron_gspo.study.report_md import check_logged, write_report
    from megatron_gspo.study.runner import ensure_model, execute

    if not args.collapse_margin > 0:
        raise UserError(f"--collapse-margin {args.collapse_margin}: give a margin > 0")
    names = list(dict.fromkeys(plan.split_names(args.algos)))  # (a repeat is refused below)
    if not names:
        raise UserError(f"--algos {args.algos!r}: name the arms, comma-separated (gspo,grpo)")
    table = plan.algo_table(fallback=Path(args.config).parent, base=Path(args.config), arms=names)
    algos = plan.parse_algos(args.algos, table)
    sweep = overrides.parse_sweep(args.sweep)
    study = plan.build_study(args.config, args.out, algos, args.seeds, args.overrides,
                             args.steps, table, sweep)  # fmt: skip
    if args.report_only:
        check_logged(study)  # nothing to report: say so, write nothing
    plan.check_manifest(study)
    failed: list[str] = []
    if not args.report_only:
        ensure_model(study)
        failed = [r.name for r in execute(study)]
    report = write_report(study, args.collapse_margin, command, failed)
    print(f"wrote {report}", flush=True)
    if failed:
        raise UserError(
            f"{len(failed)} run(s) failed ({', '.join(failed)}); see {study.out}/logs, "
            "then run the same command again to retry them"
        )
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="base YAML run config")
    p.add_argument("--algos", default="gspo,grpo,grpo_r2,grpo_r3", help="comma-separated")
    p.add_argument("--seeds", type=int, default=1, help="seeds per algorithm (config seed + i)")
    p.add_argument("--out", required=True, type=Path, help="study directory")
    p.add_argument("--steps", type=int, default=None, help="train.steps for every run")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="KEY=v1,v2,...",
        help="run every arm at every value of one config key (a scaling axis)",
    )
    p.add_argument(
        "--collapse-margin", type=float, default=0.2,
        help="a collapse is eval reward this far below its running best (or a non-finite loss)",
    )  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="rewrite the report, run nothing")
    p.add_argument(
        "overrides", nargs="*", metavar="[ALGO:]key.sub=value",
        help="config overrides for every run, or with ALGO: for that algorithm's runs",
    )  # fmt: skip


def command_text(args: argparse.Namespace) -> str:
    """The command that reproduces (and continues) this study, for the report."""
    parts = ["--config", str(args.config), "--algos", args.algos, "--seeds", str(args.seeds)]
    parts += ["--out", str(args.out)]
    if args.steps is not None:
        parts += ["--steps", str(args.steps)]
    if args.sweep is not None:
        parts += ["--sweep", args.sweep]
    if args.collapse_margin != 0.2:
        parts += ["--collapse-margin", f"{args.collapse_margin:g}"]
    return "megatron-gspo study " + shlex.join(parts + list(args.overrides))


def _cmd_study(args: argparse.Namespace) -> None:
    run_study(args, command_text(args))


def register(subparsers) -> None:
    """Add the `study` subcommand to the CLI's subparsers."""
    p = subparsers.add_parser("study", help="arms (gspo, grpo, sapo, ...) over seeds, a report")
    add_arguments(p)
    p.set_defaults(func=_cmd_study)


def main(argv: list[str] | None = None) -> None:
    """`python -m megatron_gspo.study ...`: the same command without the CLI around it."""
    import os

    p = argparse.ArgumentParser(prog="megatron-gspo study", description=__doc__.splitlines()[0])
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run_study(args, command_text(args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
