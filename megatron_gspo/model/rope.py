"""The rotary embedding of the local (non-Transformer-Engine) layer spec without concatenations:
megatron-core's values and gradients bit for bit, in fewer passes over memory.

megatron-core's unfused rotary (`rope_utils._apply_rotary_pos_emb_bshd`, which its THD path
calls too) forms t cos + rotate_half(t) sin with rotate_half(t) = cat(-t2, t1), then concatenates
the (empty) unrotated tail: two concatenations and a negation per call, and as many again in
its backward. Written per half of the head dimension (t = [t1, t2], cos = [c1, c2], sin =
[s1, s2]):

    forward:   y1 = t1 c1 - t2 s1              y2 = t2 c2 + t1 s2
    backward:  dt1 = g1 c1 + g2 s2             dt2 = g2 c2 - g1 s1

each the same IEEE operations as megatron's (a + (-b) is a - b, (-a) b is -(a b), and a sum of
two terms is the same in either order), written into one output. Interleaved or partial
rotary and multi-latent attention keep megatron's function.

megatron also forms cos and sin of the frequencies in every call: twice per layer (queries and
keys) for the same frequencies, and its THD path first gathers each packed sequence's
positions from them with a slice, a `.item()` and a concatenation per sequence. Here the last
call's packed frequencies and their cos and sin are kept and reused while the same tensors (same
objects, unmodified) come again: the values are the same ones, formed once per forward instead
of once per layer and projection.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_MEGATRON = None  # megatron-core's functions, kept for the cases these do not compute
_MEGATRON_THD = None


class RotaryHalves(torch.autograd.Function):
    """(t [..., d], cos [..., d], sin [..., d] broadcasting to t) -> t cos + rotate_half(t) sin."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotated(t, cos, sin, inverse=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotated(g, cos, sin, inverse=True), None, None


def _rotated(x, cos, sin, inverse: bool):
    """[x1 c1 - x2 s1, x2 c2 + x1 s2] (the forward), or with `inverse` [x1 c1 + x2 s2,
    x2 c2 - x1 s1] (its gradient), into one new tensor."""
    half = x.shape[-1] // 2
    x1, x2, c1, c2, s1, s2 = (p for t in (x, cos, sin) for p in (t[..., :half], t[..., half:]))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    first = torch.mul(x1, c1, out=out[..., :half])
    second = torch.mul(x2, c2, out=out[..., half:])
    if inverse:
        first.add_(x2 * s2)
        second.sub_(x1 * s1)
    else:
        first.sub_(x2 * s1)
        second.add_(x1 * s2)
    return out


class _LastCall:
    """The value formed from the last call's tensors, reused while the same tensors (the same
    objects, not modified in place since) and arguments come again."""

    def __init__(self):
        self.tensors: tuple = ()
        self.key: tuple = ()
        self.value = None

    def get(self, tensors: tuple, args: tuple, make):
        if any(t.requires_grad or t.is_inference() for t in tensors):
            return make()  # (nothing kept that autograd tracks; no version to check)
        key = (*(t._version for t in tensors), *args)
        same = len(tensors) == len(self.tensors) and all(
            a is b for a, b in zip(tensors, self.tensors, strict=False))  # fmt: skip
        if not (same and key == self.key):
            self.tensors, self.key, self.value = (), (), None  # (the old value freed first)
            value = make()
            self.tensors, self.key, self.value = tensors, key, value
        return self.value


_COS_SIN = _LastCall()
_PACKED_FREQS = _LastCall()


def rotary_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    """megatron-core's `_apply_rotary_pos_emb_bshd` (same signature and result)."""
    d = t.shape[-1]
    if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != d or d % 2:
        return megatron_rotary()(t, freqs, rotary_interleaved, multi_latent_attention, mscale)

    def cos_sin():  # (as megatron forms them)
        return (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)

    cos, sin = _COS_SIN.get((freqs,), (mscale, t.dtype), cos_sin)
    return RotaryHalves.apply(t, cos, sin)


def rotary_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
               mscale=1.0, cp_group=None):  # fmt: skip
    """megatron-core's `_apply_rotary_pos_emb_thd` (same signature and result): each packed
    sequence's positions from `freqs`, rotated by `rotary_bshd`. Context parallelism keeps
    megatron's function."""
    if cp_group is None or cp_group.size() > 1:
        return megatron_rotary_thd()(t, cu_seqlens, freqs, rotary_interleaved,
                                     multi_latent_attention, mscale, cp_group)  # fmt: skip
    packed = _PACKED_FREQS.get((freqs, cu_seqlens), (), lambda: packed_freqs(cu_seqlens, freqs))
    return rotary_bshd(t.unsqueeze(1), packed, rotary_interleaved, multi_latent_attention,
                       mscale).squeeze(1)  # fmt: skip


def packed_freqs(cu_seqlens, freqs):
    """The frequencies of every packed token as megatron's THD path gathers them on one context
    rank: where `freqs` has a row per packed token, those rows (each sequence at its offset);
    else each sequence's first rows (positions restarting at 0)."""
    bounds = cu_seqlens.tolist()
    if freqs.dim() >= 1 and freqs.size(0) == bounds[-1]:
        return freqs[: bounds[-1]]
    return torch.cat([freqs[: hi - lo] for lo, hi in zip(bounds[:-1], bounds[1:])], dim=0)


def megatron_rotary():
    """megatron-core's own `_apply_rotary_pos_emb_bshd`, whether or not `rotary_bshd` stands
    in for it."""
    from megatron.core.models.common.embeddings import rope_utils

    return _MEGATRON or rope_utils._apply_rotary_pos_emb_bshd


def megatron_rotary_thd():
    """megatron-core's own `_apply_rotary_pos_emb_thd`, whether or not `rotary_thd` stands in
    for it."""
    from megatron.core.models.common.embeddings import rope_utils

    return _MEGATRON_THD or rope_utils._apply_rotary_pos_emb_thd


def use_rotary_halves() -> None:
    """Route megatron-core's unfused rotary embedding through `rotary_bshd` (BSHD) and
    `rotary_thd` (THD), process-wide; its results are unchanged. Idempotent."""
    global _MEGATRON, _MEGATRON_THD
    from megatron.core.models.common.embeddings import rope_utils

    if _MEGATRON is None:
        _MEGATRON = rope_utils._apply_rotary_pos_emb_bshd
        _MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
    rope_utils._apply_rotary_pos_emb_bshd = rotary_bshd
    rope_utils._apply_rotary_pos_emb_thd = rotary_thd
