"""A checkpoint save cut short on two ranks (gloo): SIGINT or SIGTERM mid-write leaves no
`checkpoints/.step_N.tmp` behind (it used to stay until the next save, removed only by a
one-process save), a rank still writing after rank 0 removed it does not leave it made again,
and a rank stopped once its share of the manifest went out never costs the complete checkpoint.
The checkpoint saved before is kept and verifies in every case."""

import subprocess
from pathlib import Path

import pytest

from megatron_gspo.train import checkpointing
from tests.distributed.save_worker import CASES
from tests.helpers import cli_env, torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("save_worker.py")


def cut_short(tmp_path: Path, case: str) -> Path:
    """The worker's run directory after its save of step 2 was cut short as `case` says (the
    ranks end with the fault's error: the files are what is judged)."""
    run = tmp_path / "run"
    cmd = torchrun(2, str(WORKER), str(run), case)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=cli_env())
    assert (run / "checkpoints" / "step_1").is_dir(), done.stderr[-3000:]
    return run


@pytest.mark.parametrize("case", [c for c in CASES if c != "rank1-after-its-share"])
def test_a_save_cut_short_on_every_rank_leaves_no_half_write(tmp_path, case):
    run = cut_short(tmp_path, case)
    root = checkpointing.checkpoint_root(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert checkpointing.verify(root / "step_1") is None


def test_a_rank_stopped_after_its_share_leaves_the_checkpoint_to_rank_0(tmp_path):
    run = cut_short(tmp_path, "rank1-after-its-share")
    root = checkpointing.checkpoint_root(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    assert checkpointing.verify(root / "step_1") is None
    assert checkpointing.verify(root / "step_2") is None
    assert sorted(p.name for p in (root / "step_2" / "model").iterdir()) == [
        "weights0.pt",
        "weights1.pt",
    ]
