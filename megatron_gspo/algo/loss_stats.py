"""Statistics of a policy-loss call, kept as sums, counts, minima and maxima.

`policy_loss` returns them as a dict of detached 0-d tensors (no host sync). Sums and counts add
up across microbatches and data-parallel ranks; `ratio_min`/`ratio_max` combine by min/max.
To combine: `combine_stats(per_microbatch)` locally, then an all-reduce per key with the op from
`stat_reduce_op(key)` ("sum", "min" or "max"); `summarize_stats` turns the result into floats.

Raw keys (always present):
    num_tokens, num_seqs              masked-in tokens; sequences with at least one token
    clipped_tokens_low/high           tokens whose clipped branch is active: ratio < 1 - eps_low with
                                      A < 0 (low) or ratio > 1 + eps_high with A > 0 (high); zero
                                      gradient there. For GSPO a clipped sequence clips all its tokens.
                                      CISPO: tokens whose IS weight was truncated (whatever A; they
                                      keep a gradient). SAPO: none (its gate is sapo_gate_sum).
    clipped_seqs                      sequences with at least one clipped token
    ratio_count                       ratios reported: sequences for gspo / gspo_token, tokens for
                                      grpo, sapo and cispo
    ratio_minus_one_sum, ratio_minus_one_sq_sum
                                      sums of (ratio - 1) and its square (shifted so the std survives
                                      GSPO's ratios of 1 +- 1e-4 in fp32)
    ratio_min, ratio_max              +inf / -inf when nothing was counted
    kl_old_k3_sum                     sum over tokens of k3 = rho - 1 - log rho, rho = pi / pi_old:
                                      estimates KL(pi_old || pi) on samples from pi_old
Optional keys:
    mismatch_abs_sum                  sum over tokens of |old - rollout| (when rollout_logprobs given)
    tis_weight_sum                    sum over tokens of the mismatch weight (when tis_weights given)
    mismatch_masked_tokens, mismatch_masked_seqs
                                      tokens whose mismatch weight is 0 (dropped by mis / icepop),
                                      sequences with at least one (when tis_weights given)
    sapo_gate_sum                     sum over tokens of SAPO's gradient weight 4 sigma (1 - sigma)
    log_ratio_{same,moved}_{count,sum,sq_sum}
                                      count, sum and sum of squares of the token log-ratio
                                      log pi - log pi_old over the loss tokens whose routing did
                                      not / did move (`log_ratio_split_stats`, float64)
"""

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import Tensor

ReduceOp = Literal["sum", "min", "max"]
_REDUCE_OPS: dict[str, ReduceOp] = {"ratio_min": "min", "ratio_max": "max"}


def stat_reduce_op(key: str) -> ReduceOp:
    """How to combine `key` across microbatches or ranks: "sum", "min" or "max"."""
    return _REDUCE_OPS.get(key, "sum")


def token_stats(
    mask_BT: Tensor,
    clipped_low_BT: Tensor,
    clipped_high_BT: Tensor,
    log_rho_BT: Tensor,
) -> dict[str, Tensor]:
    """Counts and clip counts over tokens, and the k3 KL to the old policy.

    log_rho_BT = clamped log pi - log pi_old, zero at masked-out tokens.
    """
    clipped_BT = clipped_low_BT | clipped_high_BT
    dtype = log_rho_BT.dtype
    return {
        "num_tokens": mask_BT.sum().to(dtype),
        "num_seqs": mask_BT.any(-1).sum().to(dtype),
        "clipped_tokens_low": clipped_low_BT.sum().to(dtype),
        "clipped_tokens_high": clipped_high_BT.sum().to(dtype),
        "clipped_seqs": clipped_BT.any(-1).sum().to(dtype),
        # k3 with rho = pi / pi_old on samples from pi_old: (rho - 1) - log rho >= 0.
        "kl_old_k3_sum": (torch.expm1(log_rho_BT) - log_rho_BT).sum(),
    }


