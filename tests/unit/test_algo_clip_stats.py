"""Clip fractions and ratio statistics on hand-made batches where the answer is known."""

import math

import pytest
import torch

from megatron_gspo.algo.loss_stats import (
    combine_stats,
    log_ratio_split_stats,
    stat_reduce_op,
    summarize_stats,
)
from megatron_gspo.algo.policy_loss import policy_loss

pytestmark = pytest.mark.unit

L15, L05, L11, L2 = math.log(1.5), math.log(0.5), math.log(1.1), math.log(2.0)


def _run(kind, log_ratio_BT, mask_BT, adv):
    old_BT = torch.full_like(log_ratio_BT, -1.0)
    loss, stats = policy_loss(
        old_BT + log_ratio_BT, old_BT, adv, mask_BT, kind=kind, clip_low=0.2, clip_high=0.2
    )
    return loss, stats, summarize_stats(stats)


def test_grpo_clip_fractions():
    # row 0, A > 0: ratio 1.5 clips high; ratio 0.5 does not (A > 0 never clips low).
    # row 1, A < 0: ratio 1.5 does not clip; ratio 0.5 clips low; the masked 1.5 is not counted.
    # row 2, A > 0: ratios 1 and 1.1, nothing clips.
    log_ratio_BT = torch.tensor([[L15, L05, 0.0], [L15, L05, L15], [0.0, L11, 0.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    _, stats, s = _run("grpo", log_ratio_BT, mask_BT, torch.tensor([1.0, -1.0, 1.0]))
    assert stats["clipped_tokens_high"] == 1 and stats["clipped_tokens_low"] == 1
    assert s["clip_frac_tokens"] == pytest.approx(2 / 7)
    assert s["clip_frac_tokens_low"] == pytest.approx(1 / 7)
    assert s["clip_frac_seqs"] == pytest.approx(2 / 3)
    ratios = torch.tensor([1.5, 0.5, 1.0, 1.5, 0.5, 1.0, 1.1], dtype=torch.float64)
    assert s["ratio_mean"] == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert s["ratio_std"] == pytest.approx(ratios.std(correction=0).item(), rel=1e-5)
    assert (s["ratio_min"], s["ratio_max"]) == pytest.approx((0.5, 1.5), rel=1e-6)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_gspo_clip_fractions_and_value(kind):
    # Sequence ratios: 1.5 (A>0, clips high, 3 tokens), 0.5 (A<0, clips low, 2 tokens),
    # 1.0 (token ratios 2 and 1/2, which GRPO would clip; GSPO does not), 1.5 with A<0 (no clip).
    log_ratio_BT = torch.tensor([[L15, L15, L15], [L05, L05, 9.0], [L2, -L2, 9.0], [L15, 9.0, 9.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv_B = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats, s = _run(kind, log_ratio_BT, mask_BT, adv_B)
    assert stats["clipped_tokens_high"] == 3 and stats["clipped_tokens_low"] == 2
    assert s["clip_frac_tokens"] == pytest.approx(5 / 8)
    assert s["clip_frac_seqs"] == pytest.approx(2 / 4)
    assert s["ratio_mean"] == pytest.approx(1.125, rel=1e-6)
    assert s["ratio_std"] == pytest.approx(torch.tensor([1.5, 0.5, 1, 1.5]).std(correction=0))
    # Terms min(sA, clip(s)A): 1.2, -0.8, 1.0, -1.5; loss = -mean.
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 1.0 - 1.5) / 4, rel=1e-6)


def test_approx_kl_is_k3_to_old():
    log_ratio_BT = torch.tensor([[L2, 0.0]])
    mask_BT = torch.tensor([[True, True]])
    _, _, s = _run("grpo", log_ratio_BT, mask_BT, torch.tensor([1.0]))
    assert s["approx_kl_old"] == pytest.approx((2 - 1 - L2) / 2, rel=1e-6)


def test_mismatch_and_tis_metrics():
    old_BT = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout_BT = torch.tensor([[-1.5, -2.0, -1.0]])
    mask_BT = torch.tensor([[True, True, False]])
    _, stats = policy_loss(
        old_BT,
        old_BT,
        torch.tensor([1.0]),
        mask_BT,
        kind="grpo",
        clip_low=0.2,
        clip_high=0.2,
        rollout_logprobs=rollout_BT,
        tis_weights=torch.tensor([[2.0, 1.0, 5.0]]),
    )
    s = summarize_stats(stats)
    assert s["logprob_mismatch_abs"] == pytest.approx(0.25)
    assert s["tis_weight_mean"] == pytest.approx(1.5)


def test_combine_uses_min_and_max_for_extrema():
    a = {
        "ratio_min": torch.tensor(0.9),
        "ratio_max": torch.tensor(1.2),
        "num_tokens": torch.tensor(3.0),
    }
    b = {
        "ratio_min": torch.tensor(0.8),
        "ratio_max": torch.tensor(1.1),
        "num_tokens": torch.tensor(2.0),
    }
    out = combine_stats([a, b])
    assert (out["ratio_min"], out["ratio_max"], out["num_tokens"]) == (0.8, 1.2, 5.0)
    assert [stat_reduce_op(k) for k in ("ratio_min", "ratio_max", "clipped_seqs")] == [
        "min",
        "max",
        "sum",
    ]


def test_ratio_std_survives_gspo_sized_deviations_in_fp32():
    # GSPO ratios sit within ~1e-4 of 1; a naive E[r^2] - E[r]^2 in fp32 would return 0 or junk.
    dev = torch.tensor([1e-4, -1e-4, 2e-4, -2e-4])
    log_ratio_BT = torch.log1p(dev).unsqueeze(-1)
    mask_BT = torch.ones(4, 1, dtype=torch.bool)
    _, _, s = _run("gspo", log_ratio_BT, mask_BT, torch.ones(4))
    assert s["ratio_std"] == pytest.approx(dev.double().std(correction=0).item(), rel=1e-3)


def test_log_ratio_split_by_moved_routing_over_microbatches():
    """Two microbatches combined: the std of the log-ratio over the loss tokens whose routing
    moved and over the others, and the moved share, against the numbers written out."""
    lr1 = torch.tensor([[0.1, -0.2, 0.3], [0.05, 9.0, -0.1]])
    mask1 = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])  # 9.0 is not a loss token
    moved1 = torch.tensor([[True, False, True], [False, True, False]])
    lr2 = torch.tensor([[0.4, -0.3]])
    mask2 = torch.tensor([[1.0, 1.0]])
    moved2 = torch.tensor([[True, False]])
    parts = [
        log_ratio_split_stats(lr1, mask1, moved1),
        log_ratio_split_stats(lr2, mask2, moved2),
    ]
    combined = combine_stats(parts)
    base = {"num_tokens": 7.0, "num_seqs": 3.0, "ratio_count": 0.0}
    zeros = dict.fromkeys(("clipped_tokens_low", "clipped_tokens_high", "clipped_seqs"), 0.0)
    zeros |= dict.fromkeys(("ratio_minus_one_sum", "ratio_minus_one_sq_sum", "kl_old_k3_sum"), 0)
    stats = {k: torch.tensor(float(v)) for k, v in (base | zeros).items()} | combined
    out = summarize_stats(stats)
    moved = [0.1, 0.3, 0.4]
    same = [-0.2, 0.05, -0.1, -0.3]

    def std(xs):
        mean = sum(xs) / len(xs)
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))

    assert out["log_ratio_std_moved"] == pytest.approx(std(moved), rel=1e-6)
    assert out["log_ratio_std_same"] == pytest.approx(std(same), rel=1e-6)
    assert out["tokens_moved_fraction"] == pytest.approx(3 / 7)


