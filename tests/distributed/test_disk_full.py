"""A disk that fills during a run on two ranks: every rank says the one line naming the disk, the
write and the last complete checkpoint, and exits 2; that checkpoint is intact and no half-written
one is left. A checkpoint's write used to end each rank with torch's zip-writer traceback
("RuntimeError: ... unexpected pos 704 vs 598", which hid the ENOSPC), exit 1.

The full disk is a fault injected at the file's `write` (the kernel's ENOSPC as Python raises
it; a test cannot mount a small disk), into a real run's writes of step 2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from megatron_gspo.train import checkpointing
from megatron_gspo.train.metrics import read_metrics
from tests.distributed.train_ranks import train_two_ranks
from tests.helpers import cli_env

pytestmark = pytest.mark.distributed

# sitecustomize.py of the run's processes: a file the case names, opened for writing, raises
# ENOSPC at its writes (a disk filling under it): rank 0's model shard of step 2 (DCP's file:
# rank 1, with nothing of its own to write there, learns of it from DCP) after its first write,
# or metrics.jsonl at the line of step 2 (rank 0 alone writes it).
FULL_DISK = """
import builtins, errno, io, os

_open, _CASE = io.open, os.environ["MEGATRON_GSPO_TEST_FULL_DISK"]


def _watched(name):
    if _CASE == "checkpoint":
        return (os.environ.get("RANK") == "0" and "/.step_2.tmp/model/" in name
                and name.endswith(".distcp"))
    return name.endswith("metrics.jsonl")


class _Disk:
    def __init__(self, f):
        self._f, self._writes = f, 0

    def __getattr__(self, attr):
        return getattr(self._f, attr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        self._writes += 1
        full = str(data).startswith('{"step": 2,') if _CASE == "metrics" else self._writes > 1
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)


def _opened(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    named = isinstance(file, (str, os.PathLike)) and _watched(os.fspath(file))
    return _Disk(f) if named and any(m in mode for m in "wax+") else f


builtins.open = io.open = _opened
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(dense_layers=[0]), tmp_path_factory.mktemp("tiny") / "moe")


@pytest.mark.parametrize("case", ["checkpoint", "metrics"])
def test_a_full_disk_is_one_line_on_every_rank_and_the_last_checkpoint_is_kept(
    model, tmp_path, case
):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    env["MEGATRON_GSPO_TEST_FULL_DISK"] = case
    run = tmp_path / "run"
    ranks = train_two_ranks(tmp_path, "--run-dir", str(run), "--steps", "2",
                            f"model.path={model}", "train.checkpoint_every=1", env=env)  # fmt: skip
    where, what = {
        "checkpoint": (run / "checkpoints", "checkpoint step_2"),
        "metrics": (run, "metrics.jsonl"),
    }[case]
    line = re.compile(
        rf"error: the disk holding {re.escape(str(where))} is full \(\d+\.\d MiB free\) writing "
        rf"{what}; free space \(step_1, the last complete checkpoint, is intact\) and rerun "
        r"with --resume"
    )
    said = [ranks.error_lines(rank) for rank in (0, 1)]
    assert said[0] == said[1] and len(said[0]) == 1 and line.fullmatch(said[0][0]), said
    for rank in (0, 1):
        assert "Traceback" not in ranks.stderr[rank], ranks.stderr[rank][-3000:]
    assert ranks.exitcodes == {0: 2, 1: 2}, ranks.torchrun[-3000:]
    root = checkpointing.checkpoint_root(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # no .step_2.tmp left
    assert checkpointing.verify(root / "step_1") is None
    state = json.loads((root / "step_1" / checkpointing.STATE_FILE).read_text())
    assert state["step"] == 1
    logged = [0, 1] if case == "metrics" else [0, 1, 2]  # (a step's line goes before its save)
    assert [row["step"] for row in read_metrics(run)] == logged
