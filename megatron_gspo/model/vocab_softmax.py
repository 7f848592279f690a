"""Vocab-parallel log-softmax of a chunk of tokens in few passes over memory: torch's own
log_softmax / softmax kernels, per-token statistics combined over TP once, a backward of two
(four with the entropy) elementwise passes per chunk.

Legend: N tokens of a chunk, V this rank's valid vocabulary columns (a TP slice, padding cut off),
x_NV its logits (any float dtype), r a TP rank, q_r = softmax_r(x) its local softmax.

Per rank and token, from one log_softmax kernel (lsm = log q_r):

    lse_r  = x_k - lsm_k            (any column k: the local log-sum-exp, no extra pass)
    pick_r = lsm_y                  (where this rank owns the target y)
    E_r    = sum_v q_v lsm_v        (entropy only: one exp pass and a row-wise dot)

Across ranks, with M = max_r lse_r (one MAX all-reduce), e_r = exp(lse_r - M) and one SUM
all-reduce of (e_r, owned (pick_r + lse_r - M), e_r (E_r + lse_r - M)) = (Z, P, Q):

    log p(y) = P - log Z           H = log Z - Q / Z        log w_r = lse_r - M - log Z

(w_r = exp(lse_r - lse) is rank r's share of the probability mass; on one rank Z = 1, w = 1
and log p(y) is log_softmax's own value.) Backward, with p_v = w_r q_v and a, b per token:

    d/dx_v [g log p(y) + g_H H] = g 1[v = y] + q_v (a + b lsm_v),
    a = -w (g + g_H (log w + H)),   b = -w g_H            (d H / d x_v = -p_v (log p_v + H))

Without the entropy that is softmax then one multiply written straight into the gradient's dtype;
with it, log_softmax, exp, one addcmul in place and one multiply. The target's entry is then
overwritten with its exact fp32 value where this rank owns it.

`FusedLogprobs` applies this to full logits [..., V_local] (chunks of at most `chunk_elements`);
`model/lm_head.py` applies it to logits it forms a chunk at a time from hidden states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

# Logits per chunk on a GPU: few, large kernels (the per-chunk launches are the cost), 1 GiB of
# fp32 per temporary. On a CPU 4 MiB ones, served from the heap and the cache (logprobs.py).
CUDA_CHUNK_ELEMENTS = 1 << 28
CPU_CHUNK_ELEMENTS = 1 << 20


def chunk_elements(device: torch.device) -> int:
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else CUDA_CHUNK_ELEMENTS


def target_columns(targets_N, vocab_start: int, n_valid: int):
    """(column of each token's target in this rank's slice, clamped to a valid column where the
    rank does not own it; whether it owns it)."""
    local = targets_N - vocab_start
    owned = (local >= 0) & (local < n_valid)
    return local.clamp(0, max(n_valid - 1, 0)).unsqueeze(-1), owned


def chunk_stats(x_NV, index_N1, owned_N, with_entropy: bool, out_KN) -> None:
    """Writes (lse_r, pick_r, E_r) of one chunk into out_KN [2 or 3, N] (module docstring)."""
    if x_NV.shape[-1] == 0:  # a rank whose slice is all padding holds no probability
        out_KN[0].fill_(float("-inf"))
        out_KN[1:].zero_()
        return
    lsm = torch.log_softmax(x_NV, -1, dtype=torch.float32)
    lsm_k = lsm.gather(-1, index_N1).squeeze(-1)
    torch.sub(x_NV.gather(-1, index_N1).squeeze(-1).float(), lsm_k, out=out_KN[0])
    out_KN[1].copy_(lsm_k.masked_fill(~owned_N, 0.0))
    if with_entropy:
        q = lsm.exp()
        torch.matmul(q.unsqueeze(-2), lsm.unsqueeze(-1), out=out_KN[2].view(-1, 1, 1))


def combine(stats_KN, owned_N, tp_group):
    """(log p(y), H or None, log w) per token from every rank's (lse_r, pick_r[, E_r])."""
    lse = stats_KN[0]
    m = lse.clone()
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shift = lse - m
    e = shift.exp()
    sums = [e, torch.where(owned_N, stats_KN[1] + shift, 0.0)]
    if stats_KN.shape[0] == 3:  # e_r (E_r + lse_r - M); 0 on a rank holding no mass
        sums.append(torch.where(e > 0, e * (stats_KN[2] + shift), 0.0))
    reduced = torch.stack(sums)
    if tp_group is not None:
        dist.all_reduce(reduced, group=tp_group)
    log_z = reduced[0].log()
    entropy = log_z - reduced[2] / reduced[0] if len(sums) == 3 else None
    return reduced[1] - log_z, entropy, shift - log_z


