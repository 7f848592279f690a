"""Core attention for the local (non-Transformer-Engine) layer spec, through torch's SDPA.

megatron-core's local `DotProductAttention` materializes the scores: it repeats the keys and
values for GQA, runs `baddbmm`, fills a causal mask, a softmax and a `bmm`, and keeps the [b, n,
s, s] probabilities for backward. `SdpaAttention` computes the same function with
`torch.nn.functional.scaled_dot_product_attention` (`is_causal`, GQA without repeating), which on a
CPU runs the flash-attention kernel in forward and backward. Values agree to fp32 rounding.

It takes over only the case our models run: causal self-attention over whole, right-padded
sequences (no mask tensor, bias, packing, sliding window, learned softmax offset or query-key
layer scaling, same query and key lengths). Anything else goes to megatron's own forward.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if (
            attention_mask is not None
            or attention_bias is not None
            or packed_seq_params is not None
            or mask_type != AttnMaskType.causal
            or query.size(0) != key.size(0)
            or getattr(self, "softmax_offset", None) is not None
            or getattr(self.scale_mask_softmax, "window_size", None) is not None
            or self.config.apply_query_key_layer_scaling
        ):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        sq, b, heads, _ = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=heads != k.size(1),
        )
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def use_sdpa_attention(block_spec) -> None:
    """Swap megatron's local `DotProductAttention` for `SdpaAttention` in a block spec, in place."""
    for layer in block_spec.layer_specs:
        attn = getattr(layer.submodules.self_attention, "submodules", None)
        if attn is not None and dataclasses.is_dataclass(attn):
            if getattr(attn, "core_attention", None) is DotProductAttention:
                attn.core_attention = SdpaAttention
