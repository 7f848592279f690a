"""RL checkpoints: model + optimizer (a reshardable dist-checkpoint), RNG, data position, step.

    RUN_DIR/checkpoints/step_<N>/
        model/              Actor.save: model and optimizer state, any layout can load it
        trainer_state.json  step, weight_version, the prompt sampler's position, metrics so far
        rng/rank<r>.pt      torch RNG state of each rank (a plain tensor; loaded weights_only)

        manifest.json       every other file's size and sha256, tensor data included

A checkpoint is written into `.step_<N>.tmp/` and renamed to `step_<N>/` by global rank 0 only
after every rank finished writing, the state file is on disk and the manifest was computed from
the files as they read back (each rank hashes a share), so a directory named `step_<N>` was
complete when written; a crash mid-write leaves only a `.tmp` directory, which `latest` ignores
and the next save of that step replaces. A save cut short by an error, SIGINT or SIGTERM removes
it, on any number of ranks, as `half_write.HalfWrite` says: rank 0 does, and so does any rank
stopped before it sent its share of the manifest (rank 0 cannot complete the checkpoint without
it, and such a rank may have made the directory again after rank 0 removed it). Older
checkpoints beyond `keep` are deleted after the rename, never the new one: it is the last
verified checkpoint. A save that the disk running full cuts short is said in one line naming the
last complete checkpoint (disk_full.py), not as the error torch's writer makes of it.

Every `step_<N>` directory is a checkpoint, whatever it holds now: one that lost a file since (its
state file included) is a damaged checkpoint, never taken for an absent one. A resume uses the
newest checkpoint that verifies against its manifest (`verify`: the manifest lists every file of
the directory, so every file a load reads, and each has its size and sha256) and that this
version can load (`loadable`: its state file is a JSON object, its model/ a dist-checkpoint whose
backend and version this megatron-core reads). A newer one that does not (a truncated, zeroed,
garbled or lost file, a lost manifest, a manifest that leaves files out, a format of another
version) is moved aside to `checkpoints/unverified/` and named, never loaded and never deleted;
where none is left to resume from, the resume is refused and nothing is changed. A save never
overwrites a `step_<N>` already there: it is moved to `unverified/` too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.disk_full import disk_full, full_line
from megatron_gspo.errors import UserError
from megatron_gspo.half_write import HalfWrite
from megatron_gspo.outputs import stop_if_terminated, terminate_raises
from megatron_gspo.train.files import fsync_dir
from megatron_gspo.train.state import TrainState

_NAME = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^\.step_(\d+)\.tmp$")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
UNVERIFIED = "unverified"
_BLOCK = 8 << 20


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def saved_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint directory (`step_<N>`), oldest first, damaged or not: a save renames
    only a complete write into place, so each was complete when written; `verify` says whether
    it still is (a directory that lost its state file is a damaged checkpoint, not no
    checkpoint)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    done = saved_checkpoints(run_dir)
    return done[-1] if done else None


def only_half_writes(run_dir: Path) -> bool:
    """Whether checkpoints/ holds nothing but saves cut short (`.step_<N>.tmp`): no checkpoint,
    nothing set aside, nothing of the user's."""
    root = checkpoint_root(run_dir)
    return all(_TMP.match(p.name) and p.is_dir() for p in root.iterdir()) if root.is_dir() else True


def resume_hint(run_dir: Path, resumed: bool = False) -> str:
    """What a run stopped before its end kept, and how to go on: its newest checkpoint and the
    same command with --resume (`resumed`: the command had it already, so the same command),
    or that it saved none (the same command starts it again)."""
    newest = latest(run_dir)
    if newest is None:
        also = "" if resumed else " (with --resume too)"
        return f"{run_dir} holds no checkpoint yet: the same command starts the run again{also}"
    again = "the same command" if resumed else "the same command with --resume"
    return f"{newest} is the run's newest checkpoint: {again} goes on from it"


def saved_step(ckpt: Path) -> int | None:
    """The step checkpoint `ckpt` was saved after, from its state file (None where that is not
    readable: a resume's checks say why)."""
    try:
        return TrainState.from_state_dict(json.loads((ckpt / STATE_FILE).read_text())).step
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(actor, run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "model").mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    with terminate_raises():  # (SIGTERM too stops the write by an exception: `_write` cleans up)
        _write(actor, tmp, state)
    if rank == 0:
        if final.exists():  # (not the one resumed from, nor newer: kept, named)
            print(_set_aside_line(run_dir, final, "was there already"), flush=True)
        os.replace(tmp, final)
        fsync_dir(root)
        for old in saved_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(actor, path: Path) -> dict:
    """Collective: restore model and optimizer; returns the trainer state. This rank's RNG is
    `restore_rng`'s, set when the run goes on (nothing may draw from it in between)."""
    from megatron_gspo.model.checkpoint import LOAD_ERRORS, load_error  # (torch's DCP: a second)

    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    try:
        actor.load(path / "model")
    except UserError:
        raise
    except LOAD_ERRORS as e:  # a checkpoint that verified and still fails: name it, no traceback
        raise UserError(
            f"cannot load checkpoint {path} ({type(e).__name__}: {load_error(e)}); if "
            "model.path or its model changed since, resume with the run's; if the checkpoint "
            f"is damaged, move it to {path.parent / UNVERIFIED}/ to resume from the one before"
        ) from None
    return json.loads(state_file.read_text())


