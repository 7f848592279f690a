"""A resumed run with no step left to train says so in one line (train/hooks.py), naming the
limit that stops it and how to train on (it used to print nothing and exit 0); --resume says it
before anything starts, from the step its files hold (tests/e2e/test_train.py shows no server
starts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import dump_config, load_config
from megatron_gspo.errors import UserError
from megatron_gspo.train.hooks import last_step, nothing_to_train
from megatron_gspo.train.run_dir import finished_step, prepare
from tests.helpers import saved_checkpoint

pytestmark = pytest.mark.unit

RUN = Path("runs/x")


def test_steps_left_or_a_fresh_run_say_nothing():
    assert nothing_to_train(RUN, step=3, last=40, total=40) is None
    assert nothing_to_train(RUN, step=0, last=0, total=40) is None  # --steps 0: step 0's eval


def test_a_run_at_train_steps_names_train_steps():
    assert nothing_to_train(RUN, step=40, last=40, total=40) == (
        "runs/x is at step 40 of 40 (train.steps): nothing to train; pass train.steps=N with "
        "N > 40 to train on"
    )
    # resumed with a smaller train.steps than it ran to
    assert nothing_to_train(RUN, step=40, last=20, total=20).startswith(
        "runs/x is at step 40, past step 20 (train.steps): nothing to train; "
    )


def test_a_run_stopped_by_steps_names_steps():
    # (the loop trains to min(train.steps, --steps): --steps alone cannot go past train.steps)
    assert nothing_to_train(RUN, step=2, last=2, total=40) == (
        "runs/x is at step 2 of 2 (--steps): nothing to train; pass --steps N with N > 2 "
        "(up to train.steps=40), or leave --steps out, to train on"
    )
    assert nothing_to_train(RUN, step=12, last=5, total=10) == (
        "runs/x is at step 12, past step 5 (--steps): nothing to train; pass train.steps=N with "
        "N > 12 and leave --steps out to train on"
    )


# --resume asks the run directory first (train/finished.py): the newest checkpoint's step, read
# from its files, before any server or model starts (run_dir.py `finished_step`).


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_step_a_resume_would_continue_from_is_read_from_the_newest_checkpoint(tmp_path):
    saved_checkpoint(tmp_path, 1)
    saved_checkpoint(tmp_path, 2)
    run_cfg = load_config(None, ["model.path=m", "train.steps=2"])
    dump_config(run_cfg, tmp_path / "config.yaml")
    before = _files(tmp_path)
    assert finished_step(tmp_path, run_cfg, False, last=2) == 2
    assert finished_step(tmp_path, run_cfg, False, last=1) == 2  # past it (--steps 1)
    assert finished_step(tmp_path, run_cfg, False, last=3) is None  # a step left: the start goes on
    longer = load_config(None, ["model.path=m", "train.steps=9"])  # (--resume may change it)
    assert finished_step(tmp_path, longer, False, last=2) == 2
    assert _files(tmp_path) == before  # read, nothing written
    assert last_step(run_cfg, None) == 2 and last_step(run_cfg, 1) == 1
    assert last_step(run_cfg, 5) == 2


def test_a_config_resume_refuses_is_refused_there_as_the_start_refuses_it(tmp_path):
    saved_checkpoint(tmp_path, 2)
    dump_config(load_config(None, ["model.path=m", "train.steps=2"]), tmp_path / "config.yaml")
    changed = load_config(None, ["model.path=m", "train.steps=2", "algo.loss=grpo"])
    with pytest.raises(UserError) as early:
        finished_step(tmp_path, changed, False, last=2)
    with pytest.raises(UserError) as start:
        prepare(tmp_path, True, changed, False)
    said = str(early.value)
    assert said == str(start.value) and "algo.loss: 'gspo' -> 'grpo'" in said
    assert finished_step(tmp_path, changed, True, last=2) == 2  # --allow-config-change


def test_a_newest_checkpoint_that_does_not_verify_is_left_to_the_start(tmp_path):
    """The start sets it aside and resumes from the one before (which may have steps left):
    no answer is given from a checkpoint a resume would not continue from."""
    run_cfg = load_config(None, ["model.path=m", "train.steps=2"])
    saved_checkpoint(tmp_path, 1)
    newest = saved_checkpoint(tmp_path, 2)
    (newest / "model" / "shard.distcp").write_bytes(bytes(4096))
    assert finished_step(tmp_path, run_cfg, False, last=2) is None
    (newest / "trainer_state.json").write_text("{]")
    assert finished_step(tmp_path, run_cfg, False, last=2) is None
    assert finished_step(tmp_path / "none", run_cfg, False, last=2) is None  # no checkpoint


# What the answer imports: torch for the bare process group, nothing of the start.
RESUME = """
import sys
from megatron_gspo.cli import main

try:
    main(sys.argv[1:])
finally:
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("aiohttp", "megatron")
                 or m.startswith(("megatron_gspo.server.serve", "megatron_gspo.train.loop",
                                  "megatron_gspo.train.parts", "megatron_gspo.weight_sync.sync"))))
"""


def test_resume_of_a_finished_run_imports_no_server_and_no_megatron(tmp_path):
    run = tmp_path / "run"
    saved_checkpoint(run, 2)
    run_cfg = load_config(None, ["model.path=m", "train.steps=2"])
    dump_config(run_cfg, run / "config.yaml")
    dump_config(run_cfg, tmp_path / "run.yaml")
    root = Path(__file__).resolve().parents[2]
    argv = ["train", "--config", str(tmp_path / "run.yaml"), "--run-dir", str(run), "--resume"]
    r = subprocess.run([sys.executable, "-c", RESUME, *argv], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)))  # fmt: skip
    assert r.returncode == 0, r.stderr
    said, imported = r.stdout.splitlines()
    assert said.startswith(f"{run} is at step 2 of 2 (train.steps): nothing to train")
    assert imported == "[]"
