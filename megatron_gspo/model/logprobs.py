"""Token log-probabilities and entropy from vocab-parallel logits, never gathering the vocabulary.

Each TP rank holds logits for a slice [v0, v1) of the (padded) vocabulary. With m the global max
(log-softmax is shift invariant, so m carries no gradient), e = exp(l - m), S = sum_v e_v
(all-reduced), p = e / S:

    log p(y) = l_y - m - log S                  l_y all-reduced from the rank that owns y
    H        = m + log S - (sum_v e_v l_v) / S   (= log Z - E_p[l])

    d log p(y) / d l_v = 1[v = y] - p_v
    d H / d l_v        = p_v (E_p[l - m] - (l_v - m))      (= -p_v (log p_v + H))

Deviation from a plain autograd graph, on purpose: the vocabulary is the largest dimension in the
step (151,936 for Qwen3), and autograd through `exp(logits - m)` keeps two to four fp32
full-vocabulary copies alive (shifted logits, exp, their product for the entropy, the gradients).
`_ChunkedLogprobs` instead walks the tokens in chunks of about `_chunk_elements` logits, saves
only the logits (which the caller holds anyway) and three numbers per token, and recomputes the
softmax of each chunk in backward. Beyond the logits the only full-vocabulary tensor is their
gradient. Forward values equal the plain graph's (same ops per row); gradients agree to rounding.

TP: the max is all-reduced (MAX) before the sums, then S, l_y and sum e l are all-reduced (SUM) in
one call. Backward needs no communication: every rank computes the same replicated function of the
reduced values, so the gradient of its local logits uses the reduced S and E_p[l] directly (what
megatron's `reduce_from_tensor_model_parallel_region`, identity in backward, gives autograd).
Padded vocabulary entries (>= the true vocab) are excluded and get zero gradient.

On a GPU `vocab_parallel_logprobs` takes the few-pass path of vocab_softmax.py instead (`fused`):
torch's log_softmax / softmax kernels over large chunks; these elementwise passes, each a kernel
launch over a 32 MiB chunk, were ~22k launches and 0.78 s of a 0.9 s H200 step. The LM head
that never forms the whole logits is lm_head.py.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_gspo.model.vocab_softmax import FusedLogprobs

_CHUNK_ELEMENTS = 1 << 23  # logits per chunk: 32 MiB of fp32 per temporary
# On a CPU, 4 MiB temporaries: a chunk's passes (shift, exp, sum) then run in the cache, and
# glibc serves them from its heap; 32 MiB ones are fresh mmaps, page-faulted on every use. The
# chunked forward takes half the time (48 x 143 x 8192 logits: 357 -> 192 ms on one thread).
_CPU_CHUNK_ELEMENTS = 1 << 20


def _chunk_elements(device: torch.device) -> int:
    return min(_CHUNK_ELEMENTS, _CPU_CHUNK_ELEMENTS) if device.type == "cpu" else _CHUNK_ELEMENTS


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    tp_group=None,
    with_entropy: bool = False,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) the entropy, from local logits [..., V_local].

    `vocab_start` is this rank's first vocabulary id, `vocab_size` the true (unpadded) size.
    Returns fp32 tensors shaped like `targets`. `fused` (None: on a GPU) takes the few-pass
    path of vocab_softmax.py (torch's log_softmax / softmax kernels per chunk, two
    all-reduces in all); off, the elementwise passes here, which a CPU runs from its cache.
    """
    v_local = logits.shape[-1]
    n_valid = v_local if vocab_size is None else min(max(vocab_size - vocab_start, 0), v_local)
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if fused is None:
        fused = logits.device.type != "cpu"
    if fused:
        return FusedLogprobs.apply(logits, targets, vocab_start, n_valid, tp_group, with_entropy)
    logprobs, entropy = _ChunkedLogprobs.apply(
        logits, targets, vocab_start, n_valid, tp_group, with_entropy
    )
    return logprobs, (entropy if with_entropy else None)


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


