"""A --resume of a run with no step left to train, answered before anything starts.

`megatron-gspo train --resume` on a run at its last step (train.steps, or --steps) used to start
the rollout servers, build the model and load its checkpoint before the step hooks said there was
nothing to train: seconds on the quickstart's tiny model, minutes on a large one. `nothing_left`
asks the run directory first: global rank 0, holding its lock (shared, taken without writing: a
read-only copy of a finished run answers too), reads the step of the newest checkpoint (run_dir.py
`finished_step`); when that is the last step or past it, every rank learns so over a bare process
group (no megatron imported), rank 0 prints the line (hooks.py `nothing_to_train`), and the
command ends with exit 0, having started and written nothing. Anything else goes on to the start
as before.

The launch scripts ask the same question before they start a server (`launch_line`, from
launch/plan.py on --resume): every node of a launch asks at once, so it reads the files without
the lock (a trainer holding it is refused by the start, as before).
"""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.comm import bcast, rank
from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.model.parallel import start_process_group
from megatron_gspo.train import checkpointing
from megatron_gspo.train.hooks import last_step, nothing_to_train
from megatron_gspo.train.run_dir import RunDirLock, finished_step


def nothing_left(
    cfg: Config, run_dir: Path, max_steps: int | None, allow_config_change: bool
) -> bool:
    """Every rank of the launch, on --resume: whether `run_dir` has no step left to train (up to
    train.steps, or --steps: `max_steps`); rank 0 prints the line that says so. A refusal rank 0
    meets on the way (another trainer holds the directory, a config --resume does not accept)
    is every rank's UserError, as the start's own would be."""
    start_process_group()
    answer: tuple[str, str | None] | None = None
    if rank() == 0:
        try:
            answer = ("ok", _line(cfg, run_dir, last_step(cfg, max_steps), allow_config_change))
        except UserError as e:
            answer = ("error", str(e))
    kind, line = bcast(answer)
    if kind == "error":
        raise UserError(line)
    if line is not None and rank() == 0:
        print(line, flush=True)
    return line is not None


def launch_line(
    cfg: Config, run_dir: Path, max_steps: int | None, allow_config_change: bool
) -> str | None:
    """A launch script's --resume, before any server starts: the nothing-to-train line, or None
    (the launch goes on and its trainer decides). Reads the files only, without the lock: nothing
    in `run_dir` is made or written. A config --resume does not accept is the UserError."""
    return _line(cfg, run_dir, last_step(cfg, max_steps), allow_config_change, locked=False)


def _line(
    cfg: Config, run_dir: Path, last: int, allow_config_change: bool, locked: bool = True
) -> str | None:
    """The nothing-to-train line, or None (the start goes on and decides); `locked`: read under
    the run directory's lock (rank 0 of a start; a launch script's nodes read without it)."""
    if not checkpointing.checkpoint_root(run_dir).is_dir():
        return None
    lock = RunDirLock(run_dir).acquire_to_read() if locked else None  # (shared: writes nothing)
    try:
        step = finished_step(run_dir, cfg, allow_config_change, last)
    finally:
        if lock is not None:
            lock.release()
    return None if step is None else nothing_to_train(run_dir, step, last, cfg.train.steps)
