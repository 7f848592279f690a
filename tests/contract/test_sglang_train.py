"""The RL loop with real SGLang as its rollout backend, started by the trainer from the
documented keys alone (README, docs/deployment.md): `rollout.backend=sglang` and
`rollout.sglang_python=...`. The launcher gives SGLang the cpu device, the checkpoint's dtype
and a KV cache sized to the run; a 16-bit server passes weight verification at its dtype's
tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env
from tests.contract.sglang_venv import sglang_python

pytestmark = [pytest.mark.contract, pytest.mark.real_sglang]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    out = tmp_path_factory.mktemp("sglang_task") / "model"
    return make_task_model(out, seed=0, clean_steps=30, sloppy_steps=10)


def train(config: str, run_dir: Path, model: Path, *extra: str, steps: int = 5):
    cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config",
           str(ROOT / "configs" / config), "--run-dir", str(run_dir), "--steps", str(steps),
           f"model.path={model}", "rollout.backend=sglang",
           f"rollout.sglang_python={sglang_python()}", *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    header = next(
        line for line in (run_dir / "logs" / "server-0.log").read_text().splitlines()
        if " start #0: " in line
    )  # fmt: skip
    return rows, header


def test_sglang_trains_gspo_from_the_documented_keys(task_model, tmp_path):
    rows, header = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model)
    assert "-m sglang.launch_server" in header
    for flag in ("--device cpu", "--dtype float32", "--disable-cuda-graph"):
        assert flag in header, header
    # 8 prompts x 8 samples x (prompt + 8 new tokens) x 1.5, at least 4096
    assert "--max-total-tokens 4096" in header and "--max-running-requests 64" in header
    assert "--api-key ***" in header  # a random key, kept out of the log
    for r in rows[1:]:
        assert r["mismatch/logprob_abs_diff"] < 1e-3  # an fp32 server: the trainer's numbers
        assert r["rollout/stale_samples"] == 0


def test_sglang_bf16_trains_grpo_r3_with_every_sync_verified(task_model, tmp_path):
    rows, header = train("tiny_moe_grpo_r3.yaml", tmp_path / "run", task_model,
                         "rollout.dtype=bfloat16", "sync.verify_every=1")  # fmt: skip
    assert "--dtype bfloat16" in header and "--enable-return-routed-experts" in header
    for r in rows[1:]:
        assert 1e-4 < r["mismatch/logprob_abs_diff"] < 0.5  # bf16 against the fp32 trainer
        assert 0.5 < r["routing/rollout_train_agreement"] <= 1.0
