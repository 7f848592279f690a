"""RMSNorm for the local (non-Transformer-Engine) layer spec.

megatron-core's `WrappedTorchNorm` refuses sequence parallelism, which MoE layers require once
TP > 1. This norm computes exactly as HF's Qwen RMSNorm (statistics in fp32, scale in the input
dtype) and tags its weight `sequence_parallel`, so `finalize_model_grads` sums its gradient over
the TP group like megatron's own fused norms.
"""

from __future__ import annotations

import dataclasses

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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
