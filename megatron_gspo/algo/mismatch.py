"""Train-vs-rollout mismatch: truncated importance sampling (TIS) and masking.

The rollout engine (SGLang) and the trainer (Megatron) give different log-probs for the same tokens
under the same weights (kernels, precision, MoE routing). The samples come from the rollout policy
while the loss is written for the trainer's old policy, so tokens can be reweighted by

    rho_{i,t} = pi_old(y_{i,t}) / pi_rollout(y_{i,t}) = exp(old_{i,t} - rollout_{i,t}),

where old = log-probs of the old policy recomputed by the trainer, rollout = those SGLang returned.

    token TIS:        w_{i,t} = min(rho_{i,t}, C)
    sequence TIS:     w_i = min(exp(sum_t m_{i,t} log rho_{i,t}), C)           (reduce="sum")
                      w_i = min(exp(sum_t m_{i,t} log rho_{i,t} / |y_i|), C)   (reduce="mean")
    token masking:    w_{i,t} = 1[1/C <= rho_{i,t} <= C]
    sequence masking: w_i = 1[1/C <= rho_i <= C], rho_i the sequence ratio as above

All weights are detached (no gradient), computed in fp32 (fp64 stays fp64) from log differences
clamped to [-log_ratio_clamp, log_ratio_clamp] before exp, and zero at masked tokens ([B, T]
results). Pass them to `policy_loss(..., tis_weights=...)`.

Legend: B = sequences, T = padded tokens; m_{i,t} = mask, |y_i| = sum_t m_{i,t}.
"""

from typing import Literal

import torch
from torch import Tensor

Level = Literal["token", "sequence"]
Mode = Literal["truncate", "mask"]
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
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor, cap: float = 2.0
) -> Tensor:
    """[B, T] 0/1 weights: 1 where 1/C <= exp(old - rollout) <= C (and masked in), else 0."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    keep_BT = (log_rho_BT.abs() <= _log_cap(cap)) & mask_BT.bool()
    return keep_BT.to(log_rho_BT.dtype)


def sequence_mismatch_mask(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    cap: float = 2.0,
    reduce: SeqReduce = "sum",
) -> Tensor:
    """[B] 0/1 weights: 1 where the sequence ratio rho_i lies in [1/C, C], else 0."""
    log_rho_BT = _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    log_rho_B = _log_rho_B(log_rho_BT, mask_BT, reduce)
    return (log_rho_B.abs() <= _log_cap(cap)).to(log_rho_B.dtype)


def mismatch_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    level: Level = "token",
    mode: Mode = "truncate",
    cap: float = 2.0,
    reduce: SeqReduce = "sum",
) -> Tensor:
    """One entry point for the four variants above: [B, T] for level="token", [B] for "sequence"."""
    args = (old_logprobs_BT, rollout_logprobs_BT, mask_BT, cap)
    if (level, mode) == ("token", "truncate"):
        return token_tis_weights(*args)
    if (level, mode) == ("token", "mask"):
        return token_mismatch_mask(*args)
    if (level, mode) == ("sequence", "truncate"):
        return sequence_tis_weights(*args, reduce=reduce)
    if (level, mode) == ("sequence", "mask"):
        return sequence_mismatch_mask(*args, reduce=reduce)
    raise ValueError(f"unknown level/mode {level!r}/{mode!r}")


def logprob_abs_diff(
    old_logprobs_BT: Tensor, rollout_logprobs_BT: Tensor, mask_BT: Tensor
) -> Tensor:
    """[B, T] |old - rollout| at masked-in tokens, 0 elsewhere: the train-vs-inference gap."""
    return _log_rho_BT(old_logprobs_BT, rollout_logprobs_BT, mask_BT).abs()


def _log_cap(cap: float) -> float:
    if cap < 1.0:
        raise ValueError(f"masking needs cap >= 1 so that [1/C, C] is not empty, got {cap}")
    return float(torch.tensor(cap, dtype=torch.float64).log())
