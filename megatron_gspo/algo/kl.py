"""Per-token KL estimators to a reference policy (J. Schulman, "Approximating KL Divergence", 2020).

For a token y sampled from pi (the policy that produced the sample) and

    log r = log pi_ref(y) - log pi(y),

each estimator below has expectation KL(pi || pi_ref) (k2 only approximately):

    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0 (the KL term of GRPO)

Legend: B = sequences, T = padded tokens. Inputs are [B, T] (any shape works, elementwise); the
result is per token and is NOT masked: multiply by the mask and aggregate like the loss.
Computed in fp32 (fp64 stays fp64).
"""

from typing import Literal

import torch
from torch import Tensor

from megatron_gspo.algo.config import KLEstimator

KLKind = Literal["k1", "k2", "k3"]


def _log_r(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """log r = log pi_ref - log pi, in fp32 or wider."""
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)
    return ref_logprobs_BT.to(dtype) - logprobs_BT.to(dtype)


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k1 = -log r = log pi(y) - log pi_ref(y)."""
    return -_log_r(logprobs_BT, ref_logprobs_BT)


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2 with log r = log pi_ref(y) - log pi(y)."""
    return 0.5 * _log_r(logprobs_BT, ref_logprobs_BT).square()


def kl_k3(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    *,
    log_ratio_clamp: float = 20.0,
    max_value: float | None = 10.0,
) -> Tensor:
    """k3 = exp(log r) - 1 - log r with log r = log pi_ref(y) - log pi(y).

    Stability: log r is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp, and k3 itself
    to [0, max_value] when max_value is set (as verl's "low_var_kl"); outside the clamps the
    gradient is zero.
    """
    log_r = _log_r(logprobs_BT, ref_logprobs_BT).clamp(-log_ratio_clamp, log_ratio_clamp)
    k3 = torch.expm1(log_r) - log_r
    return k3 if max_value is None else k3.clamp(0.0, max_value)


def kl_estimate(
    logprobs_BT: Tensor, ref_logprobs_BT: Tensor, kind: KLKind | KLEstimator | str = "k3"
) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate of the named kind ("k1", "k2" or "k3")."""
    try:
        estimator = _ESTIMATORS[KLEstimator(kind)]
    except ValueError:
        raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3") from None
    return estimator(logprobs_BT, ref_logprobs_BT)


_ESTIMATORS = {KLEstimator.K1: kl_k1, KLEstimator.K2: kl_k2, KLEstimator.K3: kl_k3}