def ratio_stats(log_ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Sums, min and max of exp(log_ratio) over the entries where `valid` is true (any shape)."""
    dev = torch.where(valid, torch.expm1(log_ratio), 0.0)  # ratio - 1, exact near 1
    ratio = dev + 1.0
    inf = torch.tensor(math.inf, dtype=ratio.dtype, device=ratio.device)
    return {
        "ratio_count": valid.sum().to(ratio.dtype),
        "ratio_minus_one_sum": dev.sum(),
        "ratio_minus_one_sq_sum": dev.square().sum(),
        "ratio_min": torch.where(valid, ratio, inf).min() if ratio.numel() else inf,
        "ratio_max": torch.where(valid, ratio, -inf).max() if ratio.numel() else -inf,
    }


def log_ratio_split_stats(log_ratio_BT: Tensor, mask_BT: Tensor, moved_BT: Tensor) -> dict:
    """The token log-ratio's sums over the loss tokens (mask > 0), split by `moved_BT` (bool:
    the routing that produced the token moved since the old log-probs). In float64: the
    log-ratios are ~1e-3 and their squares are summed over many tokens."""
    lr = log_ratio_BT.double()
    loss = mask_BT > 0
    out = {}
    for name, sel in (("same", loss & ~moved_BT), ("moved", loss & moved_BT)):
        x = torch.where(sel, lr, 0.0)
        out[f"log_ratio_{name}_count"] = sel.sum().double()
        out[f"log_ratio_{name}_sum"] = x.sum()
        out[f"log_ratio_{name}_sq_sum"] = x.square().sum()
    return out


def combine_stats(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the stats of several microbatches (sum, or min/max for the extrema)."""
    out: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value.detach().clone()
                continue
            op = stat_reduce_op(key)
            combine = torch.minimum if op == "min" else torch.maximum if op == "max" else torch.add
            out[key] = combine(out[key], value.detach())
    return out


def summarize_stats(stats: Mapping[str, Tensor]) -> dict[str, float]:
    """Means and fractions as python floats (0.0 where nothing was counted).

    clip_frac_tokens[_low|_high] = clipped tokens / tokens; clip_frac_seqs = clipped seqs / seqs;
    ratio_mean/std (population std)/min/max; approx_kl_old = mean k3 over tokens;
    logprob_mismatch_abs = mean |old - rollout| over tokens; tis_weight_mean over tokens;
    mismatch_masked_frac_tokens / _seqs = dropped tokens / tokens, sequences with one / sequences;
    sapo_gate_mean over tokens; kl_ref = mean KL(pi || pi_ref) estimate over tokens.
    """
    s = {key: float(value) for key, value in stats.items()}
    tokens, seqs, n = s["num_tokens"], s["num_seqs"], s["ratio_count"]
    dev_mean = _div(s["ratio_minus_one_sum"], n)
    out = {
        "clip_frac_tokens": _div(s["clipped_tokens_low"] + s["clipped_tokens_high"], tokens),
        "clip_frac_tokens_low": _div(s["clipped_tokens_low"], tokens),
        "clip_frac_tokens_high": _div(s["clipped_tokens_high"], tokens),
        "clip_frac_seqs": _div(s["clipped_seqs"], seqs),
        "ratio_mean": 1.0 + dev_mean if n else 0.0,
        "ratio_std": math.sqrt(max(_div(s["ratio_minus_one_sq_sum"], n) - dev_mean**2, 0.0)),
        "ratio_min": s["ratio_min"] if n else 0.0,
        "ratio_max": s["ratio_max"] if n else 0.0,
        "approx_kl_old": _div(s["kl_old_k3_sum"], tokens),
    }
    if "mismatch_abs_sum" in s:
        out["logprob_mismatch_abs"] = _div(s["mismatch_abs_sum"], tokens)
    if "tis_weight_sum" in s:
        out["tis_weight_mean"] = _div(s["tis_weight_sum"], tokens)
    if "mismatch_masked_tokens" in s:
        out["mismatch_masked_frac_tokens"] = _div(s["mismatch_masked_tokens"], tokens)
        out["mismatch_masked_frac_seqs"] = _div(s["mismatch_masked_seqs"], seqs)
    if "sapo_gate_sum" in s:
        out["sapo_gate_mean"] = _div(s["sapo_gate_sum"], tokens)
    if "kl_ref_sum" in s:
        out["kl_ref"] = _div(s["kl_ref_sum"], tokens)
    out.update(_split_summary(s))
    return out


def _split_summary(s: dict[str, float]) -> dict[str, float]:
    """log_ratio_std_{same,moved} (population std; absent where the group has fewer than 2
    tokens: the std of one token is 0 whatever its log-ratio, and a step's mean over minibatches
    would read that 0 as "no spread") and tokens_moved_fraction = moved / (same + moved), from
    the log_ratio_* sums."""
    if "log_ratio_same_count" not in s:
        return {}
    n_same, n_moved = s["log_ratio_same_count"], s["log_ratio_moved_count"]
    out = {"tokens_moved_fraction": _div(n_moved, n_same + n_moved)} if n_same + n_moved else {}
    for name, n in (("same", n_same), ("moved", n_moved)):
        if n >= 2:
            mean = s[f"log_ratio_{name}_sum"] / n
            var = s[f"log_ratio_{name}_sq_sum"] / n - mean**2
            out[f"log_ratio_std_{name}"] = math.sqrt(max(var, 0.0))
    return out


def _div(num: float, den: float) -> float:
    return num / den if den else 0.0
