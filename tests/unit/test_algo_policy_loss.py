"""policy_loss against formulas written out here, independently of the implementation.

Legend: B = sequences, T = padded tokens.
"""

import math

import pytest
import torch

from megatron_gspo.algo.config import AGGS, KINDS
from megatron_gspo.algo.loss_stats import combine_stats, summarize_stats
from megatron_gspo.algo.policy_loss import loss_denominator, policy_loss

pytestmark = pytest.mark.unit

EPS_LOW, EPS_HIGH = 0.1, 0.15
NORM_L = 6  # seq-mean-token-sum-norm's constant (not the padded width T = 7)
TAU_POS, TAU_NEG = 1.0, 1.05  # SAPO's (the paper's defaults, policy_loss's)


def _batch(seed: int = 0, B: int = 8, T: int = 7, spread: float = 0.3):
    """Random float64 batch; masks of varying lengths (one row empty, one with gaps)."""
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_BT = old_BT + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [T, 1, 3, 0, 5, 2, T - 1, 4][:B]
    mask_BT = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    mask_BT[0, 2] = False  # a hole inside a sequence
    adv_B = torch.randn(B, generator=g, dtype=torch.float64)
    adv_BT = torch.randn(B, T, generator=g, dtype=torch.float64)
    tis_BT = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp_BT, old_BT, mask_BT, adv_B, adv_BT, tis_BT


