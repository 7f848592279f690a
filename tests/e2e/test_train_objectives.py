"""The new objectives and corrections through the real loop (`megatron-gspo train`, the built-in
server in bf16 against the fp32 trainer: a real train-inference gap): SAPO with IcePop, and CISPO
with sequence-level MIS, Dr. GRPO's advantages and aggregation and DAPO's over-long shaping. Each
run trains, and the share masked and SAPO's gate reach the metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import QUICK_TRAIN, cli_env

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(seed=0), tmp_path_factory.mktemp("task") / "model")


CASES = {
    "sapo_icepop": ["algo.loss=sapo", "algo.mismatch=icepop", "algo.icepop_k=1.001"],
    "cispo_mis_drgrpo": [
        "algo.loss=cispo",
        "algo.mismatch=mis",
        "algo.mismatch_level=sequence",
        "algo.tis_reduce=mean",
        "algo.mis_low=0.9997",
        "algo.mis_high=1.0003",
        "algo.adv_norm=none",
        "algo.agg=seq-mean-token-sum-norm",
        "algo.norm_length=8",
        "reward.overlong_buffer=4",
    ],  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_objective_and_correction_train_and_report(case, task_model, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config",
           str(ROOT / "configs" / "tiny_moe_grpo.yaml"), "--run-dir", str(run_dir), "--steps", "2",
           f"model.path={task_model}", *QUICK_TRAIN, "rollout.dtype=bfloat16", *CASES[case]]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cli_env(), cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 2 and all(r["update/nonfinite"] == 0 for r in rows)
    # a bf16 server against the fp32 trainer (|logp gap| ~1e-3): some tokens (sequences) fall
    # outside the narrow band, most not
    masked = [r["mismatch/masked_fraction_tokens"] for r in rows]
    assert not any("tis/weight_mean" in r for r in rows)  # (that is TIS's key)
    assert all(0 <= m < 1 for m in masked) and max(masked) > 0, masked
    assert all(r["mismatch/logprob_abs_diff"] > 0 for r in rows)
    assert all(0 < r["mismatch/masked_fraction_seqs"] <= 1 for r in rows if r[
        "mismatch/masked_fraction_tokens"] > 0)  # fmt: skip
    if case.startswith("sapo"):
        assert all(0 < r["sapo/gate_mean"] <= 1 for r in rows), rows
