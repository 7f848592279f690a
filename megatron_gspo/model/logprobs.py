"""Token log-probabilities and entropy from vocab-parallel logits, never gathering the vocabulary.

Each TP rank holds logits for a slice [v0, v1) of the (padded) vocabulary. With m the global max
(detached; log-softmax is shift invariant), e = exp(l - m), S = sum_v e_v (all-reduced):

    log p(y) = l_y - m - log S                  l_y all-reduced from the rank that owns y
    H        = m + log S - (sum_v e_v l_v) / S   (= log Z - E_p[l])

The all-reduces go through megatron's `reduce_from_tensor_model_parallel_region` (sum forward,
identity backward), which is the correct gradient because every rank then computes the same
replicated function of the reduced values. Padded vocabulary entries (>= the true vocab) are
excluded. Extra memory: one fp32 copy of the local logits slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    tp_group=None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) the entropy, from local logits [..., V_local].

    `vocab_start` is this rank's first vocabulary id, `vocab_size` the true (unpadded) size.
    Returns fp32 tensors shaped like `targets`.
    """
    logits = logits.float()
    v_local = logits.shape[-1]
    ids = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
    valid = ids < (vocab_size if vocab_size is not None else vocab_start + v_local)
    if not bool(valid.all()):
        logits = logits.masked_fill(~valid, float("-inf"))

    with torch.no_grad():
        m = logits.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - m.unsqueeze(-1)
    e = shifted.exp()
    log_s = _reduce(e.sum(dim=-1), tp_group).log()

    local_t = targets - vocab_start
    owned = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = _reduce(torch.where(owned, picked, torch.zeros_like(picked)), tp_group)
    logprobs = target_shifted - log_s

    entropy = None
    if with_entropy:
        el = torch.where(valid, e * shifted, torch.zeros_like(e)).sum(dim=-1)
        entropy = log_s - _reduce(el, tp_group) / log_s.exp()
    return logprobs, entropy


def tp_vocab_logprobs(logits, targets, vocab_size: int, with_entropy: bool = False):
    """`vocab_parallel_logprobs` over megatron's TP group for this rank."""
    from megatron.core import parallel_state as mpu

    tp_rank = mpu.get_tensor_model_parallel_rank()
    return vocab_parallel_logprobs(
        logits,
        targets,
        vocab_start=tp_rank * logits.shape[-1],
        vocab_size=vocab_size,
        tp_group=mpu.get_tensor_model_parallel_group(),
        with_entropy=with_entropy,
    )
