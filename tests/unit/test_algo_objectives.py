"""SAPO, CISPO, Dr. GRPO and the mismatch corrections (tis, mis, icepop) against their papers'
formulas written out here, on random inputs: values and gradients, token and sequence shapes.

Legend: B = sequences, T = padded tokens.
"""

import pytest
import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.config import AlgoConfig, Level, LossKind, Mismatch, TisReduce
from megatron_gspo.algo.loss_stats import summarize_stats
from megatron_gspo.algo.mismatch import correction_weights
from megatron_gspo.algo.policy_loss import policy_loss

pytestmark = pytest.mark.unit


def _batch(seed: int, B: int = 6, T: int = 9, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_BT = old_BT + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout_BT = old_BT + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask_BT = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    adv_B = torch.randn(B, generator=g, dtype=torch.float64)
    adv_BT = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp_BT, old_BT, rollout_BT, mask_BT, adv_B, adv_BT


def _grad(kind, logp_BT, old_BT, adv, mask_BT, **kw):
    logp = logp_BT.clone().requires_grad_()
    loss, stats = policy_loss(logp, old_BT, adv, mask_BT, kind=kind, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, summarize_stats(stats)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_value_and_gradient(per_token, tau_pos, tau_neg):
    """SAPO (arXiv 2511.20347): J = (1/G) sum_i (1/|y_i|) sum_t f(r_{i,t}) A_{i,t},
    f(r) = sigmoid(tau (r - 1)) 4 / tau; dJ/dlogp_{i,t} = 4 s (1 - s) r A / (G |y_i|)."""
    logp_BT, old_BT, _, mask_BT, adv_B, adv_BT = _batch(0)
    adv = adv_BT if per_token else adv_B
    a_BT = adv if per_token else adv_B.unsqueeze(-1).expand_as(logp_BT)
    loss, grad, stats = _grad("sapo", logp_BT, old_BT, adv, mask_BT, clip_low=0.2, clip_high=0.2,
                              sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)  # fmt: skip
    m = mask_BT.double()
    n_i = m.sum(-1, keepdim=True)
    G = mask_BT.shape[0]
    r = torch.exp(logp_BT - old_BT)
    tau = torch.where(a_BT > 0, tau_pos, tau_neg)
    s = torch.sigmoid(tau * (r - 1))
    want_loss = -((s * 4 / tau * a_BT * m).sum(-1, keepdim=True) / n_i).sum() / G
    want_grad = -(4 * s * (1 - s) * r * a_BT * m) / (G * n_i)
    assert torch.allclose(loss, want_loss, rtol=1e-12)
    assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
    gate = ((4 * s * (1 - s)) * m).sum() / m.sum()
    assert stats["sapo_gate_mean"] == pytest.approx(float(gate))
    assert stats["clip_frac_tokens"] == 0.0  # nothing is hard-clipped


def test_sapo_gate_decays_faster_for_negative_advantages():
    """tau_neg > tau_pos: at the same ratio off 1 a negative advantage keeps less gradient."""
    r = torch.tensor([[1.5, 1.5]], dtype=torch.float64)
    logp = torch.log(r).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, torch.zeros_like(r), adv, torch.ones_like(r, dtype=torch.bool),
                          kind="sapo", clip_low=0.2, clip_high=0.2, agg="token-mean")  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    assert abs(g[0, 1]) < abs(g[0, 0])


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("clip_low,clip_high", [(1.0, 0.28), (0.2, 0.2)])
def test_cispo_value_and_gradient(per_token, clip_low, clip_high):
    """CISPO (arXiv 2506.13585): J = (1/sum_i |o_i|) sum_i sum_t sg(clip(r, 1-eps_l, 1+eps_h))
    A log pi; dJ/dlogp = clip(r) A / sum|o_i|: every token with A != 0 keeps a gradient."""
    logp_BT, old_BT, _, mask_BT, adv_B, adv_BT = _batch(1, spread=1.0)
    adv = adv_BT if per_token else adv_B
    a_BT = adv if per_token else adv_B.unsqueeze(-1).expand_as(logp_BT)
    loss, grad, stats = _grad("cispo", logp_BT, old_BT, adv, mask_BT, clip_low=clip_low,
                              clip_high=clip_high)  # fmt: skip
    m = mask_BT.double()
    w = torch.exp(logp_BT - old_BT).clamp(1 - clip_low, 1 + clip_high)
    want_loss = -(w * a_BT * logp_BT * m).sum() / m.sum()  # the default aggregation: token-mean
    want_grad = -(w * a_BT * m) / m.sum()
    assert torch.allclose(loss, want_loss, rtol=1e-12)
    assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert bool((grad[mask_BT] != 0).all())  # no token loses its gradient
    truncated = ((torch.exp(logp_BT - old_BT) > 1 + clip_high) & mask_BT).sum() + (
        (torch.exp(logp_BT - old_BT) < 1 - clip_low) & mask_BT).sum()  # fmt: skip
    assert stats["clip_frac_tokens"] == pytest.approx(float(truncated / m.sum()))
    assert stats["clip_frac_tokens"] > 0


def test_dr_grpo_advantages_and_constant_normalizer():
    """Dr. GRPO (arXiv 2503.20783): A_i = r_i - mean(r) (no std), and the loss sums each
    sequence's tokens over a constant L: J = (1/(G L)) sum_i sum_t min(r A, clip(r) A)."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    adv = group_advantages(rewards, scale_by_std=False)
    assert torch.allclose(adv, rewards - rewards.mean(1, keepdim=True), rtol=1e-12)
    logp_BT, old_BT, _, mask_BT, adv_B, _ = _batch(3)
    L = 16
    loss, grad, _ = _grad("grpo", logp_BT, old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.28,
                          agg="seq-mean-token-sum-norm", norm_length=L)  # fmt: skip
    a = adv_B.unsqueeze(-1)
    r = torch.exp(logp_BT - old_BT)
    o = torch.minimum(r * a, r.clamp(0.8, 1.28) * a) * mask_BT
    B = mask_BT.shape[0]
    assert torch.allclose(loss, -o.sum() / (B * L), rtol=1e-12)
    unclipped = (r * a <= r.clamp(0.8, 1.28) * a) & mask_BT  # where the min takes r A
    assert torch.allclose(grad, -(r * a * unclipped) / (B * L), rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="norm_length"):
        policy_loss(logp_BT, old_BT, adv_B, mask_BT, kind="grpo", clip_low=0.2, clip_high=0.2,
                    agg="seq-mean-token-sum-norm")  # fmt: skip


# ---- mismatch corrections -------------------------------------------------------------------


def _rho(old_BT, rollout_BT):
    return torch.exp(old_BT - rollout_BT)


@pytest.mark.parametrize("reduce", [TisReduce.SUM, TisReduce.MEAN])
def test_each_correction_matches_its_formula(reduce):
    """tis: min(rho, C); mis: rho 1[lo <= rho <= hi] per token or per sequence (rho_i the
    product or geometric mean of the tokens'); icepop: rho_t 1[1/k <= rho_t <= k]."""
    _, old_BT, rollout_BT, mask_BT, _, _ = _batch(4, spread=0.6)
    m = mask_BT.double()
    rho = _rho(old_BT, rollout_BT)
    log_rho_B = (torch.log(rho) * m).sum(-1)
    if reduce == TisReduce.MEAN:
        log_rho_B = log_rho_B / m.sum(-1)
    rho_B = torch.exp(log_rho_B)
    cases = {
        (Mismatch.TIS, Level.TOKEN): rho.clamp(max=1.7) * m,
        (Mismatch.TIS, Level.SEQUENCE): rho_B.clamp(max=1.7),
        (Mismatch.MIS, Level.TOKEN): rho * ((rho >= 0.6) & (rho <= 1.5)) * m,
        (Mismatch.MIS, Level.SEQUENCE): rho_B * ((rho_B >= 0.6) & (rho_B <= 1.5)),
        (Mismatch.ICEPOP, Level.TOKEN): rho * ((rho >= 1 / 1.8) & (rho <= 1.8)) * m,
    }
    for (kind, level), want in cases.items():
        cfg = AlgoConfig(mismatch=kind, mismatch_level=level, tis_cap=1.7, tis_reduce=reduce,
                         mis_low=0.6, mis_high=1.5, icepop_k=1.8)  # fmt: skip
        got = correction_weights(cfg, old_BT, rollout_BT, mask_BT)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12), (kind, level)
        # the inputs exercise both sides of the band (geometric means of sequences stay in it)
        if kind != Mismatch.TIS and (want.dim() == 2 or reduce == TisReduce.SUM):
            dropped = int((got == 0).sum() - (want.dim() == 2) * (~mask_BT).sum())
            assert 0 < dropped < got.numel()
    assert correction_weights(AlgoConfig(), old_BT, rollout_BT, mask_BT) is None
    with pytest.raises(ValueError, match="rollout log-probs"):
        correction_weights(AlgoConfig(mismatch=Mismatch.MIS), old_BT, None, mask_BT)


@pytest.mark.parametrize("level", [Level.TOKEN, Level.SEQUENCE])
def test_mis_in_the_loss_drops_tokens_and_reports_the_share(level):
    """The loss with MIS weights equals the loss over the kept tokens (sequences) only, weighted
    by rho; the stats count what was dropped."""
    logp_BT, old_BT, rollout_BT, mask_BT, adv_B, _ = _batch(5, spread=0.6)
    cfg = AlgoConfig(mismatch=Mismatch.MIS, mismatch_level=level, mis_low=0.7, mis_high=1.4)
    w = correction_weights(cfg, old_BT, rollout_BT, mask_BT)
    w_BT = w if w.dim() == 2 else w.unsqueeze(-1).expand_as(logp_BT)
    kw = dict(clip_low=0.2, clip_high=0.28, agg="token-mean", rollout_logprobs=rollout_BT)
    loss, grad, stats = _grad("grpo", logp_BT, old_BT, adv_B, mask_BT, tis_weights=w, **kw)
    r = torch.exp(logp_BT - old_BT)
    a = adv_B.unsqueeze(-1)
    o = torch.minimum(r * a, r.clamp(0.8, 1.28) * a) * w_BT * mask_BT
    assert torch.allclose(loss, -o.sum() / mask_BT.sum(), rtol=1e-12)
    dropped = mask_BT & (w_BT == 0)
    assert not grad[dropped].any()
    assert stats["mismatch_masked_frac_tokens"] == pytest.approx(
        float(dropped.sum() / mask_BT.sum())
    )
    n_seqs = float(mask_BT.any(-1).sum())
    assert stats["mismatch_masked_frac_seqs"] == pytest.approx(
        float(dropped.any(-1).sum()) / n_seqs
    )
    assert 0 < stats["mismatch_masked_frac_tokens"] < 1


def test_loss_kwargs_carry_the_kind_options():
    cfg = AlgoConfig(loss=LossKind.SAPO, sapo_tau_pos=0.7, sapo_tau_neg=1.3, norm_length=5)
    kw = cfg.loss_kwargs()
    assert kw["kind"] == "sapo" and kw["sapo_tau_pos"] == 0.7 and kw["sapo_tau_neg"] == 1.3
    assert kw["norm_length"] == 5 and (kw["clip_low"], kw["clip_high"]) == (0.2, 0.28)
    given = AlgoConfig(loss=LossKind.GRPO, clip_high=0.4).loss_kwargs()
    assert (given["clip_low"], given["clip_high"]) == (0.2, 0.4)  # a null bound: the loss's own


@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
def test_a_corrections_stats_are_the_ones_that_mean_something_for_it(correction):
    """TIS weights are > 0 (they mask nothing): its stat is the weights' sum; MIS and IcePop
    mask: theirs are the masked tokens and sequences. A run logs only its correction's keys."""

    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    weights = torch.tensor([[0.0, 1.2, 0.0], [0.8, 1.0, 0.0]])
    _, stats = policy_loss(lp, lp, torch.tensor([1.0, -1.0]), mask, kind="grpo", clip_low=0.2,
                           clip_high=0.2, tis_weights=weights, correction=correction)  # fmt: skip
    masks = {"mismatch_masked_tokens", "mismatch_masked_seqs"}
    if correction == Mismatch.TIS:
        assert "tis_weight_sum" in stats and not masks & set(stats)
        assert float(stats["tis_weight_sum"]) == pytest.approx(0.0 + 1.2 + 0.8 + 1.0 + 0.0)
    else:
        assert masks <= set(stats) and "tis_weight_sum" not in stats
        assert float(stats["mismatch_masked_tokens"]) == 2.0  # (0, 0) and (1, 2)
        assert float(stats["mismatch_masked_seqs"]) == 2.0
    assert AlgoConfig(mismatch=correction).loss_kwargs()["correction"] == correction
