"""Train-vs-rollout mismatch: truncated importance sampling (TIS), masked IS (MIS) and IcePop.

The rollout engine (SGLang) and the trainer (Megatron) give different log-probs for the same tokens
under the same weights (kernels, precision, MoE routing). The samples come from the rollout policy
while the loss is written for the trainer's old policy, so tokens can be reweighted by

    rho_{i,t} = pi_old(y_{i,t}) / pi_rollout(y_{i,t}) = exp(old_{i,t} - rollout_{i,t}),

where old = log-probs of the old policy recomputed by the trainer, rollout = those SGLang returned.
The sequence ratio is rho_i = exp(sum_t m log rho_{i,t}) (reduce="sum", the likelihood ratio) or
exp(sum_t m log rho_{i,t} / |y_i|) (reduce="mean", its geometric mean per token).

    token TIS:        w_{i,t} = min(rho_{i,t}, C)
    sequence TIS:     w_i = min(rho_i, C)
    token mask:       1[lo <= rho_{i,t} <= hi]            (lo, hi = 1/C, C unless given)
    sequence mask:    1[lo <= rho_i <= hi]
    token MIS:        w_{i,t} = rho_{i,t} 1[lo <= rho_{i,t} <= hi]
    sequence MIS:     w_i = rho_i 1[lo <= rho_i <= hi]
    IcePop:           w_{i,t} = rho_{i,t} 1[1/k <= rho_{i,t} <= k]

MIS (masked importance sampling; Liu, Li et al. 2025, "When speed kills stability: demystifying
RL collapse from the training-inference mismatch") keeps the IS weight inside the band and drops
the token or the whole sequence outside it, where TIS would keep it at the cap: a token (sequence)
that far off is noise rather than signal. IcePop (Ling team, Ring-1T, arXiv 2510.18855) is the
token-level one with the band [alpha, beta]; here [1/k, k]. `correction_weights` decides which
applies from the loss config: the one place a step asks.

All weights are detached (no gradient), computed in fp32 (fp64 stays fp64) from log differences
clamped to [-log_ratio_clamp, log_ratio_clamp] before exp, and zero at masked tokens ([B, T]
results). Pass them to `policy_loss(..., tis_weights=...)`, which counts the zeros (the share
masked) among its stats.

Legend: B = sequences, T = padded tokens; m_{i,t} = mask, |y_i| = sum_t m_{i,t}.
"""

import math
from typing import Literal

import torch
from torch import Tensor

from megatron_gspo.algo.config import AlgoConfig, Level, Mismatch, TisReduce

SeqReduce = Literal["sum", "mean"]


