"""Grouped experts (GroupedExperts, model/experts.py) against sequential experts (megatron's
SequentialMLP) on the tiny MoE (first layer dense), fp32, gloo, 4 ranks, every layout in one
launch: the same log-probs, the same gradients under every expert's name, the same inputs to
every experts module under R3 replay, under TP2 (also with selective recompute, which
recomputes the grouped experts' activation), EP2, PP2 and TP2xEP2; and dist-checkpoints
saved with either kind load into the other, weights exactly and Adam's moments too (the second
step after loading equals the saver's own second step).

The independent side is the existing path: SequentialMLP, one matmul pair per expert.
"""

import json
from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("grouped_worker.py")
PLAN = [  # 4 ranks: every layout has data-parallel replicas too
    {"name": "tp1-r3", "tp": 1, "pp": 1, "ep": 1, "mbs": 2, "mode": "r3"},
    {"name": "tp2", "tp": 2, "pp": 1, "ep": 1, "mbs": 2, "mode": "r3"},
    {"name": "tp2-selective", "tp": 2, "pp": 1, "ep": 1, "mbs": 2, "mode": "r3",
     "recompute": "selective"},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2, "mbs": 1, "mode": "none", "cross_load": True},
    {"name": "pp2", "tp": 1, "pp": 2, "ep": 1, "mbs": 2, "mode": "r3"},
    {"name": "tp2xep2", "tp": 2, "pp": 1, "ep": 2, "mbs": 2, "mode": "r3"},
]  # fmt: skip
NAMES = [layout["name"] for layout in PLAN]
FP32 = 2e-6  # fp32 rounding of the same sums taken in another order, at these magnitudes


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grouped")
    plan = tmp / "plan.json"
    plan.write_text(json.dumps(PLAN))
    out = tmp / "out.json"
    work = tmp / "ckpt"
    work.mkdir()
    args = (str(tiny_models["moe4"]), str(out), str(plan), str(work))
    return run_distributed(WORKER, 4, *args, out=out, timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_forward_log_probs_equal(runs, name):
    assert runs[name]["kinds"] == [["SequentialExperts"], ["GroupedExperts"]]
    assert runs[name]["logprobs"] < 5 * FP32


@pytest.mark.parametrize("name", NAMES)
def test_hf_weights_load_and_read_back_the_same(runs, name):
    """HF tensors go into the grouped weights through their per-expert views and come back
    out (TP-gathered; and as weight sync gathers them) exactly as from the sequential experts."""
    r = runs[name]
    assert r["hf_tensors"] > r["sync_tensors"] > 0 and r["hf_weights"] == 0.0


def test_selective_recompute_recomputes_the_grouped_experts_activation(runs):
    assert runs["tp2-selective"]["moe_act_recompute"] == [False, True]
    assert runs["tp2"]["moe_act_recompute"] == [False, False]


@pytest.mark.parametrize("name", NAMES)
def test_gradients_equal_under_every_expert_name(runs, name):
    r = runs[name]
    assert r["grad_scale"] > 1e-3  # the gradients compared are not all zero
    assert r["grads"] < FP32 * r["grad_scale"] * 10
    seq_loss, grp_loss = r["loss"]
    assert grp_loss == pytest.approx(seq_loss, rel=1e-6, abs=1e-7)
    seq_norm, grp_norm = r["grad_norm"]
    assert grp_norm == pytest.approx(seq_norm, rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_experts_receive_the_same_tokens(runs, name):
    """Every experts module (every MoE layer, every microbatch) got the same number of tokens
    per expert and the same hidden states; under R3 the replayed routing fixes which."""
    r = runs[name]
    assert r["expert_calls"] > 0
    assert r["same_tokens_per_expert"]
    assert r["expert_inputs"] < 5 * FP32


@pytest.mark.parametrize("direction", ["seq_loads_grouped", "grouped_loads_seq"])
def test_checkpoints_load_across_kinds(runs, direction):
    r = runs["ep2"]["cross_load"][direction]
    assert r["params_after_load"] == 0.0
    # lr 1e-3: a second step without the saved Adam moments would move weights by ~1e-3
    assert r["step2_params"] < 1e-6
    loaded, saver = r["step2_grad_norm"]
    assert loaded == pytest.approx(saver, rel=1e-6)


def test_a_converted_checkpoint_loads_into_grouped_experts(runs):
    """`convert hf-to-megatron` builds sequential experts; its checkpoint loaded into grouped
    ones scores exactly as the HF weights loaded into them."""
    assert runs["ep2"]["converted"] == 0.0
