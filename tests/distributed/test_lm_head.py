"""The chunked LM head under TP2, with and without sequence parallelism (gloo, 2 ranks), against
the single-rank computation of today (the whole logits, then the log-softmax), gradients w.r.t.
the hidden states and the output weight included; whole models (dense with tied embeddings,
MoE) with the head on against the output layer's whole logits, every parameter's gradient; the
actor's step (megatron DDP) with the head on and off."""

from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("lm_head_worker.py")


@pytest.fixture(scope="module")
def result(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_head") / "out.json"
    dense, moe = str(tiny_models["qwen2_tied"]), str(tiny_models["moe"])
    return run_distributed(WORKER, 2, str(out), dense, moe, out=out)


@pytest.mark.parametrize("case", ["head_sp0", "head_sp1"])
def test_head_under_tp_matches_the_single_rank_whole_logits(result, case):
    """fp32: the same numbers but for the order of float sums (log-probs of scale ~5)."""
    got = result[case]
    assert set(got) == {"logprobs", "entropy", "grad_h", "grad_w"}
    assert all(v < 1e-5 for v in got.values()), got


def test_fused_log_softmax_under_tp_matches_todays_tp_path(result):
    assert all(v < 1e-5 for v in result["fused_tp"].values()), result["fused_tp"]


@pytest.mark.parametrize("case", ["dense_tied_sp0", "dense_tied_sp1", "moe_sp1"])
def test_model_with_chunked_head_matches_whole_logits(result, case):
    got = result[case]
    assert got["lp_scale"] > 1  # real log-probs
    assert got["n_grads"] == got["n_params"] >= 8, got  # every weight has a gradient, both ways
    assert got["logprobs"] < 1e-5 and got["entropy"] < 1e-5
    assert got["grad_rel"] < 1e-5, got  # largest difference / largest gradient, per weight
    if "window" in got:  # positions before the window: none computed (zeros)
        assert got["window"] < 1e-5


def test_actor_steps_with_chunked_head_match_whole_logits(result):
    """Two GRPO steps through megatron DDP and the distributed optimizer, TP2 with sequence
    parallelism: the head's weight gradient goes into DDP's main_grad. Grad norm, loss and
    entropy as with the whole logits (to fp32 rounding), the output weight after the steps too
    (it moved by 1e-3 a step)."""
    got = result["actor_moe"]
    assert got["grad_norm"] > 0.1 and got["moved"] > 1e-3
    assert got["metrics_rel"] < 1e-5 and got["weight"] < 1e-6, got
