"""GPU tier: the RL loop with the Megatron trainer on the GPU and the built-in rollout server on
the CPU, through each weight-sync transport, with the probe check after every sync (a mismatch
past its tolerance fails the run). The first step of a run must match the same run with the GPU
hidden: the same seed gives the same CPU rollouts, so the trainer's numbers must agree."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import cli_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    return make_task_model(tmp_path_factory.mktemp("task") / "model", seed=0)


def train(task_model: Path, run_dir: Path, config: str, *overrides: str, gpu: bool = True):
    env = cli_env()
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable, "-m", "megatron_gspo.cli", "train", "--config", str(CONFIGS / config),
        "--run-dir", str(run_dir), "--steps", "2", f"model.path={task_model}",
        "sync.verify_every=1", "train.eval_every=0", "logging.tensorboard=false", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.fixture(scope="module")
def cpu_run(task_model, tmp_path_factory):
    return train(
        task_model, tmp_path_factory.mktemp("cpu") / "run", "tiny_moe_gspo.yaml", gpu=False
    )


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_gpu_trainer_syncs_into_a_cpu_server_and_matches_the_cpu_run(
    method, task_model, cpu_run, tmp_path
):
    rows = train(task_model, tmp_path / "run", "tiny_moe_gspo.yaml", f"sync.method={method}")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the server's (CPU) rollout log-probs against the trainer's (GPU)
        assert r["mismatch/logprob_abs_diff"] < 1e-4
    gpu, cpu = rows[0], cpu_run[0]
    assert gpu["reward/mean"] == cpu["reward/mean"]  # the same rollouts
    for k in ("loss/policy", "grad_norm", "ratio/mean", "kl/old"):
        assert math.isclose(gpu[k], cpu[k], rel_tol=1e-3, abs_tol=1e-5), (k, gpu[k], cpu[k])


def test_gpu_trainer_replays_cpu_rollout_routing(task_model, tmp_path):
    rows = train(task_model, tmp_path / "run", "tiny_moe_grpo_r3.yaml", "sync.method=tensor")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/logprob_abs_diff"] < 1e-4
        assert math.isfinite(r["loss/policy"]) and r["routing/bytes_per_token"] > 0
