"""DAPO's over-long reward shaping (Yu et al., "DAPO", arXiv 2503.14476, eq. 13).

A response cut at the length limit is not wrong for its content; a flat penalty for it is noise.
DAPO instead adds a soft penalty that ramps linearly over the last `buffer` tokens before the
limit L (rollout.max_new_tokens):

    R_length(y) = 0                                 |y| <= L - buffer
                = ((L - buffer) - |y|) / buffer     L - buffer < |y| <= L
                = -1                                |y| > L

times `penalty` (verl's overlong_penalty_factor; the paper's 1.0), added to the sample's reward.
A response of exactly L tokens gets -penalty. buffer 0 turns it off.
"""

from __future__ import annotations


def overlong_penalty(length: int, limit: int, buffer: int, penalty: float = 1.0) -> float:
    """penalty * R_length(y) of a response of `length` tokens (0.0 when buffer is 0)."""
    if buffer <= 0:
        return 0.0
    if buffer > limit:
        raise ValueError(f"the over-long buffer ({buffer}) exceeds the length limit ({limit})")
    if length > limit:
        return -penalty
    return penalty * min((limit - buffer - length) / buffer, 0.0)


def shape_overlong(
    rewards: list[float], lengths: list[int], limit: int, buffer: int, penalty: float = 1.0
) -> list[float]:
    """Each reward plus its response's over-long penalty."""
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(lengths)} lengths")
    return [r + overlong_penalty(n, limit, buffer, penalty) for r, n in zip(rewards, lengths)]


def overlong_shaped(cfg, samples, rewards: list[float]) -> list[float]:
    """The step's rewards shaped by the run config `cfg` (reward.overlong_*; the limit is
    rollout.max_new_tokens, or env.max_tokens for episodes), `samples` giving the lengths."""
    limit = cfg.length_limit()[0]
    r = cfg.reward
    return shape_overlong(rewards, [len(s.tokens) for s in samples], limit,
                          r.overlong_buffer, r.overlong_penalty)  # fmt: skip
