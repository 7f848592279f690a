"""What launch/torchrun.sh tells a failed launch to do with the run's checkpoints, against what
the trainer's --resume does with them (train/run_dir.py `prepare`, given the same directory):
a step_N that lost its trainer_state.json or manifest.json is a damaged checkpoint, set aside by
--resume (the one before is used, or the resume refused), never "no checkpoint yet" (a start
with or without --resume refuses a run that has one) nor the checkpoint to continue from."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.train import run_dir as rd
from tests.helpers import saved_checkpoint, servers_killed_python, torchrun_sh

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny_moe_gspo.yaml"
LOST = {"state": "trainer_state.json", "manifest": "manifest.json"}


def advice(tmp_path: Path, run: Path) -> str:
    """The last line of a launch that fails before torchrun starts (its servers killed)."""
    python = servers_killed_python(tmp_path)
    r = torchrun_sh("--config", str(CONFIG), "--run-dir", str(run), f"model.path={tmp_path}",
                    PYTHON=str(python), GPUS_PER_NODE="0")  # fmt: skip
    assert r.returncode == 1, r.stderr
    return r.stderr.splitlines()[-1]


def resumed_from(run: Path) -> tuple[str | None, list[str]]:
    """The trainer's --resume on `run`: the checkpoint it continues from (None: refused) and the
    ones it sets aside. Nothing is moved (`prepare` decides, `carry_out` does)."""
    cfg = load_config(str(CONFIG), [f"model.path={run}"])
    try:
        plan = rd.prepare(run, True, cfg, False)
    except UserError as e:
        assert "verifies" in str(e) and "nothing was changed" in str(e), e
        return None, []
    assert plan.checkpoint is not None
    return plan.checkpoint.name, [c.name for c, _ in plan.set_aside]


@pytest.mark.parametrize(
    "layout",
    [{3: None}, {2: None, 3: "state"}, {2: None, 3: "manifest"}, {2: None, 3: "state", 4: "manifest"},
     {3: "state"}, {3: "manifest"}],
    ids=["intact", "newest-lost-state", "newest-lost-manifest", "two-newest-damaged",
         "only-one-lost-state", "only-one-lost-manifest"],
)  # fmt: skip
def test_a_failed_launch_names_what_resume_will_do_with_the_checkpoints(tmp_path, layout):
    run = tmp_path / "run"
    for step, lost in layout.items():
        ckpt = saved_checkpoint(run, step)
        if lost:
            (ckpt / LOST[lost]).unlink()
    used, set_aside = resumed_from(run)
    lost_newest_first = [(s, lost) for s, lost in sorted(layout.items(), reverse=True) if lost]
    damaged = ", ".join(f"step_{s} (no {LOST[lost]})" for s, lost in lost_newest_first)
    if used is not None:  # (refused: nothing is set aside)
        assert set_aside == [f"step_{s}" for s, _ in lost_newest_first]
    said = advice(tmp_path, run)
    continue_ = f"rerun with --resume --run-dir {run} to continue"
    if used is None:
        assert said == (
            f"error: no usable checkpoint under {run}/checkpoints, only damaged ones: {damaged}; "
            "--resume would refuse them (nothing changed): restore their files from a copy, or "
            "start another run with --run-dir NEW_DIR"
        )
    elif not damaged:
        assert said == f"error: last complete checkpoint: {run}/checkpoints/{used}; {continue_}"
    else:
        assert said == (
            f"error: last complete checkpoint: {run}/checkpoints/{used}; {continue_} from it "
            f"(newer, damaged: {damaged}; --resume moves them to checkpoints/unverified/)"
        )


def test_a_failed_launch_without_checkpoints_says_the_run_starts_again(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / ".step_2.tmp").mkdir(parents=True)  # (a save cut short: no checkpoint)
    assert advice(tmp_path, run) == (
        f"error: no complete checkpoint yet under {run}/checkpoints; rerun (with or without "
        "--resume) to start it again"
    )
