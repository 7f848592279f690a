"""Launching into a run again, end to end through launch/torchrun.sh: a Slurm requeue of a
two-node job (the same job id) resumes from the first attempt's checkpoint, a relaunch under the
first attempt's launch id is refused by every node before anything starts, and a launch whose
trainer refuses its input ends by pointing at that refusal, not at --resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_multinode import finish, launch_nodes, metrics
from tests.helpers import QUICK_TRAIN, cli_env, saved_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe_gspo.yaml"
CKPT = "train.checkpoint_every=1"


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    return make_task_model(tmp_path_factory.mktemp("task") / "model", seed=0)


def _ready_urls(out: str) -> list[str]:
    [line] = [line for line in out.splitlines() if "rollout servers ready: " in line]
    return line.split("rollout servers ready: ")[1].split()


def test_a_requeued_job_resumes_and_its_first_launch_id_is_refused(task_model, tmp_path):
    """The requeue kept SLURM_JOB_ID, the launch id: both nodes read the first attempt's URLs
    ("rollout servers ready" with its ports, then "nothing answers at ...") and its `done`.
    Now the id counts the requeue (SLURM_RESTART_COUNT), and a launch that repeats the first
    attempt's id is refused by each node, exit 2, before a server starts."""
    run = tmp_path / "run"
    first = finish(launch_nodes(run, task_model, CKPT, steps=1, launch_id=None,
                                SLURM_JOB_ID="4242"))  # fmt: skip
    assert [rc for rc, _ in first] == [0, 0], first[0][1][-3000:]
    assert [r["step"] for r in metrics(run)] == [0, 1]

    again = finish(launch_nodes(run, task_model, CKPT, "--resume", steps=2, launch_id="4242-0"))
    state = run / "launch" / "4242-0"
    for node, (rc, out) in enumerate(again):
        assert (rc, out.splitlines()[-1]) == (2, (
            f"error: LAUNCH_ID=4242-0 was an earlier launch's ({state} holds its "
            f"started/node{node}); give this launch a LAUNCH_ID of its own, the same on every "
            "node, or remove that directory once no launch uses it"))  # fmt: skip
        assert "rollout servers" not in out
    assert [r["step"] for r in metrics(run)] == [0, 1]

    requeued = finish(launch_nodes(run, task_model, CKPT, "--resume", steps=2, launch_id=None,
                                   SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1"))  # fmt: skip
    assert [rc for rc, _ in requeued] == [0, 0], requeued[0][1][-3000:] + requeued[1][1][-2000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["weight_version"] == 2
    urls = [(run / "launch" / "4242-1" / "urls" / f"node{n}.txt").read_text().split()
            for n in (0, 1)]  # fmt: skip
    for _, out in requeued:  # each node used this attempt's servers
        assert _ready_urls(out) == urls[0] + urls[1]


def test_a_trainer_refusal_ends_with_what_to_fix_not_a_rerun(task_model, tmp_path):
    """A start without --resume in a run that has a checkpoint: the trainer refuses (exit 2),
    and the script's last line used to be "rerun with --resume ... to continue" (for other
    refusals, the very command that failed) and "torchrun's summary above names it"."""
    run = tmp_path / "run"
    saved_checkpoint(run, 1)
    env = {k: v for k, v in cli_env().items() if k not in ("NNODES", "NODE_RANK", "RDZV_ENDPOINT")}
    env |= {"PYTHON": sys.executable, "LAUNCH_ID": "refused", "NPROC_PER_NODE": "1"}
    r = subprocess.run(
        ["bash", str(ROOT / "launch" / "torchrun.sh"), "--config", str(CONFIG), "--run-dir",
         str(run), "--steps", "1", f"model.path={task_model}", *QUICK_TRAIN],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    refusal = (f"{run} holds an earlier run (newest checkpoint: step_1); pass --resume to "
               "continue it or --run-dir NEW_DIR to start another")  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: {refusal}" in r.stdout + r.stderr  # (the rank's own line, above)
    assert r.stderr.splitlines()[-3:] == [
        f"error: training stopped on node 0: the trainer refused its input (exit 2): {refusal}",
        f"error: logs: {run}/logs/ranks/node0 (per rank), {run}/logs/servers/node0 (servers)",
        "error: the trainer's error: line above says what it refused; fix that, then run the "
        "command again",
    ]
    assert (run / "launch" / "refused" / "abort").read_text() == (
        f"node 0: training stopped on node 0: the trainer refused its input (exit 2): {refusal}\n"
    )
