"""The per-token objectives of the policy losses, given the importance ratio r and advantage A
(to be maximized; `policy_loss` negates and aggregates them).

    clipped (GRPO, GSPO, GSPO-token; PPO's):
        o = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

    SAPO (Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347), token ratio r_{i,t}:
        o = f(r) A,   f(r) = sigma(tau (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
      d o / d log pi = 4 sigma (1 - sigma) * r A: at r = 1 exactly the policy gradient r A, and
      a smooth decay (instead of a hard zero) as r leaves 1. tau_neg > tau_pos damps negative
      advantages faster, as the paper argues (their updates spread to many unsampled tokens).
      The paper's defaults: tau_pos = 1.0, tau_neg = 1.05.

    CISPO (MiniMax-M1, arXiv 2506.13585), token ratio r_{i,t}:
        o = sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi(y_t)
      d o / d log pi = clip(r) A: the clipped ratio is a constant weight, so every token keeps a
      gradient (where PPO's clip zeroes it). The paper sets no lower bound (eps_low = 1) and
      aggregates with the token mean (1 / sum_i |o_i|).

Legend: B = sequences, T = padded tokens; all tensors [B, T].
"""

import torch
from torch import Tensor


def clipped_objective(ratio_BT: Tensor, adv_BT: Tensor, clip_low: float, clip_high: float):
    """o = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)


def sapo_gate(ratio_BT: Tensor, adv_BT: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """f(r) = sigma(tau (r - 1)) * 4 / tau, tau by the sign of A."""
    tau_BT = torch.where(adv_BT > 0, tau_pos, tau_neg).to(ratio_BT.dtype)
    return torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * 4.0 / tau_BT


def sapo_objective(ratio_BT: Tensor, adv_BT: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """o = f(r) A (SAPO)."""
    return sapo_gate(ratio_BT, adv_BT, tau_pos, tau_neg) * adv_BT


def sapo_gradient_weight(ratio_BT: Tensor, adv_BT: Tensor, tau_pos: float, tau_neg: float):
    """4 sigma (1 - sigma): what SAPO's gate leaves of the policy gradient r A (1 at r = 1)."""
    tau_BT = torch.where(adv_BT > 0, tau_pos, tau_neg).to(ratio_BT.dtype)
    s = torch.sigmoid(tau_BT * (ratio_BT.detach() - 1.0))
    return 4.0 * s * (1.0 - s)


def cispo_objective(
    ratio_BT: Tensor, logp_BT: Tensor, adv_BT: Tensor, clip_low: float, clip_high: float
) -> Tensor:
    """o = sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi (CISPO)."""
    weight_BT = ratio_BT.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    return weight_BT * adv_BT * logp_BT
