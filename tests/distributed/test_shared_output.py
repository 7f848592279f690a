"""A conversion's shared output (`convert.shared_output`) cut short on two ranks (gloo): SIGINT or
SIGTERM mid-write leaves no `.OUT.tmp-*` beside the output, a rank still writing after rank 0
removed it does not leave it made again (it used to: only rank 0 removed it), and a rank stopped
once its `ok` flag went out never costs the complete output."""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.distributed.shared_output_worker import CASES
from tests.helpers import cli_env, torchrun

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("shared_output_worker.py")


def cut_short(tmp_path: Path, case: str) -> Path:
    """The directory of the worker's output after its write was cut short as `case` says (the
    ranks end with the fault's error: the files are what is judged)."""
    outs = tmp_path / "outs"
    outs.mkdir()
    (outs / "mine.txt").write_text("mine")
    cmd = torchrun(2, str(WORKER), str(outs / "hf"), case)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=cli_env())
    assert done.returncode != 0, done.stderr[-3000:]
    assert (outs / "mine.txt").read_text() == "mine"
    return outs


@pytest.mark.parametrize("case", [c for c in CASES if c != "rank1-after-its-flag"])
def test_an_output_cut_short_on_every_rank_leaves_nothing_behind(tmp_path, case):
    outs = cut_short(tmp_path, case)
    assert sorted(p.name for p in outs.iterdir()) == ["mine.txt"]


def test_a_rank_stopped_after_its_flag_leaves_the_output_to_rank_0(tmp_path):
    outs = cut_short(tmp_path, "rank1-after-its-flag")
    assert sorted(p.name for p in outs.iterdir()) == ["hf", "mine.txt"]
    model = outs / "hf" / "model"
    assert sorted(p.name for p in model.iterdir()) == ["weights0.pt", "weights1.pt"]
    for f in model.iterdir():
        assert torch.equal(torch.load(f, weights_only=True), torch.arange(4))
