"""The run directory a trainer owns: one trainer at a time, and what a start does with what it
finds there.

    nothing of a run                         start (with or without --resume: it says so, in
                                             one line, so a mistyped --run-dir shows)
    an earlier attempt, no checkpoint        start again, either command: the attempt's files
                                             (metrics, config, the disk sync's weights/, a
                                             checkpoints/ with anything set aside in it) are
                                             moved to aborted/<k>/; only saves cut short
                                             (checkpoints/.step_N.tmp) are deleted; logs/ goes on
    a checkpoint (step_N), --resume          resume from the newest one that verifies against
                                             its manifest (newer ones that do not, a lost state
                                             file included, are moved to
                                             checkpoints/unverified/), if the config is the run's;
                                             none verifies: error, nothing changed
    a checkpoint (step_N), no --resume       error: pass --resume, or another --run-dir
    one at the last step, --resume           "nothing to train" before anything starts (the
                                             newest verifies, the config is the run's:
                                             `finished_step`, train/finished.py); exit 0
    a run directory a start cannot write     error naming the path, nothing changed (the
                                             "nothing to train" answer needs no write)

Resuming with a config that differs from the run's in what it computes (the algorithm, the
data, the optimizer...) is refused unless --allow-config-change; what may change freely is in
MAY_CHANGE (how long to run, how to log, where the servers are).

A start decides all this first (`prepare`) and does it (`StartPlan.carry_out`) only once its
inputs are checked (the model built, the dataset and the reward loaded): a start refused before
then leaves the directory as it found it, and removes one it made.

The lock is an `fcntl.flock` on RUN_DIR/.lock, taken by global rank 0 (the process that writes
the directory) before it looks, and released when that process ends, however it ends (the
kernel drops the lock of a killed process). A second trainer gets an error naming the first.
A look that only reads (`RunDirLock.acquire_to_read`: is there a step left?) takes it shared,
through the file opened read-only, so a read-only copy of a finished run still answers.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gspo.config import Config, build
from megatron_gspo.config_renames import rename_keys
from megatron_gspo.errors import UserError
from megatron_gspo.train import checkpointing
from megatron_gspo.train.files import fsync_dir
from megatron_gspo.yaml_io import read_yaml

LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"
# What an attempt leaves, moved aside (a new run would append to it or mix with it): its record,
# the disk sync's weights/ (the policy it trained to, maybe many steps past the base model) and a
# checkpoints/ holding anything but saves cut short (a checkpoint set aside in unverified/, a
# user's file); one holding only those is deleted (`checkpointing.only_half_writes`). logs/ stays
# where it is: a launch script writes there before the trainer starts, and every log is appended
# to, with a header at each start, so the earlier attempt's lines (why it ended) stay above.
ATTEMPT_FILES = ("metrics.jsonl", CONFIG_FILE, "tensorboard", "wandb", "wandb_run_id", "weights")
CHECKPOINTS = "checkpoints"
ABORTED = "aborted"
# where a start writes: the directory itself (the metrics, the config), the logs (appended to),
# checkpoints/ and its step_N (saved, set aside, rotated out), and the sinks' and sync's folders
WRITTEN = ("logs", CHECKPOINTS, f"{CHECKPOINTS}/unverified", "tensorboard", "weights", ABORTED)
# config keys --resume may change: how long to run, how to log, where the servers are (a launch
# script starts them on new ports each time); a key ending in "." stands for its section
MAY_CHANGE = (
    "train.steps",
    "logging.",
    "rollout.urls",
    "rollout.url_nodes",
    "rollout.router_url",
    "rollout.health_timeout_s",
    "rollout.connect_grace_s",
    "rollout.sglang_python",
)


class RunDirLock:
    """An exclusive flock on RUN_DIR/.lock for as long as this process holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._fd: int | None = None
        self._wrote = False

    def acquire(self) -> RunDirLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"--run-dir {self.run_dir} is a file; pass --run-dir NEW_DIR")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent that is a file, a read-only place
            raise UserError(
                f"cannot make --run-dir {self.run_dir} ({e.strerror}); pass --run-dir NEW_DIR"
            ) from None
        path = self.run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only copy of a run, a directory of another user
            raise not_writable(self.run_dir, path, e) from None
        self._lock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd, self._wrote = fd, True
        return self

    def acquire_to_read(self) -> RunDirLock:
        """A shared lock, for a look that writes nothing: its file opened read-only (a
        read-only run directory still answers), none where there is none (no trainer holds it:
        a trainer makes it first). A trainer holding the directory is the same error."""
        try:
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return self
        self._lock(fd, fcntl.LOCK_SH)
        self._fd, self._wrote = fd, False
        return self

    def _lock(self, fd: int, kind: int) -> None:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
            os.close(fd)
            raise UserError(
                f"{self.run_dir} is in use by another trainer ({holder}); wait for it to end "
                "or stop it, or pass --run-dir NEW_DIR"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            if self._wrote:
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


def not_writable(run_dir: Path, path: Path, e: OSError | None = None) -> UserError:
    """The one line for a path in `run_dir` a start must write and cannot."""
    why = os.strerror(errno.EACCES) if e is None else e.strerror
    return UserError(
        f"cannot write {path} ({why}): a run writes its checkpoints, metrics and logs in its "
        f"--run-dir; nothing was changed: make it writable (chmod -R u+w {run_dir}) and run the "
        "command again, or pass --run-dir NEW_DIR"
    )


def check_writable(run_dir: Path) -> None:
    """Refuse, naming it, the first path in `run_dir` a start writes and cannot (a read-only
    copy of a run, a logs/ of another user), before anything is written: the start would fail
    on it half-way (after moving files aside, with the servers started)."""
    logs = run_dir / "logs"
    paths = [run_dir, *(run_dir / name for name in WRITTEN)]
    paths += sorted(logs.iterdir()) if logs.is_dir() else []  # (each log is appended to)
    paths += checkpointing.saved_checkpoints(run_dir)  # (moved aside or rotated out)
    for p in paths:
        if p.exists() and not os.access(p, os.W_OK):
            raise not_writable(run_dir, p)


@dataclass
class StartPlan:
    """What a start does in the run directory it found (`prepare`), done by `carry_out` once
    the start's inputs are checked: a start refused before then (a model, a dataset or a reward
    that fails to load) leaves the directory as it was."""

    checkpoint: Path | None = None  # to resume from; None: a fresh start
    set_aside: list[tuple[Path, str]] = field(default_factory=list)  # newer, unverified: why
    clear: list[str] = field(default_factory=list)  # an earlier attempt's files
    changes: str | None = None  # a changed config resumed with (--allow-config-change)
    config_missing: bool = False  # resumed, though the run's config.yaml is gone

    def carry_out(self, run_dir: Path) -> None:
        """Rank 0, holding the lock: set aside, clear or keep what the plan says; print it."""
        if self.set_aside:
            why = "; ".join(f"{c.name}: {problem}" for c, problem in self.set_aside)
            dest = checkpointing.set_aside(run_dir, [c for c, _ in self.set_aside])
            assert self.checkpoint is not None  # (set aside only to resume from an older one)
            print(
                f"resuming from {self.checkpoint.name}, the newest checkpoint that verifies; "
                f"skipped {why} (moved to {dest.relative_to(run_dir)}/, not deleted)",
                flush=True,
            )
        if self.clear:
            print(_clear_attempt(run_dir, self.clear), flush=True)
        if self.changes is not None:
            assert self.checkpoint is not None
            path = run_dir / CONFIG_FILE
            kept = free_name(run_dir, f"config.until_{self.checkpoint.name}", ".yaml")
            os.replace(path, kept)
            print(
                f"resuming with a changed config ({self.changes}); the run's is kept as "
                f"{kept.name}",
                flush=True,
            )
        if self.config_missing:
            print(
                f"--resume: {run_dir / CONFIG_FILE} is missing, so this config was not compared "
                "with the run's; resuming with it (written as the run's config.yaml)",
                flush=True,
            )


def free_name(directory: Path, stem: str, suffix: str) -> Path:
    """`directory`/STEM.SUFFIX, else STEM.2.SUFFIX, .3, ...: the first not taken (a file kept
    there before is never replaced: resumed twice from one checkpoint with a changed config,
    the first's config.until_step_N.yaml is the one the steps up to N ran with)."""
    path, k = directory / f"{stem}{suffix}", 2
    while path.exists():
        path, k = directory / f"{stem}.{k}{suffix}", k + 1
    return path


def prepare(
    run_dir: Path, resume: bool, cfg: Config, allow_config_change: bool, new: bool = False
) -> StartPlan:
    """Rank 0, holding the lock: what this start does with what it finds in `run_dir` (the
    checkpoint to resume from, an earlier attempt without one to clear), or the error that
    refuses it. Changes nothing: `StartPlan.carry_out` does. `new`: this start made `run_dir`
    (a --resume there says so: a mistyped --run-dir)."""
    check_writable(run_dir)
    ckpt = checkpointing.latest(run_dir)
    if ckpt is not None:
        if not resume:
            raise UserError(
                f"{run_dir} holds an earlier run (newest checkpoint: {ckpt.name}); pass "
                "--resume to continue it or --run-dir NEW_DIR to start another"
            )
        ckpt, skipped = _verified(run_dir)
        changes = check_config(run_dir, cfg, allow_config_change)
        missing = not (run_dir / CONFIG_FILE).is_file()
        return StartPlan(ckpt, skipped, changes=changes, config_missing=missing)
    left = [name for name in (*ATTEMPT_FILES, CHECKPOINTS) if (run_dir / name).exists()]
    if not left and resume:
        print(resume_without_checkpoint(run_dir, new), flush=True)
    return StartPlan(clear=left)


def finished_step(run_dir: Path, cfg: Config, allow_config_change: bool, last: int) -> int | None:
    """Rank 0, holding the lock, on --resume: the newest checkpoint's step when it is `last` or
    past it and it is the one a resume continues from (it verifies against its manifest; the
    config is one --resume accepts, else `prepare`'s error). None where steps may be left or
    `prepare` must look closer (no checkpoint, a state file it cannot read, a newest one that
    does not verify). Reads the files only: no model, nothing written, and no megatron (whether
    its format is one this megatron-core reads, `checkpointing.loadable`, is left to the load:
    the import alone takes seconds)."""
    ckpt = checkpointing.latest(run_dir)
    step = None if ckpt is None else checkpointing.saved_step(ckpt)
    if ckpt is None or step is None or step < last or checkpointing.verify(ckpt) is not None:
        return None
    check_config(run_dir, cfg, allow_config_change)
    return step


def resume_without_checkpoint(run_dir: Path, new: bool) -> str:
    """The line for --resume on a run directory with no checkpoint (and no earlier attempt)."""
    if new:
        return (f"--resume: {run_dir} did not exist, so there is no checkpoint in it: starting a "
                "new run there (to continue an earlier run, pass its --run-dir)")  # fmt: skip
    return f"--resume: no checkpoint in {run_dir}: starting a new run"


def _verified(run_dir: Path) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and the newer ones that do not (with why). None
    verifying is an error."""
    ckpt, skipped = checkpointing.newest_verified(run_dir)
    if ckpt is None:
        why = "; ".join(f"{c.name}: {problem}" for c, problem in skipped)
        raise UserError(
            f"no checkpoint in {checkpointing.checkpoint_root(run_dir)} verifies ({why}); "
            "nothing was changed: restore the files from a copy, or start another run with "
            "--run-dir NEW_DIR"
        )
    return ckpt, skipped


def _clear_attempt(run_dir: Path, left: list[str]) -> str:
    """Move an attempt's files to aborted/<k>/ and delete its saves cut short (a checkpoints/
    holding only those); the line that says so. Nothing holding weights is deleted."""
    scratch = CHECKPOINTS in left and checkpointing.only_half_writes(run_dir)
    deleted = [CHECKPOINTS] if scratch else []
    moved = [n for n in left if n not in deleted]
    dest = None
    if moved:
        root = run_dir / ABORTED
        root.mkdir(exist_ok=True)
        taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
        dest = root / str(max(taken, default=0) + 1)
        dest.mkdir()
        for name in moved:
            os.replace(run_dir / name, dest / name)
        fsync_dir(run_dir)
    for name in deleted:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    done = []
    if moved:
        assert dest is not None  # made above when files were moved
        done.append(f"moved {', '.join(moved)} to {dest.relative_to(run_dir)}/")
    if deleted:
        done.append("deleted checkpoints/ (incomplete, unusable)")
    if (run_dir / "logs").is_dir():
        done.append("logs/ goes on (its earlier lines say why the attempt ended)")
    return (
        f"{run_dir}: the earlier attempt ended before its first checkpoint, so the run starts "
        f"again: {'; '.join(done)}"
    )


def check_config(run_dir: Path, cfg: Config, allow: bool) -> str | None:
    """Refuse (unless `allow`) to resume with a config that computes something else; the
    changes allowed, listed (None: none)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    changes = config_changes(read_yaml(path) or {}, cfg)
    changes = [c for c in changes if not c[0].startswith(MAY_CHANGE)]
    if not changes:
        return None
    listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)
    if not allow:
        raise UserError(
            f"--resume with a config that differs from the run's: {listed}; resume with the "
            "run's config, or pass --allow-config-change to resume with this one anyway, or "
            "--run-dir NEW_DIR to start another run"
        )
    return listed


def config_changes(old_raw: dict, new: Config) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every key whose value differs. The old config is
    rebuilt first, so a key it lacks (added to the code since) counts as its default and a key
    renamed since is read under its new name."""
    try:
        old = build(Config, rename_keys(old_raw, CONFIG_FILE, quiet=True), "").to_dict()
    except UserError:  # a key removed from the code since: compare what is there
        old = old_raw
    before, after = _flatten(old), _flatten(new.to_dict())
    missing = object()
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if before.get(key, missing) != after.get(key, missing)
    ]


def _flatten(d: dict, where: str = "") -> dict:
    out: dict[str, object] = {}
    for key, value in d.items():
        full = f"{where}{key}"
        if isinstance(value, dict) and value:
            out |= _flatten(value, full + ".")
        else:
            out[full] = value
    return out
