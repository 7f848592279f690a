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
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_MEGATRON = None  # megatron-core's function, kept for the cases this one does not compute


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


def rotary_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    """megatron-core's `_apply_rotary_pos_emb_bshd` (same signature and result)."""
    d = t.shape[-1]
    if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != d or d % 2:
        return megatron_rotary()(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos = (torch.cos(freqs) * mscale).to(t.dtype)  # (as megatron forms them)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    return RotaryHalves.apply(t, cos, sin)


def megatron_rotary():
    """megatron-core's own `_apply_rotary_pos_emb_bshd`, whether or not `rotary_bshd` stands
    in for it."""
    from megatron.core.models.common.embeddings import rope_utils

    return _MEGATRON or rope_utils._apply_rotary_pos_emb_bshd


def use_rotary_halves() -> None:
    """Route megatron-core's unfused rotary embedding (BSHD and THD) through `rotary_bshd`,
    process-wide; its results are unchanged. Idempotent."""
    global _MEGATRON
    from megatron.core.models.common.embeddings import rope_utils

    if _MEGATRON is None:
        _MEGATRON = rope_utils._apply_rotary_pos_emb_bshd
    rope_utils._apply_rotary_pos_emb_bshd = rotary_bshd
