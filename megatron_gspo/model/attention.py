"""Core attention for the local (non-Transformer-Engine) layer spec, through torch's SDPA.

megatron-core's local `DotProductAttention` materializes the scores: it repeats the keys and
values for GQA, runs `baddbmm`, fills a causal mask, a softmax and a `bmm`, and keeps the [b, n,
s, s] probabilities for backward. `SdpaAttention` computes the same function with
`torch.nn.functional.scaled_dot_product_attention` (`is_causal`, GQA without repeating), which on a
CPU runs the flash-attention kernel in forward and backward. Values agree to fp32 rounding.

It takes over only the cases our models run: causal self-attention over whole, right-padded
sequences, or over packed ones (THD: `PackedSeqParams` with qkv_format "thd", [t, n, d] tensors,
causal within each sequence of cu_seqlens and blind across them); no mask tensor, bias, sliding
window, learned softmax offset or query-key layer scaling. Anything else goes to megatron's own
forward.

Packed sequences run one SDPA per sequence (`is_causal` on its slice). Measured against the
alternatives on this CPU (fp32, 4 query / 2 key-value heads of 32, forward + backward, one
thread): 1024 tokens as 8 x 128: per sequence 25 ms, one SDPA with a [t, t] block-diagonal
causal mask 195 ms; 512 tokens as 32s with two 128s: 18 ms vs 61 ms; 512 + 4 x 128: 78 ms vs
398 ms. A mask makes SDPA leave its flash kernel and materialize [t, t] scores; flex attention
with a document mask has no backward on a CPU in this torch. So: per sequence, each as a 4-D
[1, n, s, d] slice: torch's CPU flash kernel takes 4-D inputs only, and 3-D ones run the math
path (forward + backward, 8 query / 4 key-value heads of 64, one thread: 0.56 vs 0.95 ms at 56
tokens, 94 vs 219 ms at 1024).
"""

from __future__ import annotations

import dataclasses

import torch
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
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if (
            attention_mask is not None
            or attention_bias is not None
            or (packed_seq_params is not None and not thd)
            or mask_type != AttnMaskType.causal
            or query.size(0) != key.size(0)
            or getattr(self, "softmax_offset", None) is not None
            or getattr(self.scale_mask_softmax, "window_size", None) is not None
            or self.config.apply_query_key_layer_scaling
        ):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if thd:
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
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

    def _packed(self, query, key, value, cu_seqlens):
        """[t, n, d] packed sequences -> [t, n * d]: causal attention within each sequence."""
        cu = cu_seqlens.tolist()
        # [t, n, d] -> [1, n, t, d]: SDPA takes its CPU flash kernel for 4-D inputs only (3-D ones
        # go to the math path, which materializes the scores)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, a:b],
                k[:, :, a:b],
                v[:, :, a:b],
                dropout_p=self.attention_dropout.p if self.training else 0.0,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=q.size(1) != k.size(1),
            )  # fmt: skip
            for a, b in zip(cu[:-1], cu[1:])
            if b > a
        ]
        return torch.cat(parts, 2)[0].transpose(0, 1).reshape(query.size(0), -1)


def use_sdpa_attention(block_spec) -> None:
    """Swap megatron's local `DotProductAttention` for `SdpaAttention` in a block spec, in place."""
    for layer in block_spec.layer_specs:
        attn = getattr(layer.submodules.self_attention, "submodules", None)
        if attn is not None and dataclasses.is_dataclass(attn):
            if getattr(attn, "core_attention", None) is DotProductAttention:
                attn.core_attention = SdpaAttention
