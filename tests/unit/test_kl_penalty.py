"""The KL penalty in the policy loss against its formula written out: with KL_{i,t} the k1/k2/k3
estimate of log pi_ref - log pi, the loss is the plain loss plus coef * agg(KL) (the same
aggregation and denominator), values and gradients; NaN in the reference at masked-out tokens
(where the batch has none) reaches neither the loss nor a gradient."""

import pytest
import torch

from megatron_gspo.algo.loss_stats import summarize_stats
from megatron_gspo.algo.policy_loss import KLPenalty, policy_loss

pytestmark = pytest.mark.unit


def k(kind: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    log_r = ref - logp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[kind]


@pytest.mark.parametrize("kind", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_is_coef_times_the_aggregated_estimate(kind, estimator):
    g = torch.Generator().manual_seed(0)
    B, T, coef = 4, 7, 0.3
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    ref = torch.where(mask, ref, torch.nan)  # none where nothing is trained
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    clip = dict(clip_low=0.2, clip_high=0.28)
    with_kl, stats = policy_loss(logp, old, adv, mask, kind=kind, **clip,
                                 kl=KLPenalty(ref, coef, estimator))  # fmt: skip
    (grad,) = torch.autograd.grad(with_kl, logp)
    x = logp.detach().clone().requires_grad_()
    plain, _ = policy_loss(x, old, adv, mask, kind=kind, **clip)
    est = torch.where(mask, k(estimator, x, torch.where(mask, ref, 0.0)), 0.0)
    if kind == "cispo":  # token-mean
        term = est.sum() / mask.sum()
    else:  # seq-mean-token-mean
        term = (est.sum(-1) / mask.sum(-1)).sum() / mask.any(-1).sum()
    expected = plain + coef * term
    (want,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(with_kl, expected)
    torch.testing.assert_close(grad, want)
    assert torch.isfinite(grad).all() and grad[~mask].abs().max() == 0
    kl_ref = summarize_stats(stats)["kl_ref"]
    assert kl_ref == pytest.approx(float(est.detach()[mask].mean()), rel=1e-9)


def test_no_penalty_no_stat():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    _, stats = policy_loss(logp, logp, torch.ones(2), mask, kind="grpo", clip_low=0.2,
                           clip_high=0.28)  # fmt: skip
    assert "kl_ref" not in summarize_stats(stats)