def chunk_grad(x_NV, index_N1, owned_N, log_w, entropy, g_lp, g_ent, out_NV) -> None:
    """The gradient of sum_t g_lp log p(y_t) + g_ent H_t w.r.t. the chunk's logits, into out_NV
    (any float dtype). g_lp / g_ent: per token fp32, or None."""
    w = log_w.exp()
    if g_ent is None:
        q = torch.softmax(x_NV, -1, dtype=torch.float32)
        a = -(g_lp * w)
        torch.mul(q, a.unsqueeze(-1), out=out_NV)
        fix = q.gather(-1, index_N1).squeeze(-1) * a
    else:
        lsm = torch.log_softmax(x_NV, -1, dtype=torch.float32)
        q = lsm.exp()
        b = -(g_ent * w)
        a = b * (log_w + entropy)
        if g_lp is not None:
            a = a - g_lp * w
        lsm_y = lsm.gather(-1, index_N1).squeeze(-1)
        torch.addcmul(a.unsqueeze(-1), lsm, b.unsqueeze(-1), out=lsm)
        torch.mul(lsm, q, out=out_NV)
        fix = q.gather(-1, index_N1).squeeze(-1) * (a + b * lsm_y)
    if g_lp is not None:
        current = out_NV.gather(-1, index_N1).squeeze(-1)
        exact = torch.where(owned_N, (fix + g_lp).to(out_NV.dtype), current)
        out_NV.scatter_(-1, index_N1, exact.unsqueeze(-1))


class FusedLogprobs(torch.autograd.Function):
    """(logits [..., V_local], targets [...]) -> (log p(targets), entropy or None), fp32 [...].
    Saves the logits (the caller holds them) and two numbers per token; recomputes each
    chunk's softmax in backward."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, n_valid, tp_group, with_entropy):
        x, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        index, owned = target_columns(t, vocab_start, n_valid)
        stats = torch.empty((3 if with_entropy else 2, t.numel()), device=x.device)
        for rows in row_chunks(t.numel(), n_valid, x.device):
            chunk_stats(x[rows, :n_valid], index[rows], owned[rows], with_entropy, stats[:, rows])
        lp, entropy, log_w = combine(stats, owned, tp_group)
        ctx.save_for_backward(logits, index, owned, log_w, entropy)
        ctx.n_valid = n_valid
        ctx.set_materialize_grads(False)
        ent = None if entropy is None else entropy.view(targets.shape)
        return lp.view(targets.shape), ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, index, owned, log_w, entropy = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None
        n_valid = ctx.n_valid
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        x, g = logits.reshape(-1, logits.shape[-1]), grad.view(-1, logits.shape[-1])
        g[:, n_valid:] = 0.0  # padded vocabulary entries
        g_lp, g_ent = (None if v is None else v.reshape(-1).float() for v in (g_lp, g_ent))
        for r in row_chunks(index.shape[0], n_valid, x.device):
            chunk_grad(x[r, :n_valid], index[r], owned[r], log_w[r], _at(entropy, r),
                       _at(g_lp, r), _at(g_ent, r), g[r, :n_valid])  # fmt: skip
        return grad, None, None, None, None, None


def row_chunks(n_rows: int, width: int, device: torch.device, rows: int | None = None):
    """Slices of `rows` (default: about `chunk_elements` / width) rows covering n_rows."""
    step = rows or max(1, chunk_elements(device) // max(width, 1))
    for r0 in range(0, n_rows, step):
        yield slice(r0, min(r0 + step, n_rows))


def _at(t, rows):
    return None if t is None else t[rows]
