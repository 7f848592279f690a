"""Policy-gradient losses: GSPO, GSPO-token, GRPO, SAPO and CISPO, as one function.

The kinds differ in the importance ratio and in the objective made of it (algo/objectives.py:
SAPO's soft gate, CISPO's detached clipped weight); the aggregation and the denominator are
shared:

    GRPO        w_{i,t} = exp(logp_{i,t} - old_{i,t})                              (per token)
    GSPO        s_i     = exp( (1/|y_i|) sum_t m_{i,t} (logp_{i,t} - old_{i,t}) )  (per sequence)
    GSPO-token  s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])   (value s_i, d/dlogp_t = s_i)

    SAPO, CISPO r_{i,t}   = exp(logp_{i,t} - old_{i,t})                        (per token)

    objective o = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A),   loss = -agg(o)
    (SAPO: o = f(ratio) A; CISPO: o = sg(clip(ratio)) A logp; see objectives.py)

For GSPO the per-sequence term o_i is broadcast to the sequence's tokens before aggregation, so
seq-mean-token-mean gives the paper's L = -(1/G) sum_i o_i (arXiv 2507.18071), and GSPO-token with
A_{i,t} = A_i equals GSPO in value and gradient under every aggregation.

Aggregations (sum over the step's sequences i and tokens t, m the mask, B the step's sequences):
    seq-mean-token-mean       (1/B) sum_i (1/|y_i|) sum_t m o          (GRPO, GSPO, SAPO)
    token-mean                (1 / sum_i |y_i|) sum_i sum_t m o        (DAPO, CISPO)
    seq-mean-token-sum        (1/B) sum_i sum_t m o
    seq-mean-token-sum-norm   (1/(B L)) sum_i sum_t m o, L a constant  (Dr. GRPO, arXiv 2503.20783:
                              no 1/|y_i|, so long answers are not favoured when wrong and short
                              ones when right; L = the generation limit, as verl's of that name)

Denominators. The loss of a microbatch is SUM(its objective) / D, D counted once per step over all
microbatches and data-parallel ranks (`loss_scale_denominator`, counted with `loss_denominator`).
Summing microbatch losses (gradient accumulation; SUM, not mean, across data-parallel ranks, or
multiply by the DP size where the gradient all-reduce averages) then gives exactly the full-batch
loss and gradient, whatever the split. Without it the local count is used (a plain mean).

Legend: B = sequences in the microbatch, T = padded tokens per sequence; m = mask, |y_i| = its
number of masked-in tokens. Suffixes name shapes: logprobs_BT is [B, T], advantages_B is [B].
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gspo.algo.config import Agg, LossKind, Mismatch, resolve_agg
from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.algo.loss_stats import ratio_stats, token_stats
from megatron_gspo.algo.mismatch import logprob_abs_diff
from megatron_gspo.algo.objectives import (
    cispo_objective,
    clipped_objective,
    sapo_gradient_weight,
    sapo_objective,
)

TOKEN_RATIO_KINDS = (LossKind.GRPO, LossKind.SAPO, LossKind.CISPO)


def loss_denominator(mask_BT: Tensor, agg: str | None = None, kind: str = LossKind.GSPO) -> Tensor:
    """What this microbatch adds to the step's loss denominator (0-d float32 tensor).

    token-mean: masked-in tokens. seq-mean-*: sequences with at least one token (an empty row is
    padding: it adds nothing to the loss sum, so it must not add to the count either).
    Sum it over microbatches and data-parallel ranks; pass the total as loss_scale_denominator.
    """
    agg = resolve_agg(kind, agg)
    mask_BT = mask_BT.bool()
    if agg == Agg.TOKEN_MEAN:
        return mask_BT.sum().float()
    return mask_BT.any(dim=-1).sum().float()


@dataclass(frozen=True)
class KLPenalty:
    """A KL penalty to a reference policy (the run's starting weights, model/reference.py):
    the objective of every trained token becomes o_{i,t} - coef * KL_{i,t}, with KL_{i,t} the
    per-token estimator `estimator` of KL(pi || pi_ref) (algo/kl.py: k3 is GRPO's), aggregated
    like the rest; for GSPO each sequence's term so gets its tokens' mean KL. The stat
    kl_ref_sum is the estimate summed over the trained tokens (loss_stats: `kl_ref`)."""

    ref_logprobs: Tensor  # [B, T], detached; any value at masked-out tokens (NaN included)
    coef: float
    estimator: str = "k3"


def policy_loss(  # noqa: PLR0913 - the formula's inputs; its options are keyword-only
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kind: LossKind | str,
    clip_low: float,
    clip_high: float,
    agg: Agg | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_weights: Tensor | None = None,
    correction: Mismatch | str | None = None,
    loss_scale_denominator: float | Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    norm_length: int | None = None,
    kl: KLPenalty | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of the given kind; returns (loss, stats).

    logprobs, old_logprobs, mask, rollout_logprobs: [B, T] (mask: bool or 0/1, nonzero = token).
    advantages: [B] (per sequence), or [B, T] for every kind but gspo (GSPO needs [B]).
    agg: an Agg; None = the kind's published default: seq-mean-token-mean for all but cispo
        (for GSPO that is the paper's sequence mean of one clipped term per sequence; for GRPO
        the original token-mean-then-sequence-mean), token-mean for cispo.
    tis_weights: [B, T] or [B], detached, the mismatch weights of `correction` (algo.mismatch;
        0 drops a token): stats of their mean for tis, of the masked for mis, icepop; None both.
    sapo_tau_pos, sapo_tau_neg: SAPO's temperatures; norm_length: the -norm aggregation's L;
    kl: a KL penalty to a reference policy in the objective (`KLPenalty`).
    loss_scale_denominator: the step's global count from `loss_denominator` (sequences for
        seq-mean-*, tokens for token-mean); None = this microbatch's count. log_ratio_clamp:
        log-ratios are clamped to [-c, c] before exp (zero gradient beyond).
    Ratios come from log differences in fp32 (fp64 stays fp64); the loss has that dtype. Masked
    tokens and empty rows contribute nothing; the result is finite for finite inputs. stats:
    detached 0-d sums, counts, min and max (loss_stats: combine_stats, summarize_stats).
    """
    agg = resolve_agg(kind, agg)
    _check_args(logprobs, old_logprobs, mask, clip_low, clip_high, log_ratio_clamp)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask_BT = mask.bool()
    logp_BT = logprobs.to(dtype)
    old_BT = old_logprobs.detach().to(dtype)
    adv_BT = _token_advantages(advantages, mask_BT, kind).to(dtype)
    log_ratio_BT = _masked_log_ratio_BT(logp_BT, old_BT, mask_BT, log_ratio_clamp)
    ratio_BT, report = _ratio_BT(kind, log_ratio_BT, logp_BT, old_BT, mask_BT, log_ratio_clamp)
    taus = (sapo_tau_pos, sapo_tau_neg)
    objective_BT = _objective(kind, ratio_BT, adv_BT, logp_BT, clip_low, clip_high, taus)
    tis_BT = None if tis_weights is None else _per_token(tis_weights, mask_BT).to(dtype)
    objective_BT = torch.where(mask_BT, objective_BT * (1.0 if tis_BT is None else tis_BT), 0.0)
    objective_BT, kl_stats = _with_kl(kl, objective_BT, logp_BT, mask_BT)
    denominator = _denominator(mask_BT, agg, kind, loss_scale_denominator, objective_BT)
    denominator = denominator * _norm_length(agg, norm_length)
    loss = -_objective_sum(objective_BT, mask_BT, agg) / denominator
    low_BT, high_BT = _clipped_BT(kind, ratio_BT.detach(), adv_BT, mask_BT, clip_low, clip_high)
    stats = token_stats(mask_BT, low_BT, high_BT, log_ratio_BT.detach()) | report | kl_stats
    stats |= _gate_stats(kind, ratio_BT, adv_BT, mask_BT, taus)
    return loss, stats | _mismatch_stats(old_BT, rollout_logprobs, tis_BT, mask_BT, correction)


def _with_kl(kl: KLPenalty | None, objective_BT: Tensor, logp_BT: Tensor, mask_BT: Tensor):
    """(the objective less the KL term, the KL stats); unchanged without a penalty. NaN in the
    reference at masked-out tokens is replaced before the estimator, so none reaches a gradient."""
    if kl is None:
        return objective_BT, {}
    ref_BT = torch.where(mask_BT, kl.ref_logprobs.detach().to(logp_BT.dtype), logp_BT.detach())
    kl_BT = torch.where(mask_BT, kl_estimate(logp_BT, ref_BT, kl.estimator), 0.0)
    return objective_BT - kl.coef * kl_BT, {"kl_ref_sum": kl_BT.detach().sum()}


def _gate_stats(kind, ratio_BT, adv_BT, mask_BT, taus) -> dict[str, Tensor]:
    """SAPO: the sum of its gradient weight 4 sigma (1 - sigma) over the tokens."""
    if kind != LossKind.SAPO:
        return {}
    gate_BT = sapo_gradient_weight(ratio_BT, adv_BT, *taus)
    return {"sapo_gate_sum": torch.where(mask_BT, gate_BT, 0.0).sum()}


def _objective(kind, ratio_BT, adv_BT, logp_BT, clip_low, clip_high, taus) -> Tensor:
    """The kind's per-token objective (objectives.py)."""
    if kind == LossKind.SAPO:
        return sapo_objective(ratio_BT, adv_BT, *taus)
    if kind == LossKind.CISPO:
        return cispo_objective(ratio_BT, logp_BT, adv_BT, clip_low, clip_high)
    return clipped_objective(ratio_BT, adv_BT, clip_low, clip_high)


def _clipped_BT(kind, ratio_BT, adv_BT, mask_BT, clip_low, clip_high) -> tuple[Tensor, Tensor]:
    """Tokens whose ratio was clipped, low and high. The clipped kinds: where the clipped branch
    is active (zero gradient). CISPO: where the IS weight was truncated (the token keeps its
    gradient, with the bound as weight). SAPO clips nothing (its gate is reported instead)."""
    if kind == LossKind.SAPO:
        none_BT = torch.zeros_like(mask_BT)
        return none_BT, none_BT
    low_BT, high_BT = ratio_BT < 1.0 - clip_low, ratio_BT > 1.0 + clip_high
    if kind == LossKind.CISPO:
        return mask_BT & low_BT, mask_BT & high_BT
    return mask_BT & (adv_BT < 0) & low_BT, mask_BT & (adv_BT > 0) & high_BT


def _norm_length(agg: Agg, norm_length: int | None) -> float:
    if agg != Agg.SEQ_MEAN_TOKEN_SUM_NORM:
        return 1.0
    if norm_length is None or norm_length < 1:
        raise ValueError(f"{agg} needs norm_length >= 1 (the constant L), got {norm_length}")
    return float(norm_length)


def _ratio_BT(kind, log_ratio_BT, logp_BT, old_BT, mask_BT, clamp) -> tuple[Tensor, dict]:
    """The importance ratio at each token (GRPO: the token's own; GSPO: the sequence's, with
    per-token gradients for gspo_token) and the stats of the log-ratio it comes from."""
    if kind in TOKEN_RATIO_KINDS:
        return torch.exp(log_ratio_BT), ratio_stats(log_ratio_BT.detach(), mask_BT)
    seq_log_ratio_B = _seq_log_ratio_B(logp_BT, old_BT, mask_BT, clamp)
    ratio_BT = _gspo_ratio_BT(seq_log_ratio_B, logp_BT, mask_BT, token_level=kind != LossKind.GSPO)
    return ratio_BT, ratio_stats(seq_log_ratio_B.detach(), mask_BT.any(-1))


def _mismatch_stats(old_BT, rollout_logprobs, tis_BT, mask_BT, correction) -> dict[str, Tensor]:
    """Sums for the train-vs-rollout mismatch and the correction's weights, where they apply:
    the weights' sum for TIS, the tokens and sequences masked for MIS and IcePop (a TIS weight
    is > 0: it masks nothing)."""
    stats = {}
    if rollout_logprobs is not None:
        stats["mismatch_abs_sum"] = logprob_abs_diff(old_BT, rollout_logprobs, mask_BT).sum()
    if tis_BT is not None and correction in (Mismatch.TIS, None):
        stats["tis_weight_sum"] = torch.where(mask_BT, tis_BT, 0.0).sum()
    if tis_BT is not None and correction != Mismatch.TIS:
        dropped_BT = mask_BT & (tis_BT == 0)  # masked by mis / icepop (a TIS weight is > 0)
        stats["mismatch_masked_tokens"] = dropped_BT.sum().to(tis_BT.dtype)
        stats["mismatch_masked_seqs"] = dropped_BT.any(-1).sum().to(tis_BT.dtype)
    return stats


def _masked_log_ratio_BT(logp_BT: Tensor, old_BT: Tensor, mask_BT: Tensor, c: float) -> Tensor:
    """clamp(logp - old) at masked-in tokens, 0 elsewhere (so padding never makes inf or nan)."""
    return torch.where(mask_BT, logp_BT - old_BT, 0.0).clamp(-c, c)


def _seq_log_ratio_B(logp_BT: Tensor, old_BT: Tensor, mask_BT: Tensor, c: float) -> Tensor:
    """clamp( (1/|y_i|) sum_t m (logp - old) ); 0 for an empty row."""
    diff_BT = torch.where(mask_BT, logp_BT - old_BT, 0.0)
    return (diff_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).clamp(-c, c)


def _gspo_ratio_BT(
    seq_log_ratio_B: Tensor, logp_BT: Tensor, mask_BT: Tensor, *, token_level: bool
) -> Tensor:
    """GSPO: s_i broadcast over tokens. GSPO-token: sg[s_i] * exp(logp_t - sg[logp_t])."""
    if not token_level:
        return torch.exp(seq_log_ratio_B).unsqueeze(-1).expand_as(logp_BT)
    token_part_BT = torch.where(mask_BT, logp_BT - logp_BT.detach(), 0.0)  # value 0, grad 1
    return torch.exp(seq_log_ratio_B.detach().unsqueeze(-1) + token_part_BT)


def _objective_sum(objective_BT: Tensor, mask_BT: Tensor, agg: Agg) -> Tensor:
    """The numerator of the aggregation (objective_BT is already zero at masked-out tokens)."""
    if agg == Agg.SEQ_MEAN_TOKEN_MEAN:
        # Average each sequence over its own tokens so every sequence weighs 1 whatever its
        # length; the sum over sequences is then divided by the step's sequence count.
        return (objective_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).sum()
    # token-mean: every token weighs 1; divided by the step's token count (DAPO).
    # seq-mean-token-sum: each sequence's token sum, divided by the step's sequence count (longer
    # sequences weigh more); -norm divides that by a constant length too (Dr. GRPO). Same sum,
    # different denominator.
    return objective_BT.sum()


def _denominator(
    mask_BT: Tensor, agg: Agg, kind: str, given: float | Tensor | None, like: Tensor
) -> Tensor:
    if given is None:
        given = loss_denominator(mask_BT, agg, kind)  # local count: a plain mean
    elif not isinstance(given, Tensor) and given < 0:
        raise ValueError(f"loss_scale_denominator must be >= 0, got {given}")
    d = torch.as_tensor(given, device=like.device).detach().to(like.dtype)
    # Nothing counted means an all-zero numerator: divide by 1 rather than 0.
    return torch.where(d > 0, d, torch.ones_like(d))


def _token_advantages(advantages: Tensor, mask_BT: Tensor, kind: str) -> Tensor:
    """Advantages as [B, T], detached, zero at masked-out tokens."""
    adv = advantages.detach()
    if adv.dim() == 1 and adv.shape[0] == mask_BT.shape[0]:
        adv = adv.unsqueeze(-1).expand_as(mask_BT)
    elif adv.shape != mask_BT.shape:
        raise ValueError(f"advantages {tuple(adv.shape)} must be [B] or [B, T] for {kind}")
    elif kind == LossKind.GSPO:
        raise ValueError("gspo takes one advantage per sequence; use gspo_token for [B, T]")
    return torch.where(mask_BT, adv, 0.0)


def _per_token(weights: Tensor, mask_BT: Tensor) -> Tensor:
    """TIS weights [B] or [B, T] as [B, T], detached."""
    w = weights.detach()
    if w.dim() == 1:
        w = w.unsqueeze(-1)
    if w.shape not in (mask_BT.shape, (mask_BT.shape[0], 1)):
        raise ValueError(f"tis_weights {tuple(weights.shape)} must be [B] or [B, T]")
    return w.expand_as(mask_BT)


def _check_args(
    logprobs: Tensor, old: Tensor, mask: Tensor, clip_low: float, clip_high: float, c: float
) -> None:
    if logprobs.dim() != 2 or logprobs.shape != old.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old.shape)} and mask "
            f"{tuple(mask.shape)} must all be [B, T]"
        )
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if c <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {c}")
