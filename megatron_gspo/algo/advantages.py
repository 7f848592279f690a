"""Group-relative advantages (GRPO, GSPO) and the Dr. GRPO variant without std division.

For a prompt with G sampled responses and rewards r_1..r_G:

    s_i = r_i / m,  m = max_j |r_j|  (m = 1 when every r_j is 0)
    A_i = (s_i - mean(s)) / (std(s) + eps)      (GRPO / GSPO, scale_by_std=True)
    A_i = (s_i - mean(s)) * m  = r_i - mean(r)  (Dr. GRPO, scale_by_std=False)

Dividing by the group's largest |reward| first changes nothing but eps's scale (std(s) = std(r) /
m; rewards in [-1, 1] with one of them +-1: exactly the unscaled formula, and eps is now relative
to the group's rewards, so the advantages do not depend on the rewards' unit), and keeps every
intermediate within [-2, 2]: the sum for the mean and the squares for the std cannot overflow,
so the advantages are finite for any finite rewards (1e308 included; in fp64 rewards, which
the trainer passes). Dr. GRPO's advantages keep the rewards' scale, so they can only be as finite
as r_i - mean(r) is.

std is the UNBIASED sample std (Bessel's correction, divides by G - 1), as torch.std does by
default and as TRL's and verl's GRPO do. A group of one response has no spread: its std is taken
as 0 (its advantage is 0 either way). A group whose rewards are all equal gets A = 0.

Legend: N = groups (prompts), G = responses per group.
"""

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of `rewards`, normalized within each group; same shape as `rewards`.

    rewards: [N, G] (one row per group), or flat [N * G] with consecutive groups of `group_size`.
    Computed in fp32 (fp64 stays fp64); integer or bool rewards are accepted.
    """
    rewards_NG = _as_groups(rewards, group_size)
    dtype = torch.promote_types(rewards_NG.dtype, torch.float32)
    rewards_NG = rewards_NG.to(dtype)
    G = rewards_NG.shape[1]
    m_N1 = rewards_NG.abs().amax(dim=1, keepdim=True)
    m_N1 = torch.where(m_N1 > 0, m_N1, torch.ones_like(m_N1))
    scaled_NG = rewards_NG / m_N1  # in [-1, 1]
    centered_NG = scaled_NG - scaled_NG.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return (centered_NG * m_N1).reshape(rewards.shape)
    # Unbiased std (divide by G - 1); a group of one has no spread, so use 0 there.
    std_N1 = scaled_NG.std(dim=1, keepdim=True, correction=1 if G > 1 else 0)
    return (centered_NG / (std_N1 + eps)).reshape(rewards.shape)


def _as_groups(rewards: Tensor, group_size: int | None) -> Tensor:
    """View rewards as [N, G]."""
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} but rewards are {tuple(rewards.shape)}")
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N*G] or [N, G], got {tuple(rewards.shape)}")
    if group_size is None or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"flat rewards of length {rewards.numel()} need a group_size dividing it")
    return rewards.reshape(-1, group_size)
