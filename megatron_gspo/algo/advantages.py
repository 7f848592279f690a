"""Group-relative advantages (GRPO, GSPO) and the Dr. GRPO variant without std division.

For a prompt with G sampled responses and rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)      (GRPO / GSPO, scale_by_std=True)
    A_i =  r_i - mean(r)                        (Dr. GRPO, scale_by_std=False)

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
    centered_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if scale_by_std:
        # Unbiased std (divide by G - 1); a group of one has no spread, so use 0 there.
        std_N1 = rewards_NG.std(dim=1, keepdim=True, correction=1 if G > 1 else 0)
        centered_NG = centered_NG / (std_N1 + eps)
    return centered_NG.reshape(rewards.shape)


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