def test_log_ratio_split_leaves_out_an_empty_group():
    out = _split_summary_of([0.1, 0.2], [False, False])
    assert out["tokens_moved_fraction"] == 0.0 and "log_ratio_std_moved" not in out
    assert out["log_ratio_std_same"] == pytest.approx(0.05, rel=1e-6)


def _split_summary_of(lr: list[float], moved: list[bool]) -> dict:
    """summarize_stats of one minibatch holding one sequence of loss tokens `lr`."""
    s = log_ratio_split_stats(torch.tensor([lr]), torch.ones(1, len(lr)), torch.tensor([moved]))
    base = dict.fromkeys(
        ("num_tokens", "num_seqs", "clipped_tokens_low", "clipped_tokens_high", "clipped_seqs",
         "ratio_count", "ratio_minus_one_sum", "ratio_minus_one_sq_sum", "kl_old_k3_sum",
         "ratio_min", "ratio_max"),
        torch.tensor(1.0),
    )  # fmt: skip
    return summarize_stats(base | s)


def test_a_log_ratio_std_over_one_token_is_left_out_not_zero():
    """One moved token used to log log_ratio_std_moved = 0.0 (a population std over one value),
    which the step's mean over minibatches and the study's findings read as "no spread". Now a
    group of fewer than 2 tokens has no std: the step's mean is over the minibatches that have
    one (the loop's mean takes the minibatches that hold the key)."""
    one = _split_summary_of([0.3, -0.1, 0.2], [True, False, False])
    assert "log_ratio_std_moved" not in one and one["tokens_moved_fraction"] == pytest.approx(1 / 3)
    assert one["log_ratio_std_same"] == pytest.approx(abs(-0.1 - 0.2) / 2, rel=1e-6)
    # two tokens a, b: population std = |a - b| / 2
    two = _split_summary_of([0.3, -0.5, 0.2], [True, True, False])
    assert two["log_ratio_std_moved"] == pytest.approx(abs(0.3 - -0.5) / 2, rel=1e-6)
    assert "log_ratio_std_same" not in two
    values = [m["log_ratio_std_moved"] for m in (one, two) if "log_ratio_std_moved" in m]
    assert sum(values) / len(values) == pytest.approx(0.4, rel=1e-6)  # (was (0 + 0.4) / 2)
