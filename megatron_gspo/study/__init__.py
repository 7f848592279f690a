"""`megatron-gspo study`: any set of arms (GSPO, GRPO plain/R2/R3, SAPO, CISPO, ...) on the same
model, data and seeds, optionally swept over one config key.

    megatron-gspo study --config configs/tiny_moe_gspo.yaml --algos gspo,grpo,grpo_r3,sapo,cispo \\
        --seeds 2 --out runs/study [--sweep KEY=v1,v2] [key.sub=value ...] [ARM:key.sub=value ...]

An arm is a name with a config of the base config's family (configs/drift_moe_<arm>.yaml,
configs/tiny_moe_<arm>.yaml; plan.py). Each (arm, sweep value, seed) is one `megatron-gspo train`
run in DIR/runs/<arm>/[<j>_<value>/]seed<k>. Then DIR/report.md and the figures are written
(report_md.py, figures.py; with a sweep, scaling.py's table and figure). Running the same
command again skips the complete runs, continues the interrupted ones from their newest
checkpoint, and rebuilds the report from what finished. `--report-only --out DIR` rebuilds the
report of the study DIR/study.json records (record.py) and runs nothing: its other flags cannot
change that study, so they are ignored (a note names those that differ from the record).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from megatron_gspo.errors import UserError

# The flags that say what the study is (recorded in study.json), and their defaults
DEFAULTS = {"config": None, "algos": "gspo,grpo,grpo_r2,grpo_r3", "seeds": 1, "steps": None,
            "sweep": None, "overrides": []}  # fmt: skip


def run_study(args: argparse.Namespace, command: str) -> Path:
    """Plan, run what is left, write the report; returns DIR/report.md."""
    from megatron_gspo.study import overrides, plan
    from megatron_gspo.study.record import check_manifest
    from megatron_gspo.study.report_md import write_report
    from megatron_gspo.study.runner import ensure_model, execute

    if not args.collapse_margin > 0:
        raise UserError(f"--collapse-margin {args.collapse_margin}: give a margin > 0")
    if args.report_only:
        return report_only(args)
    if args.config is None:
        raise UserError("--config is missing: name the base config the study runs from")
    names = list(dict.fromkeys(plan.split_names(args.algos)))  # (a repeat is refused below)
    if not names:
        raise UserError(f"--algos {args.algos!r}: name the arms, comma-separated (gspo,grpo)")
    table = plan.algo_table(fallback=Path(args.config).parent, base=Path(args.config), arms=names)
    algos = plan.parse_algos(args.algos, table)
    sweep = overrides.parse_sweep(args.sweep)
    study = plan.build_study(args.config, args.out, algos, args.seeds, args.overrides,
                             args.steps, table, sweep)  # fmt: skip
    check_manifest(study, study_flags(args))
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


def report_only(args: argparse.Namespace) -> Path:
    """--report-only: the report of the study recorded in DIR/study.json, as the command that ran
    it planned it; nothing is run and the record is left as it is. The study's flags given here
    are ignored (a note names those that differ from the record)."""
    from megatron_gspo.study.record import MANIFEST, read_study
    from megatron_gspo.study.report_md import check_logged, write_report

    recorded = read_study(args.out)
    ignored = ignored_flags(args, recorded.flags)
    if ignored:
        print(f"note: --report-only reports the study recorded in {args.out / MANIFEST}; "
              f"ignoring what differs from it: {', '.join(ignored)}", file=sys.stderr, flush=True)  # fmt: skip
    check_logged(recorded.study)  # nothing to report: say so, write nothing
    ran = argparse.Namespace(**{**DEFAULTS, **recorded.flags}, out=args.out,
                             collapse_margin=args.collapse_margin)  # fmt: skip
    report = write_report(recorded.study, args.collapse_margin, command_text(ran), [])
    print(f"wrote {report}", flush=True)
    return report


def study_flags(args: argparse.Namespace) -> dict:
    return {"config": str(args.config), "algos": args.algos, "seeds": args.seeds,
            "steps": args.steps, "sweep": args.sweep, "overrides": list(args.overrides)}  # fmt: skip


def ignored_flags(args: argparse.Namespace, recorded: dict) -> list[str]:
    """The study's flags given (not left at their defaults) that differ from the recorded ones."""
    found = []
    for name, default in DEFAULTS.items():
        given = _same_form(name, getattr(args, name))
        if given not in (_same_form(name, default), _same_form(name, recorded.get(name))):
            found.append("the overrides" if name == "overrides" else f"--{name}")
    return found


def _same_form(name: str, value: Any) -> Any:
    """A flag's value in the form two spellings of one setting share."""
    if value is None:
        return None
    if name == "config":
        return Path(str(value)).resolve()
    if name == "algos":
        return [a.strip() for a in str(value).split(",") if a.strip()]
    return list(value) if name == "overrides" else value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="base YAML run config (needed unless --report-only)")
    p.add_argument("--algos", default=DEFAULTS["algos"], help="comma-separated")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"],
                   help="seeds per algorithm (config seed + i)")  # fmt: skip
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
    p.add_argument(
        "--report-only", action="store_true",
        help="rewrite the report of the study recorded in OUT/study.json, run nothing (needs only "
        "--out; the study's other flags are ignored)",
    )  # fmt: skip
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