def restore_rng(path: Path) -> None:
    """Set this rank's torch RNG to checkpoint `path`'s."""
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved
        torch.set_rng_state(torch.load(rng, weights_only=True))


def _write(actor, tmp: Path, state: dict) -> None:
    """Collective: the checkpoint's files into `tmp`, its manifest last. Cut short (an error,
    SIGINT, SIGTERM), `tmp` is removed as `HalfWrite` says: by rank 0 (which renames it only
    after this returns) and by each other rank stopped before it sent its share of the manifest
    (rank 0 cannot complete the checkpoint without it). A rank stopped after sending it leaves
    `tmp` to rank 0: it may be renamed into place, complete. A full disk is said in one line
    (a UserError, before `tmp` is removed: what is free then is what the write left)."""
    rank = dist.get_rank()
    with HalfWrite(tmp) as half, _full_disk_said(tmp):
        actor.save(tmp / "model")
        rng = io.BytesIO()  # (written by Python: a full disk is its OSError, not torch's error)
        torch.save(torch.get_rng_state(), rng)
        (tmp / "rng" / f"rank{rank}.pt").write_bytes(rng.getvalue())
        dist.barrier()
        if rank == 0:
            _write_json(tmp / STATE_FILE, state)
        shares = half.gather(_hash_share(tmp))
        if rank == 0:
            write_manifest(tmp, {k: v for share in shares for k, v in share.items()})
        stop_if_terminated()  # (a signal whose exception a finalizer swallowed)


@contextlib.contextmanager
def _full_disk_said(tmp: Path) -> Iterator[None]:
    """The block's error, where it is the disk running full under checkpoint write `tmp`
    (.step_N.tmp), as the one line naming the last complete checkpoint (disk_full.py)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # (DCP's CheckpointException is no Exception)
        root = tmp.parent
        if not disk_full(e, root):
            raise
        m = _TMP.match(tmp.name)
        what = f"checkpoint step_{m.group(1) if m else '?'}"
        raise UserError(full_line(root, what, latest(root.parent))) from None


def _hash_share(directory: Path) -> dict:
    """Collective: rank 0's list of the checkpoint's files, and this rank's share of them
    hashed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [_files(directory) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    files = box[0]
    assert files is not None  # every rank holds rank 0's list after the broadcast
    return {rel: _entry(directory / rel) for rel in files[rank::world]}


def write_manifest(directory: Path, entries: dict | None = None) -> None:
    """The manifest of `directory` (computed here when `entries` is None), written durably."""
    if entries is None:
        entries = {rel: _entry(directory / rel) for rel in _files(directory)}
    _write_json(directory / MANIFEST, {"format": 1, "files": dict(sorted(entries.items()))})


def verify(path: Path, threads: int = 4) -> str | None:
    """None when every file the manifest names has its size and sha256; else what differs, in
    a few words (the first problem found)."""
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
        items = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in listed.items()]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    if STATE_FILE not in listed:
        return f"{MANIFEST} does not list {STATE_FILE}"
    unlisted = sorted(set(_files(path)) - set(listed))
    if unlisted:  # a load would read it unchecked
        more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        return f"{MANIFEST} does not list {unlisted[0]}{more}"
    for rel, size, _ in items:  # sizes first: cheap, and most damage shows there
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} is {f.stat().st_size} bytes, the manifest says {size}"
    with ThreadPoolExecutor(max(1, threads)) as pool:  # hashlib lets go of the GIL
        digests = pool.map(lambda it: _sha256(path / it[0]), items)
        for (rel, _, want), got in zip(items, digests):
            if got != want:
                return f"{rel} does not match its checksum"
    return None


def loadable(path: Path) -> str | None:
    """None when this version can load checkpoint `path` (verified); else why not, in a few
    words: a state file that is no JSON object, a model/ this megatron-core cannot read."""
    from megatron_gspo.model.checkpoint import unreadable

    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} is unreadable ({type(e).__name__})"
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds no JSON object"
    return unreadable(path / "model")


def newest_verified(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that verifies and can be loaded, and the newer ones that
    cannot (with why)."""
    skipped: list[tuple[Path, str]] = []
    for ckpt in reversed(saved_checkpoints(run_dir)):
        problem = verify(ckpt) or loadable(ckpt)
        if problem is None:
            return ckpt, skipped
        skipped.append((ckpt, problem))
    return None, skipped


def set_aside(run_dir: Path, ckpts: list[Path]) -> Path:
    """Move checkpoints that failed verification to checkpoints/unverified/ (kept, not counted)."""
    dest = checkpoint_root(run_dir) / UNVERIFIED
    dest.mkdir(exist_ok=True)
    for ckpt in ckpts:
        target, k = dest / ckpt.name, 1
        while target.exists():
            target, k = dest / f"{ckpt.name}.{k}", k + 1
        os.replace(ckpt, target)
    fsync_dir(checkpoint_root(run_dir))
    return dest


def _set_aside_line(run_dir: Path, ckpt: Path, why: str) -> str:
    """Move `ckpt` to checkpoints/unverified/; the line that says so."""
    dest = set_aside(run_dir, [ckpt])
    return f"{ckpt.name} {why}: moved to {dest.relative_to(run_dir)}/, not deleted"


def _files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
