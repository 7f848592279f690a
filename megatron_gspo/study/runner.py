"""Running a study: each run is a `megatron-gspo train` subprocess in DIR/runs/<arm>/seed<k>
(DIR/runs/<arm>/<j>_<value>/seed<k> in a sweep).

A run whose newest checkpoint is its last step and verifies against its manifest (the check
the trainer's --resume makes, `checkpointing.verify`) is complete and skipped; one with an
earlier checkpoint, or whose newest does not verify, is continued with `--resume` (which moves a
damaged checkpoint to checkpoints/unverified/ and goes on from the newest one that verifies); one
with none (killed before its first checkpoint) is started again, by the trainer's own start
(train/run_dir.py: the attempt's files are moved to aborted/<k>/, nothing holding weights is
deleted). Runs go one at a time (seed by seed, every algorithm per seed first),
so an interrupted study has comparable runs for the seeds it finished. A failed run is reported
and the others still run; the same command retries it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.study.plan import RunSpec, Study, task_of
from megatron_gspo.train.console import format_duration


@dataclass(frozen=True)
class RunState:
    kind: str  # complete | resume | fresh
    step: int  # the newest checkpoint's step (0: none)
    damaged: str | None = None  # why the newest checkpoint does not verify (None: it does)

    def action(self) -> str:
        """What the study does with the run, in a few words."""
        if self.kind == "fresh":
            return "start"
        if self.damaged is None:
            return f"resume from step {self.step}"
        return (f"resume: its newest checkpoint, step_{self.step}, does not verify "
                f"({self.damaged}); --resume moves it to checkpoints/unverified/ and goes on from "
                "the newest one that does")  # fmt: skip


def run_state(run: RunSpec, steps: int) -> RunState:
    """Complete only when the newest checkpoint is at `steps` (or past) and verifies: a damaged
    one is the trainer's --resume to set aside."""
    from megatron_gspo.train.checkpointing import latest, verify

    ckpt = latest(run.run_dir)
    if ckpt is None:
        return RunState("fresh", 0)
    step = int(ckpt.name.removeprefix("step_"))
    damaged = verify(ckpt)
    if damaged is not None:
        return RunState("resume", step, damaged)
    return RunState("complete" if step >= steps else "resume", step)


def train_command(study: Study, run: RunSpec, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config", str(run.train_config)]
    cmd += ["--run-dir", str(run.run_dir), *(["--resume"] if resume else []), *run.overrides]
    return cmd


def log_path(study: Study, run: RunSpec) -> Path:
    return study.out / "logs" / log_name(run)


def log_name(run: RunSpec) -> str:
    """<arm>[-<j>_<value>]-seed<k>.log (the sweep point as its run directory names it)."""
    point = run.run_dir.parent.name if run.point is not None else None
    return f"{run.algo}{'-' + point if point else ''}-seed{run.seed}.log"


def ensure_model(study: Study) -> None:
    """Make the starting model in DIR/model when the base config's model.path does not exist."""
    path = study.made_model
    if path is None or path.exists():
        return
    task = task_of(study.config, study.common)
    args = ["--task", task, *preset_for(task)]
    print(f"starting model: making {path} (make-task-model {' '.join(args)})", flush=True)
    cmd = [sys.executable, "-m", "megatron_gspo", "make-task-model", "--out", str(path)]
    log = study.out / "logs" / "make-task-model.log"
    if _call(cmd + args, log) != 0:
        raise UserError(f"make-task-model failed; see {log}")


def preset_for(task: str) -> list[str]:
    """`--preset NAME` of the model preset made for `task` (sortlong: drift), else nothing."""
    from megatron_gspo.data.task_model import PRESETS

    names = [name for name, p in PRESETS.items() if p.get("task") == task]
    return ["--preset", names[0]] if names else []


def execute(study: Study) -> list[RunSpec]:
    """Run what is not complete; returns the runs that failed."""
    failed = []
    states = {run: run_state(run, run.steps or study.steps) for run in study.runs}
    todo = [run for run in study.runs if states[run].kind != "complete"]
    done = len(study.runs) - len(todo)
    print(f"study: {len(study.runs)} runs, {done} complete, {len(todo)} to run", flush=True)
    for i, run in enumerate(todo, start=1):
        state = states[run]
        print(f"[{i}/{len(todo)}] {run.name}: {state.action()}", flush=True)
        t0 = time.monotonic()
        rc = _call(train_command(study, run, state.kind == "resume"), log_path(study, run))
        took = format_duration(time.monotonic() - t0)
        if rc == 0:
            print(f"[{i}/{len(todo)}] {run.name}: done in {took}", flush=True)
        else:
            print(f"[{i}/{len(todo)}] {run.name}: FAILED (exit {rc}) after {took}; "
                  f"see {log_path(study, run)}", flush=True)  # fmt: skip
            failed.append(run)
    return failed


def _call(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
