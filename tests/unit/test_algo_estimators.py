"""Group advantages, KL estimators and mismatch weights against hand-computed numbers."""

import math

import pytest
import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.kl import kl_estimate, kl_k1, kl_k2, kl_k3
from megatron_gspo.algo.mismatch import (
    logprob_abs_diff,
    sequence_mismatch_mask,
    sequence_tis_weights,
    token_mismatch_mask,
    token_tis_weights,
)

pytestmark = pytest.mark.unit


def test_group_advantages_unbiased_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735: A = +-0.5 / 0.57735 = +-0.866025.
    expected = torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(group_advantages(rewards), expected, atol=1e-5)
    flat = group_advantages(rewards.flatten(), group_size=4)
    assert flat.shape == (8,) and torch.allclose(flat, expected.flatten(), atol=1e-5)


def test_group_advantages_dr_grpo_and_edge_cases():
    rewards = torch.tensor([1, 0, 0, 1, 3, 1])  # int rewards, groups of 3
    dr = group_advantages(rewards, group_size=3, scale_by_std=False)
    assert torch.allclose(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 4 / 3, -2 / 3]))
    assert torch.equal(group_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(6), group_size=4)


def _written_out(r: list[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """The module docstring's formula, in Python floats: s = r / max|r|, then standardized."""
    m = max(abs(x) for x in r) or 1.0
    s = [x / m for x in r]
    mean = sum(s) / len(s)
    if not scale_by_std:
        return [(x - mean) * m for x in s]
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
    return [(x - mean) / (std + eps) for x in s]


@pytest.mark.parametrize(
    "rewards, dtype",
    [
        ([1e308, 1e200, 0.0, -1e308], torch.float64),
        ([1e308, 1e308, 1e308, -1e308], torch.float64),
        ([1e200, -1e200, 3.0, 0.0], torch.float64),
        ([3e38, 3e38, -3e38, 1.0], torch.float32),
        ([1e-300, 0.0, -2e-300, 0.0], torch.float64),
    ],
)
def test_group_advantages_are_finite_for_any_finite_rewards(rewards, dtype):
    """The sum for the mean (1e308 + 1e308) and the squares for the std (1e200^2) would
    overflow; scaled by the group's largest |reward| first, nothing does."""
    got = group_advantages(torch.tensor([rewards], dtype=dtype))
    assert torch.isfinite(got).all(), got
    want = torch.tensor([_written_out(rewards)], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_dr_grpo_advantages_keep_the_rewards_scale():
    got = group_advantages(torch.tensor([1e200, -1e200, 0.0], dtype=torch.float64), 3,
                           scale_by_std=False)  # fmt: skip
    want = torch.tensor(_written_out([1e200, -1e200, 0.0], scale_by_std=False), dtype=torch.float64)
    assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-12)


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log r = log(0.25 / 0.5) = -log 2.
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_k3(logp, logp).item() == 0.0


def test_kl_k3_is_clamped_and_finite():
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    ref = torch.tensor([1e4, -1e4])
    k3 = kl_k3(logp, ref)
    assert torch.equal(k3, torch.tensor([10.0, 10.0]))
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    unclamped = kl_k3(logp.detach(), ref, max_value=None)
    assert torch.isfinite(unclamped).all()


OLD = torch.tensor([[0.0, math.log(3), math.log(0.5)], [0.1, 0.2, 0.3]])
ROLLOUT = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)


def test_token_tis_and_mask():
    w = token_tis_weights(OLD, ROLLOUT, MASK, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]]))
    keep = token_mismatch_mask(OLD, ROLLOUT, MASK, cap=2.0)
    assert torch.equal(keep, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    band = token_mismatch_mask(OLD, ROLLOUT, MASK, low=0.4, high=2.5)  # [0.4, 2.5]: 0.5 in
    assert torch.equal(band, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    band = token_mismatch_mask(OLD, ROLLOUT, MASK, low=0.6, high=3.0)  # 0.5 out, 3 in
    assert torch.equal(band, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_sequence_tis_and_mask():
    # Row 0: sum of log-ratios = log 3 + log 0.5 = log 1.5; the empty row 1 gets ratio 1.
    w = sequence_tis_weights(OLD, ROLLOUT, MASK, cap=2.0, reduce="sum")
    assert torch.allclose(w, torch.tensor([1.5, 1.0]))
    w_mean = sequence_tis_weights(OLD, ROLLOUT, MASK, cap=2.0, reduce="mean")
    assert torch.allclose(w_mean, torch.tensor([1.5 ** (1 / 3), 1.0]))
    assert torch.allclose(
        sequence_tis_weights(OLD, ROLLOUT, MASK, cap=1.2), torch.tensor([1.2, 1.0])
    )
    keep = sequence_mismatch_mask(OLD, ROLLOUT, MASK, cap=1.4)
    assert torch.equal(keep, torch.tensor([0.0, 1.0]))
    band = sequence_mismatch_mask(OLD, ROLLOUT, MASK, low=1.4, high=1.6)  # 1.5 in, 1 out
    assert torch.equal(band, torch.tensor([1.0, 0.0]))


def test_mismatch_extremes_and_abs_diff():
    old = torch.tensor([[1e4, -1e4]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert torch.isfinite(token_tis_weights(old, torch.zeros(1, 2), mask)).all()
    assert torch.isfinite(sequence_tis_weights(old, torch.zeros(1, 2), mask)).all()
    diff = logprob_abs_diff(OLD, ROLLOUT, MASK)
    assert torch.allclose(diff, torch.tensor([[0.0, math.log(3), math.log(2)], [0, 0, 0]]))
    with pytest.raises(ValueError):
        token_mismatch_mask(OLD, ROLLOUT, MASK, cap=0.5)


def test_the_trainer_takes_the_configured_sequence_tis_reduction():
    """algo.tis_reduce: the step's sequence TIS weight is min(exp(sum of old - rollout), C) with
    sum, min(exp(mean of it), C) with mean, over the masked-in tokens (written out here)."""
    from types import SimpleNamespace

    from megatron_gspo.algo.config import AlgoConfig, Level, Mismatch, TisReduce
    from megatron_gspo.train.step_parts import correction_weights_of

    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -0.1, 0.0]])
    rollout = torch.tensor([[-1.3, -0.9, -9.0], [-0.1, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    mb = SimpleNamespace(old_logprobs=old, rollout_logprobs=rollout, mask=mask)
    diffs = [[0.3, 0.4], [-0.1, 0.2, 0.0]]  # old - rollout at the masked-in tokens
    for reduce, want in ((TisReduce.SUM, [min(math.exp(sum(d)), 1.5) for d in diffs]),
                         (TisReduce.MEAN, [min(math.exp(sum(d) / len(d)), 1.5) for d in diffs])):  # fmt: skip
        cfg = AlgoConfig(mismatch=Mismatch.TIS, mismatch_level=Level.SEQUENCE, tis_cap=1.5,
                         tis_reduce=reduce)  # fmt: skip
        assert torch.allclose(correction_weights_of(mb, cfg), torch.tensor(want)), reduce
