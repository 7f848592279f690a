"""DIR/study.json, what a study ran, kept for the invocations after it:

    {"config": the base config (resolved),
     "runs": {run name: {"overrides": [...], "config_sha256": ...}},  every run ever planned
     "study": the study the last command that ran planned (its flags, arms, seeds, runs)}

"runs" guards the comparison: a later invocation whose base config or settings differ for a run
that already started is refused (`check_manifest`) instead of mixing two settings in one table.
"study" is what `--report-only` reports (`read_study`): read back as it was planned, whatever
flags the report-only command was given, so a report never lists runs that were never run. A
record written before "study" was kept has none; the study's command, run again, writes it (the
finished runs are skipped).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.outputs import check_new_output, temp_file_for
from megatron_gspo.study.overrides import Sweep
from megatron_gspo.study.plan import SNAPSHOT, RunSpec, Study

MANIFEST = "study.json"


@dataclass(frozen=True)
class Recorded:
    """The study as the last command that ran it recorded it, and that command's flags."""

    study: Study
    flags: dict


def check_manifest(study: Study, flags: dict | None = None) -> None:
    """Refuse to continue a run that was started with other settings; record the new ones and
    the study (with the command's `flags`), and (re)write the base config's copy the runs read."""
    check_study_dir(study.out)
    path = study.out / MANIFEST
    old = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    sha = _sha(study.config)
    new = {r.name: {"overrides": list(r.overrides), "config_sha256": sha} for r in study.runs}
    started = [r for r in study.runs if r.run_dir.exists()]
    for run in started:
        before = old["runs"].get(run.name)
        if before is None or before == new[run.name]:
            continue
        changed = sorted(set(run.overrides) ^ set(before["overrides"]))
        what = ", ".join(changed) or f"{study.config} changed since"
        raise UserError(
            f"{run.run_dir} was started with other settings ({what}); "
            "pass a new --out, or delete that run directory to redo it"
        )
    record = {"config": str(study.config.resolve()), "runs": old["runs"] | new,
              "study": study_record(study, flags or {})}  # fmt: skip
    _write_json(path, record)
    snapshot = study.out / SNAPSHOT
    if not started or not snapshot.is_file():
        _copy_atomic(study.config, snapshot)


def study_record(study: Study, flags: dict) -> dict:
    """The study as JSON (its run directories relative to DIR, which may move)."""
    sweep = study.sweep
    return {
        "flags": flags,
        "config": str(study.config),
        "algos": study.algos,
        "seeds": study.seeds,
        "steps": study.steps,
        "eval_every": study.eval_every,
        "common": study.common,
        "made_model": None if study.made_model is None else str(study.made_model),
        "sweep": None if sweep is None else {"key": sweep.key, "values": list(sweep.values)},
        "runs": [{"algo": r.algo, "seed": r.seed, "dir": str(r.run_dir.relative_to(study.out)),
                  "overrides": list(r.overrides), "point": r.point, "steps": r.steps}
                 for r in study.runs],
    }  # fmt: skip


def read_study(out: Path) -> Recorded:
    """The study recorded in `out`/study.json, its runs under `out`; else a one-line UserError."""
    path = out / MANIFEST
    if not path.is_file():
        why = f" (no {MANIFEST})" if out.is_dir() else ""
        raise UserError(f"no study in {out}{why}: run it without --report-only")
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({e}); run the study without --report-only to "
                        "record it again (its finished runs are skipped)") from None  # fmt: skip
    if not isinstance(rec, dict) or "study" not in rec:
        raise UserError(f"{path} predates the record --report-only reads; run the study once "
                        "without --report-only to record it (its finished runs are skipped)")  # fmt: skip
    try:
        return Recorded(_study(rec["study"], out), dict(rec["study"]["flags"]))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path} is damaged ({type(e).__name__}: {e}); run the study without "
                        "--report-only to record it again") from None  # fmt: skip


def _study(rec: dict, out: Path) -> Study:
    sweep = rec["sweep"]
    study = Study(Path(rec["config"]), out, dict(rec["algos"]), list(rec["seeds"]),
                  int(rec["steps"]), int(rec["eval_every"]), common=list(rec["common"]),
                  made_model=None if rec["made_model"] is None else Path(rec["made_model"]),
                  sweep=None if sweep is None else Sweep(sweep["key"], tuple(sweep["values"])))  # fmt: skip
    study.runs = [RunSpec(r["algo"], r["seed"], out / r["dir"], tuple(r["overrides"]),
                          r["point"], out, r["steps"]) for r in rec["runs"]]  # fmt: skip
    return study


def check_study_dir(out: Path) -> None:
    """`out` (--out) can hold the study: an earlier run of it (a directory, continued) or a
    path that can be created; else a UserError, before anything is written."""
    if not out.exists():
        check_new_output(out, "--out")
        return
    if not out.is_dir():
        raise UserError(f"--out {out} is a file, not a study directory; choose another --out")
    try:  # (tried, not read from the permission bits: root cannot write in /sys either)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=out))
    except OSError as e:
        raise UserError(
            f"cannot write in study directory {out} ({e.strerror}); choose another --out"
        ) from None


def _copy_atomic(src: Path, dst: Path) -> None:
    with temp_file_for(dst) as tmp:
        tmp.write_bytes(Path(src).read_bytes())


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with temp_file_for(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
