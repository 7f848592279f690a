"""RMSNorm for the local (non-Transformer-Engine) layer spec.

megatron-core's `WrappedTorchNorm` refuses sequence parallelism, which MoE layers require once
TP > 1. This norm computes exactly as HF's Qwen RMSNorm (statistics in fp32, scale in the input
dtype) and tags its weight `sequence_parallel`, so `finalize_model_grads` sums its gradient over
the TP group like megatron's own fused norms.

In fp32 it is two autograd functions (`RmsScale`, `ScaledByWeight`) that compute what autograd
computes for the expression, bit for bit, in fewer passes over memory: autograd's backward of
`x.pow(2)` forms x.pow(1), then 2 x, then their product with the mean's gradient expanded to
[..., H] (four passes of the input's size); `RmsScale` one product (2 c) x with c the mean's
gradient per row, [..., 1]: the same value, as doubling is exact (c (2x) = (2c) x). Two
functions, not one, so the input's gradient is summed in autograd's order: a residual's term,
then the x r product's, then the statistics' (a sum of three terms rounds by its order).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.function import once_differentiable


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return ScaledByWeight.apply(x, RmsScale.apply(x, self.eps), self.weight)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RmsScale(torch.autograd.Function):
    """r = rsqrt(mean(x^2, -1) + eps) [..., 1], and autograd's gradient of it."""

    @staticmethod
    def forward(ctx, x, eps: float):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r)
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_r):
        x, r = ctx.saved_tensors
        grad_mean = -0.5 * grad_r * r.pow(3)  # rsqrt's backward (the + eps passes it on)
        twice_c = (grad_mean / x.shape[-1]) * 2.0  # the mean's, then x.pow(2)'s: 2 x c
        return twice_c * x, None


class ScaledByWeight(torch.autograd.Function):
    """weight * (x * r), and autograd's gradients of it."""

    @staticmethod
    def forward(ctx, x, r, weight):
        h = x * r
        ctx.save_for_backward(x, r, weight, h)
        return weight * h

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, r, weight, h = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad
        grad_w = (g * h).sum_to_size(weight.shape) if need_w else None
        grad_h = g * weight
        grad_r = (grad_h * x).sum_to_size(r.shape) if need_r else None
        return (grad_h * r if need_x else None), grad_r, grad_w


def use_local_rmsnorm(block_spec) -> None:
    """Swap megatron's torch-norm wrapper for `RMSNorm` in a local block spec, in place."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(obj, field):
        if getattr(obj, field, None) is WrappedTorchNorm:
            setattr(obj, field, RMSNorm)

    swap(block_spec, "layer_norm")
    for layer in block_spec.layer_specs:
        sub = layer.submodules
        swap(sub, "input_layernorm")
        swap(sub, "pre_mlp_layernorm")
        attn = getattr(sub.self_attention, "submodules", None)
        if attn is not None and dataclasses.is_dataclass(attn):
            swap(attn, "q_layernorm")
            swap(attn, "k_layernorm")