def _reference_loss(logp_BT, old_BT, adv, mask_BT, kind, agg, tis_BT=None):
    """The published objectives, one sequence at a time."""
    total, n_tokens, n_seqs = 0.0, 0, 0
    for i in range(logp_BT.shape[0]):
        idx = mask_BT[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        lp, old = logp_BT[i, idx], old_BT[i, idx]
        a = adv[i] if adv.dim() == 1 else adv[i, idx]
        w = torch.ones(len(idx), dtype=lp.dtype) if tis_BT is None else tis_BT[i, idx]
        n_tokens, n_seqs = n_tokens + len(idx), n_seqs + 1
        if kind == "gspo":
            s = torch.exp((lp - old).mean())  # (pi/pi_old)^(1/|y|)
            o = torch.min(s * a, torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            per_token = o * w  # the sequence term, once per token
        elif kind == "sapo":  # arXiv 2511.20347: f(r) = sigmoid(tau (r - 1)) 4 / tau, times A
            r = torch.exp(lp - old)
            tau = torch.where(torch.as_tensor(a) > 0, TAU_POS, TAU_NEG)
            per_token = torch.sigmoid(tau * (r - 1)) * 4 / tau * a * w
        elif kind == "cispo":  # arXiv 2506.13585: sg(clip(r)) A log pi
            r = torch.exp(lp - old).detach()
            per_token = torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a * lp * w
        else:
            if kind == "grpo":
                r = torch.exp(lp - old)
            else:  # gspo_token: sg[s_i] * pi_t / sg[pi_t]
                r = torch.exp((lp - old).mean()).detach() * torch.exp(lp - lp.detach())
            per_token = torch.min(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a) * w
        total = total + (per_token.mean() if agg == "seq-mean-token-mean" else per_token.sum())
    if agg == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant length L, not |y_i|
        return -total / (n_seqs * NORM_L)
    return -total / (n_tokens if agg == "token-mean" else n_seqs)


def _loss_and_grad(logp_BT, *args, **kwargs):
    logp_BT = logp_BT.clone().requires_grad_()
    kwargs.setdefault("norm_length", NORM_L)
    loss, stats = policy_loss(logp_BT, *args, clip_low=EPS_LOW, clip_high=EPS_HIGH, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp_BT)
    return loss, grad, stats


# GSPO takes one advantage per sequence; the others also take one per token.
ADV_CASES = [
    ("gspo", False),
    ("gspo_token", False),
    ("gspo_token", True),
    ("grpo", False),
    ("grpo", True),
    ("sapo", False),
    ("sapo", True),
    ("cispo", False),
    ("cispo", True),
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(("kind", "per_token_adv"), ADV_CASES)
@pytest.mark.parametrize("with_tis", [False, True])
def test_gradient_matches_formula(kind, agg, per_token_adv, with_tis):
    logp_BT, old_BT, mask_BT, adv_B, adv_BT, tis_BT = _batch()
    adv = adv_BT if per_token_adv else adv_B
    tis = tis_BT if with_tis else None
    loss, grad, stats = _loss_and_grad(
        logp_BT, old_BT, adv, mask_BT, kind=kind, agg=agg, tis_weights=tis
    )
    ref_logp = logp_BT.clone().requires_grad_()
    ref = _reference_loss(ref_logp, old_BT, adv, mask_BT, kind, agg, tis)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # The inputs exercise both the clipped and the unclipped branch (SAPO: its gate's decay).
    if kind == "sapo":
        assert 0.5 < summarize_stats(stats)["sapo_gate_mean"] < 1
    else:
        assert 0 < summarize_stats(stats)["clip_frac_tokens"] < 1


def test_gspo_rejects_per_token_advantages():
    logp_BT, old_BT, mask_BT, _, adv_BT, _ = _batch()
    with pytest.raises(ValueError, match="gspo_token"):
        policy_loss(logp_BT, old_BT, adv_BT, mask_BT, kind="gspo", clip_low=0.1, clip_high=0.1)


@pytest.mark.parametrize("agg", [None, *AGGS])
def test_gspo_token_equals_gspo_with_sequence_advantages(agg):
    logp_BT, old_BT, mask_BT, adv_B, _, _ = _batch(seed=1)
    adv_BT = adv_B.unsqueeze(-1).expand_as(logp_BT).clone()
    loss_s, grad_s, stats_s = _loss_and_grad(logp_BT, old_BT, adv_B, mask_BT, kind="gspo", agg=agg)
    loss_t, grad_t, stats_t = _loss_and_grad(
        logp_BT, old_BT, adv_BT, mask_BT, kind="gspo_token", agg=agg
    )
    assert torch.allclose(loss_s, loss_t, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad_s, grad_t, rtol=1e-12, atol=1e-14)
    assert summarize_stats(stats_s) == pytest.approx(summarize_stats(stats_t))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", KINDS)
def test_ratio_one_is_reinforce_with_group_advantages(kind, agg):
    """At logp == old every ratio is 1, nothing clips: grad = -A_i m_{i,t} / denominator."""
    _, old_BT, mask_BT, _, _, _ = _batch(seed=2)
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    groups = rewards_B.view(2, 4)
    adv_B = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(
        -1
    )
    _, grad, _ = _loss_and_grad(old_BT, old_BT, adv_B, mask_BT, kind=kind, agg=agg)
    m = mask_BT.double()
    lengths_B1 = m.sum(-1, keepdim=True).clamp(min=1)
    n_seqs = float((m.sum(-1) > 0).sum())
    per_token_weight = {
        "seq-mean-token-mean": 1 / (lengths_B1 * n_seqs),
        "token-mean": 1 / m.sum(),
        "seq-mean-token-sum": 1 / n_seqs,
        "seq-mean-token-sum-norm": 1 / (n_seqs * NORM_L),
    }[agg]
    expected = -adv_B.unsqueeze(-1) * m * per_token_weight
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", KINDS)
def test_microbatch_split_matches_full_batch(kind, agg):
    logp_BT, old_BT, mask_BT, adv_B, _, tis_BT = _batch(seed=3)
    kw = dict(kind=kind, agg=agg, tis_weights=tis_BT, rollout_logprobs=old_BT + 0.01,
              norm_length=NORM_L)  # fmt: skip
    full_loss, full_grad, full_stats = _loss_and_grad(logp_BT, old_BT, adv_B, mask_BT, **kw)

    chunks = [slice(0, 3), slice(3, 4), slice(4, 8)]  # the middle one is the empty row
    denominator = sum(float(loss_denominator(mask_BT[c], agg, kind)) for c in chunks)
    logp = logp_BT.clone().requires_grad_()
    losses, stats = [], []
    for c in chunks:
        kw["tis_weights"], kw["rollout_logprobs"] = tis_BT[c], old_BT[c] + 0.01
        loss, st = policy_loss(
            logp[c],
            old_BT[c],
            adv_B[c],
            mask_BT[c],
            clip_low=EPS_LOW,
            clip_high=EPS_HIGH,
            loss_scale_denominator=denominator,
            **kw,
        )
        losses.append(loss)
        stats.append(st)
    total = torch.stack(losses).sum()
    (grad,) = torch.autograd.grad(total, logp)
    assert torch.allclose(total, full_loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad, full_grad, rtol=1e-12, atol=1e-14)
    assert summarize_stats(combine_stats(stats)) == pytest.approx(summarize_stats(full_stats))


def test_loss_denominator_counts():
    mask_BT = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    assert loss_denominator(mask_BT, "token-mean", "grpo") == 4
    assert loss_denominator(mask_BT, "seq-mean-token-mean", "grpo") == 2
    assert loss_denominator(mask_BT, "seq-mean-token-sum", "gspo") == 2
    assert loss_denominator(mask_BT, None, "gspo") == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kind", KINDS)
def test_extreme_inputs_stay_finite(kind, agg, dtype):
    g = torch.Generator().manual_seed(4)
    B, T = 4, 5
    sign_BT = torch.randint(0, 2, (B, T), generator=g) * 2 - 1
    old_BT = torch.full((B, T), -5.0)
    logp_BT = (old_BT + 1e4 * sign_BT).to(dtype)
    mask_BT = torch.ones(B, T, dtype=torch.bool)
    mask_BT[1] = False  # a fully masked row
    adv_B = torch.tensor([1e3, -1.0, -1e3, 0.0])
    empty_BT = torch.zeros(B, T, dtype=torch.bool)
    for mask in (mask_BT, empty_BT):
        logp = logp_BT.clone().requires_grad_()
        loss, stats = policy_loss(
            logp,
            old_BT.to(dtype),
            adv_B,
            mask,
            kind=kind,
            agg=agg,
            clip_low=0.2,
            clip_high=0.28,
            norm_length=NORM_L,
            rollout_logprobs=old_BT - 1e4,
            tis_weights=torch.full((B,), 2.0),
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(math.isfinite(v) for v in summarize_stats(stats).values())
    assert loss.item() == 0.0 and not logp.grad.any()  # the all-masked batch


@pytest.mark.parametrize("kind", KINDS)
def test_padding_with_inf_logprobs_is_ignored(kind):
    logp_BT, old_BT, mask_BT, adv_B, _, _ = _batch(seed=5)
    logp_pad = torch.where(mask_BT, logp_BT, -math.inf)
    old_pad = torch.where(mask_BT, old_BT, -math.inf)
    loss_a, grad_a, _ = _loss_and_grad(logp_BT, old_BT, adv_B, mask_BT, kind=kind)
    loss_b, grad_b, _ = _loss_and_grad(logp_pad, old_pad, adv_B, mask_BT, kind=kind)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)


def test_sequence_tis_weights_equal_broadcast_token_weights():
    logp_BT, old_BT, mask_BT, adv_B, _, _ = _batch(seed=6)
    w_B = torch.linspace(0.5, 2.0, logp_BT.shape[0], dtype=torch.float64)
    w_BT = w_B.unsqueeze(-1).expand_as(logp_BT)
    a = _loss_and_grad(logp_BT, old_BT, adv_B, mask_BT, kind="grpo", tis_weights=w_B)
    b = _loss_and_grad(logp_BT, old_BT, adv_B, mask_BT, kind="grpo", tis_weights=w_BT)
    assert torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_low_precision_inputs_give_fp32_loss():
    logp_BT, old_BT, mask_BT, adv_B, _, _ = _batch(seed=7)
    loss, _ = policy_loss(
        logp_BT.bfloat16(),
        old_BT.bfloat16(),
        adv_B,
        mask_BT,
        kind="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
    )
    assert loss.dtype == torch.float32
