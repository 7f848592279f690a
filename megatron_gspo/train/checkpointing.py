"""RL checkpoints: model + optimizer (a reshardable dist-checkpoint), RNG, data position, step.

    RUN_DIR/checkpoints/step_<N>/
        model/              Actor.save: model and optimizer state, any layout can load it
        trainer_state.json  step, weight_version, the prompt sampler's position, metrics so far
        rng/rank<r>.pt      torch RNG state of each rank (a plain tensor; loaded weights_only)

A checkpoint is written into `.step_<N>.tmp/` and renamed to `step_<N>/` by global rank 0 only
after every rank finished writing and the state file is on disk, so a directory named `step_<N>`
is always complete; a crash mid-write leaves only a `.tmp` directory, which `latest` ignores and
the next save of that step replaces. Older checkpoints beyond `keep` are deleted after the rename.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.train.files import fsync_dir

_NAME = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


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
    actor.save(tmp / "model")
    torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        _write_json(tmp / STATE_FILE, state)
        if final.exists():  # the same step saved before a crash and again after resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(actor, path: Path) -> dict:
    """Collective: restore model, optimizer and this rank's RNG; returns the trainer state."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    actor.load(path / "model")
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return json.loads(state_file.read_text())


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