def _log_rho_BT(old_BT: Tensor, rollout_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log rho = old - rollout at masked-in tokens, 0 elsewhere; detached, fp32 or wider."""
    dtype = torch.promote_types(old_BT.dtype, torch.float32)
    diff_BT = old_BT.detach().to(dtype) - rollout_BT.detach().to(dtype)
    return torch.where(mask_BT.bool(), diff_BT, 0.0)


def _log_rho_B(log_rho_BT: Tensor, mask_BT: Tensor, reduce: SeqReduce) -> Tensor:
    """Sequence log-ratio: sum over tokens (likelihood ratio) or mean (geometric mean)."""
    if reduce == "sum":
        return log_rho_BT.sum(-1)
    if reduce == "mean":
        return log_rho_BT.sum(-1) / mask_BT.bool().sum(-1).clamp(min=1)
    raise ValueError(f"unknown reduce {reduce!r}; expected sum or mean")


def token_tis_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    cap: float = 2.0,
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """[B, T] weights w_{i,t} = min(exp(old - rollout), C) * m_{i,t}."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    w_BT = log_rho_BT.clamp(-log_ratio_clamp, log_ratio_clamp).exp().clamp(max=cap)
    return w_BT * mask_BT.bool()


def sequence_tis_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    cap: float = 2.0,
    reduce: SeqReduce = "sum",
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """[B] weights w_i = min(exp(sum_t or mean_t of m (old - rollout)), C)."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    log_rho_B = _log_rho_B(log_rho_BT, mask_BT, reduce)
    return log_rho_B.clamp(-log_ratio_clamp, log_ratio_clamp).exp().clamp(max=cap)


def token_mismatch_mask(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    cap: float = 2.0,
    *,
    low: float | None = None,
    high: float | None = None,
) -> Tensor:
    """[B, T] 0/1 weights: 1 where low <= exp(old - rollout) <= high (default [1/C, C]) and
    masked in, else 0."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    keep_BT = _in_band(log_rho_BT, cap, low, high) & mask_BT.bool()
    return keep_BT.to(log_rho_BT.dtype)


def sequence_mismatch_mask(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    cap: float = 2.0,
    reduce: SeqReduce = "sum",
    *,
    low: float | None = None,
    high: float | None = None,
) -> Tensor:
    """[B] 0/1 weights: 1 where the sequence ratio rho_i lies in [low, high] (default [1/C, C])."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    log_rho_B = _log_rho_B(log_rho_BT, mask_BT, reduce)
    return _in_band(log_rho_B, cap, low, high).to(log_rho_B.dtype)


def token_mis_weights(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, low: float, high: float
) -> Tensor:
    """[B, T] masked IS weights rho_{i,t} 1[low <= rho_{i,t} <= high] (IcePop: low = 1/k)."""
    rho_BT = token_tis_weights(old_logprobs_BT, rollout_logprobs_BT, mask_BT, cap=float("inf"))
    band = token_mismatch_mask(old_logprobs_BT, rollout_logprobs_BT, mask_BT, low=low, high=high)
    return rho_BT * band


def sequence_mis_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    low: float,
    high: float,
    reduce: SeqReduce = "sum",
) -> Tensor:
    """[B] masked IS weights rho_i 1[low <= rho_i <= high]."""
    args = (old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    rho_B = sequence_tis_weights(*args, cap=float("inf"), reduce=reduce)
    return rho_B * sequence_mismatch_mask(*args, reduce=reduce, low=low, high=high)


def correction_weights(
    cfg: AlgoConfig, old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor | None, mask_BT: Tensor
) -> Tensor | None:
    """The weights of the config's mismatch correction (None: no correction): [B, T] for a
    token-level one, [B] for a sequence-level one. The one place that decides it."""
    kind, level = cfg.correction
    if kind == Mismatch.NONE:
        return None
    if rollout_logprobs_BT is None:
        raise ValueError(f"mismatch correction {kind} needs the batch's rollout log-probs")
    args = (old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    reduce: SeqReduce = "mean" if cfg.tis_reduce == TisReduce.MEAN else "sum"
    if kind == Mismatch.ICEPOP:
        return token_mis_weights(*args, 1.0 / cfg.icepop_k, cfg.icepop_k)
    if kind == Mismatch.MIS and level == Level.TOKEN:
        return token_mis_weights(*args, cfg.mis_low, cfg.mis_high)
    if kind == Mismatch.MIS:
        return sequence_mis_weights(*args, cfg.mis_low, cfg.mis_high, reduce)
    if level == Level.TOKEN:
        return token_tis_weights(*args, cap=cfg.tis_cap)
    return sequence_tis_weights(*args, cap=cfg.tis_cap, reduce=reduce)


def logprob_abs_diff(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor
) -> Tensor:
    """[B, T] |old - rollout| at masked-in tokens, 0 elsewhere: the train-vs-inference gap."""
    return _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT).abs()


def _in_band(log_rho: Tensor, cap: float, low: float | None, high: float | None) -> Tensor:
    """low <= exp(log_rho) <= high, compared in log space; [1/cap, cap] where not given."""
    if low is None and high is None and cap < 1.0:
        raise ValueError(f"masking needs cap >= 1 so that [1/C, C] is not empty, got {cap}")
    lo = 1.0 / cap if low is None else low
    hi = cap if high is None else high
    if not 0.0 <= lo <= hi:
        raise ValueError(f"masking needs 0 <= low <= high, got [{lo}, {hi}]")
    log_lo = -math.inf if lo == 0.0 else math.log(lo)
    return (log_rho >= log_lo) & (log_rho <= math.log(hi))
