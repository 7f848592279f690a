"""Training runs whose user code misbehaves: a reward that hangs, exits, interrupts or kills its
process fails those samples alone and the run finishes (and its process ends); a real Ctrl-C
(SIGINT to the process group) stops a run whose reward swallows KeyboardInterrupt, and leaves
no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from tests.helpers import NUMBER_FN, QUICK_TRAIN, cli_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

HOSTILE_REWARD = """
import os, sys, time
from pathlib import Path
from megatron_gspo.rewards.exact import exact_answer

CALLS = Path({calls!r})  # one file per call, in any worker process

{number_fn}


def score(prompt, response, answer):
    k = _number(CALLS)
    if k == 0:
        time.sleep(3600)
    if k == 1:
        sys.exit(3)
    if k == 2:
        raise KeyboardInterrupt
    if k == 3:
        os._exit(9)
    return exact_answer(prompt, response, answer)
"""

STUBBORN_REWARD = """
import time
from pathlib import Path


def score(prompt, response, answer):
    Path({started!r}).touch()
    while True:  # a Ctrl-C is swallowed here: it must not be what stops the run
        try:
            time.sleep(1)
        except BaseException:
            pass
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(TinySpec(dense_layers=[0]), tmp_path_factory.mktemp("m") / "model")


def _start(run_dir: Path, model: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config",
           str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run_dir), "--steps", "2",
           f"model.path={model}", *QUICK_TRAIN, "train.eval_every=0", *extra]  # fmt: skip
    log = open(run_dir.parent / "run.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=ROOT,
                            start_new_session=True)  # fmt: skip


def test_a_reward_that_hangs_exits_or_dies_fails_those_samples_and_the_run_finishes(
    model, tmp_path
):
    calls = tmp_path / "calls"
    calls.mkdir()
    plugin = tmp_path / "hostile.py"
    plugin.write_text(HOSTILE_REWARD.format(calls=str(calls), number_fn=NUMBER_FN))
    run_dir = tmp_path / "run"
    proc = _start(run_dir, model, f"reward.fn={plugin}:score", "reward.timeout_s=2",
                  "reward.workers=2")  # fmt: skip
    try:
        rc = proc.wait(timeout=400)  # (before: the first call hung the run for good)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "run.log").read_text()
    assert rc == 0, out[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/failed_samples"]) for r in rows] == [(1, 4.0), (2, 0.0)]
    assert 1 <= rows[0]["rollout/reward_failed_groups_dropped"] <= 4
    summary = [line for line in out.splitlines() if "the reward failed on" in line]
    assert len(summary) == 1 and summary[0].startswith("step 1: the reward failed on 4 of 16")
    log = (run_dir / "logs" / "reward.log").read_text()
    for what in ("ran past reward.timeout_s (2 s)", "raised SystemExit: 3",
                 "raised KeyboardInterrupt", "its worker process died, exited with code 9"):  # fmt: skip
        assert what in log, log


FAILING_REWARD = """
def score(prompt, response, answer):
    raise ValueError("cannot score")
"""


def test_a_reward_failing_on_every_sample_ends_the_run_naming_its_log(model, tmp_path):
    """eval's warning and the error that ends the run (exit 2) named no log: each now names the
    run's logs/reward.log, which has every failure's traceback."""
    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_REWARD)
    run_dir = tmp_path / "run"
    proc = _start(run_dir, model, f"reward.fn={plugin}:score", "reward.workers=2",
                  "train.eval_every=1")  # fmt: skip
    try:
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = (tmp_path / "run.log").read_text().splitlines()
    log = run_dir.resolve() / "logs" / "reward.log"
    has_each = f"; {log} has each, with its traceback"
    [error] = [line for line in lines if line.startswith("error:")]
    assert rc == 2 and error.startswith(f"error: reward '{plugin}:score' raised ValueError: "
                                        "cannot score (prompt "), lines[-20:]  # fmt: skip
    assert error.endswith(f"; fix the reward function (all 16 samples of step 1 failed{has_each})")
    [at_eval] = [line for line in lines if line.startswith("eval: ")]  # (step 0's)
    assert at_eval.startswith("eval: the reward failed on 8 of 8 samples, counted wrong (first: ")
    assert at_eval.endswith(has_each), at_eval
    assert log.read_text().count("ValueError: cannot score") == 2 * (8 + 16)  # line, traceback


def test_ctrl_c_stops_a_run_whose_reward_swallows_it_and_leaves_no_process(model, tmp_path):
    started = tmp_path / "started"
    plugin = tmp_path / "stubborn.py"
    plugin.write_text(STUBBORN_REWARD.format(started=str(started)))
    run_dir = tmp_path / "run"
    proc = _start(run_dir, model, f"reward.fn={plugin}:score", "reward.timeout_s=600")
    try:
        deadline = time.monotonic() + 300
        while not started.exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the reward was never called"
            time.sleep(0.1)
        everything = psutil.Process(proc.pid).children(recursive=True)  # servers, workers
        os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C at the terminal sends
        rc = proc.wait(timeout=90)  # (before: the reward, in the trainer, swallowed it)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0
    _, alive = psutil.wait_procs(everything, timeout=30)
    assert not alive, [" ".join(p.cmdline())[:200] for p in alive]  # nothing left behind
