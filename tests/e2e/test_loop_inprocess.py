"""The RL loop driven in this process (no trainer subprocess) on the parts `megatron-gspo train`
builds (train/parts.py `build_parts`), against the CLI run as a subprocess with the same config
and seed: the same metrics, step by step.

What is deterministic, found by running the CLI twice: every metric but the timings
(`time/*`, `tokens_per_s`, `sync/gb_per_s`) and `mismatch/logprob_abs_diff`, the gap between
the trainer's and the server's log-probs, which moves by ~1e-7 between two runs (the built-in
server's forward of a request depends on what it batched it with). The rest is compared exactly:
the same rollouts (seeded per step), rewards, advantages, losses, gradient norms and eval.

The trainer's process group is this process's alone (gloo, world size 1, as the CLI starts it)
and is destroyed after, with the environment the start sets restored. The rollout server is a
subprocess, as the product starts it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.config import load_config
from megatron_gspo.model.parallel import shutdown
from megatron_gspo.train.loop import run
from megatron_gspo.train.parts import build_parts
from tests.helpers import QUICK_TRAIN, run_cli

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe_gspo.yaml"
STEPS = 3
# what varies between two CLI runs of the same config and seed (see above)
TIMING = ("time/", "tokens_per_s", "sync/gb_per_s")
SERVER_NUMERICS = ("mismatch/logprob_abs_diff",)
# a launcher's environment: cleared for the in-process run, which sets none of it
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    # warm enough that every step's groups have right and wrong answers (some seconds longer
    # than test_train.py's): the compared losses, gradients and eval are not zeros
    out = tmp_path_factory.mktemp("task") / "model"
    return make_task_model(out, seed=0, clean_steps=150, sloppy_steps=50)


@pytest.fixture
def own_process_group():
    """The trainer's torch.distributed in this process, as the CLI has it (one thread, no
    launcher's environment), destroyed after, and the environment and threads restored."""
    assert not dist.is_initialized(), "another test left a process group"
    saved = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the CLI's OMP_NUM_THREADS=1)
    try:
        yield
    finally:
        shutdown()
        torch.set_num_threads(threads)
        for k in DIST_ENV:
            os.environ.pop(k, None)
        os.environ.update(saved)
    assert not dist.is_initialized()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_loop_in_process_gives_the_cli_metrics(task_model, tmp_path, own_process_group):
    overrides = [f"model.path={task_model}", *QUICK_TRAIN]
    cli = tmp_path / "cli"
    args = ["train", "--config", str(CONFIG), "--run-dir", str(cli), "--steps", str(STEPS)]
    proc = run_cli([*args, *overrides], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    cfg = load_config(str(CONFIG), overrides)
    here = tmp_path / "inprocess"
    with build_parts(cfg, here) as parts:
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert not [k for k in DIST_ENV if k in os.environ]  # (nothing a child would inherit)
        run(parts, max_steps=STEPS)

    ours, theirs = metrics(here), metrics(cli)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(STEPS + 1))
    for a, b in zip(ours, theirs, strict=True):
        assert set(a) == set(b), (a["step"], set(a) ^ set(b))
        for key in a:
            if key.startswith(TIMING):
                continue
            if key in SERVER_NUMERICS:
                assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # the comparison means something: rewards differ within groups, so no update is zero
    assert all(r["reward/std"] > 0 and r["grad_norm"] > 0 for r in ours[1:])
    assert all(r["eval/reward"] > 0 for r in ours if "eval/reward" in r)
    assert [("eval/reward" in r) for r in ours] == [True, False, True, True]
    assert (here / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").is_file()
