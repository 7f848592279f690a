"""launch/slurm/train.sbatch under a real Slurm controller and node daemon on loopback: the tiny
config end to end, and a scancel that stops every process the job started."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import QUICK_TRAIN, cli_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
QUICK = QUICK_TRAIN


@pytest.fixture(scope="module")
def task_model(tmp_path_factory, slurm_conf) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    return make_task_model(tmp_path_factory.mktemp("task") / "model", seed=0)


def sbatch(slurm_conf: Path, out: Path, *args: str, wait: bool) -> subprocess.CompletedProcess:
    env = cli_env() | {"SLURM_CONF": str(slurm_conf), "PYTHON": sys.executable}
    cmd = ["sbatch", "--parsable", "--nodes", "1", "--output", str(out)]
    cmd += ["--wait"] if wait else []
    cmd += [str(ROOT / "launch" / "slurm" / "train.sbatch"), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


def _server_pids(run_dir: Path) -> list[int]:
    text = "".join(p.read_text() for p in run_dir.glob("logs/servers/node*/serve_node.log"))
    return [int(x) for m in re.findall(r"\(pids ([\d, ]+)\)", text) for x in m.split(", ")]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_sbatch_runs_the_tiny_config_end_to_end(slurm_conf, task_model, tmp_path):
    run, out = tmp_path / "run", tmp_path / "job.out"
    r = sbatch(slurm_conf, out, "--config", "configs/tiny_moe_gspo.yaml", "--run-dir", str(run),
               "--steps", "2", f"model.path={task_model}", *QUICK, wait=True)  # fmt: skip
    log = out.read_text() if out.exists() else r.stderr
    assert r.returncode == 0, log[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert "reward/mean" in rows[1] and "loss/policy" in rows[1]
    assert (run / "checkpoints" / "step_2" / "trainer_state.json").is_file()
    assert list((run / "logs" / "ranks" / "node0").rglob("stderr.log"))  # per rank
    assert (run / "logs" / "servers" / "node0" / "server-0.log").is_file()  # per server
    assert f"job {r.stdout.strip()} finished" in log
    pids = _server_pids(run)
    assert pids and _gone(pids), "the job left its rollout servers running"


def test_scancel_stops_every_process_the_job_started(slurm_conf, task_model, tmp_path):
    run, out = tmp_path / "run", tmp_path / "job.out"
    r = sbatch(slurm_conf, out, "--config", "configs/tiny_moe_gspo.yaml", "--run-dir", str(run),
               "--steps", "40", f"model.path={task_model}", *QUICK, wait=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    env = dict(os.environ, SLURM_CONF=str(slurm_conf))
    deadline = time.monotonic() + 600
    while not (run / "metrics.jsonl").is_file():  # servers up, trainer past its first step
        assert time.monotonic() < deadline, out.read_text()[-3000:] if out.exists() else "no output"
        time.sleep(0.5)
    pids = _server_pids(run)
    assert pids
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    deadline = time.monotonic() + 120
    while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                         text=True).stdout.strip():  # fmt: skip
        assert time.monotonic() < deadline, "the job did not end after scancel"
        time.sleep(0.5)
    time.sleep(1)
    assert _gone(pids), "scancel left rollout servers running"
    assert "received SIGTERM" in (run / "logs" / "launch" / "node0.log").read_text()