def _chunks(token_shape: torch.Size, v_local: int, device: torch.device):
    """Index tuples covering `token_shape`, each selecting about `_chunk_elements` logits as a view:
    blocks of whole leading rows when a row fits (one chunk for a small batch), else pieces of
    one row. Every op is per token, so the split changes no value."""
    if len(token_shape) == 0:
        yield ()
        return
    tokens = max(1, _chunk_elements(device) // max(v_local, 1))
    per_row = math.prod(token_shape[1:])
    if per_row <= tokens:
        step = tokens // max(per_row, 1)
        for r0 in range(0, token_shape[0], step):
            yield (slice(r0, r0 + step),)
        return
    for lead in itertools.product(*map(range, token_shape[:-1])):
        for t0 in range(0, token_shape[-1], tokens):
            yield (*lead, slice(t0, t0 + tokens))


def _local_fp32(chunk: torch.Tensor, n_valid: int) -> torch.Tensor:
    """The chunk's logits in fp32 with padded vocabulary entries at -inf."""
    x = chunk.float()
    if n_valid < x.shape[-1]:
        x = x.clone() if x is chunk else x
        x[..., n_valid:] = float("-inf")
    return x


def _target_index(targets: torch.Tensor, vocab_start: int, v_local: int):
    local_t = targets - vocab_start
    owned = (local_t >= 0) & (local_t < v_local)
    return local_t.clamp(0, v_local - 1).unsqueeze(-1), owned


class _ChunkedLogprobs(torch.autograd.Function):
    """(logits [..., V_local], targets [...]) -> (log p(targets), entropy), both fp32 [...]."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, n_valid, tp_group, with_entropy):
        v_local = logits.shape[-1]
        shape, dev = targets.shape, logits.device
        m = torch.empty(shape, dtype=torch.float32, device=dev)
        for idx in _chunks(shape, v_local, dev):
            m[idx] = _local_fp32(logits[idx], n_valid).max(dim=-1).values
        if tp_group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)

        sums = torch.zeros((3, *shape), dtype=torch.float32, device=dev)  # S, l_y - m, sum e(l-m)
        for idx in _chunks(shape, v_local, dev):
            shifted = _local_fp32(logits[idx], n_valid) - m[idx].unsqueeze(-1)
            target = _target_index(targets[idx], vocab_start, v_local)
            for i, value in enumerate(_chunk_sums(shifted, *target, n_valid, with_entropy)):
                sums[i][idx] = value
        if tp_group is not None:
            dist.all_reduce(sums, group=tp_group)

        log_s = sums[0].log()
        logprobs = sums[1] - log_s
        entropy = log_s - sums[2] / log_s.exp()  # log S - E_p[l - m]
        ctx.save_for_backward(logits, targets, m, log_s, entropy)
        ctx.vocab_start, ctx.n_valid = vocab_start, n_valid
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logprobs, g_entropy):
        logits, targets, m, log_s, entropy = ctx.saved_tensors
        if g_logprobs is None and g_entropy is None:
            return None, None, None, None, None, None
        v_local, n_valid = logits.shape[-1], ctx.n_valid
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        in_place = grad.dtype == torch.float32  # else an fp32 chunk, cast into grad
        for idx in _chunks(targets.shape, v_local, logits.device):
            x = _local_fp32(logits[idx], n_valid)
            logp = torch.sub(x, m[idx].unsqueeze(-1), out=grad[idx] if in_place else None)
            logp.sub_(log_s[idx].unsqueeze(-1))
            g_lp, g_ent = (None if g is None else g[idx].float() for g in (g_logprobs, g_entropy))
            _softmax_grad_(logp, g_lp, g_ent, entropy[idx])
            if g_lp is not None:  # + g_lp 1[v = y]
                index, owned = _target_index(targets[idx], ctx.vocab_start, v_local)
                logp.scatter_add_(-1, index, torch.where(owned, g_lp, 0.0).unsqueeze(-1))
            logp[..., n_valid:] = 0.0  # padded entries (and their nan from 0 * inf)
            if not in_place:
                grad[idx] = logp
        return grad, None, None, None, None, None


def _chunk_sums(shifted, index, owned, n_valid: int, with_entropy: bool):
    """Per token of one chunk: sum_v e_v, l_y - m where this rank owns y (else 0), sum_v e_v (l_v - m)."""
    e = shifted.exp()
    s = e.sum(dim=-1)
    picked = shifted.gather(-1, index).squeeze(-1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    if not with_entropy:
        return s, picked
    el = e[..., :n_valid].mul_(shifted[..., :n_valid])  # padded: 0 * -inf would be nan
    return s, picked, el.sum(dim=-1)


def _softmax_grad_(logp, g_lp, g_ent, entropy) -> None:
    """logp [.., V] -> -p_v (g_lp + g_ent (log p_v + H)) in place: the gradient of
    g_lp log p(y) + g_ent H but for the + g_lp 1[v = y] term (d H / d l_v = -p_v (log p_v + H))."""
    if g_ent is None:
        logp.exp_().mul_(-g_lp.unsqueeze(-1))
        return
    p = logp.exp()
    logp.add_(entropy.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
    if g_lp is not None:
        logp.add_(g_lp.unsqueeze(-1))
    logp.mul_(p).neg_()
