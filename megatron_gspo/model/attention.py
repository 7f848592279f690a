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

Sequences of one length go through one SDPA call together, as a batch [m, n, s, d] gathered from
the packed tokens: RL batches repeat lengths (a group's samples share their prompt, and answers
cut at `max_new_tokens` share their length), and the kernel computes each (sequence, head) alone,
so the values are the per-sequence call's bit for bit. One call per sequence also costs in
backward: each slice's gradient is a zero-filled tensor of the whole microbatch's size, summed
with the others, so it grows with sequences x tokens per microbatch. Measured on one microbatch
of 4256 tokens (bench_pack.py's long tail: 57 x 56 and 7 x 152; 8 query / 4 key-value heads of
64, forward + backward, one thread): 73 ms by length against 153-165 ms per sequence; 61 x 152
plus three other lengths: 234-260 ms against 468-504 ms. A length that occurs once runs on its
slice, without a gather.
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
        """[t, n, d] packed sequences -> [t, n * d]: causal attention within each sequence,
        the sequences of one length in one call."""
        cu = cu_seqlens.tolist()
        starts: dict[int, list[int]] = {}  # length -> the sequences' first tokens
        for a, b in zip(cu[:-1], cu[1:]):
            if b > a:
                starts.setdefault(b - a, []).append(a)
        dev, outs, tokens = query.device, [], []
        for s, firsts in starts.items():
            index = torch.tensor(firsts, device=dev)[:, None] + torch.arange(s, device=dev)
            tokens.append(index.reshape(-1))
            outs.append(self._same_length(query, key, value, index, firsts[0]))
        out = torch.cat(outs, 0)  # [t, n * d], in the order of `tokens`
        if any(len(f) > 1 for f in starts.values()):  # else already in token order
            out = out.index_select(0, torch.cat(tokens).argsort())
        return out

    def _same_length(self, query, key, value, index, first: int):
        """Attention of m sequences of s tokens -> [m * s, n * d]: the rows `index` [m, s] of
        the packed [t, n, d] tensors, gathered (m > 1) or sliced from `first` (m = 1)."""
        qkv, s = (query, key, value), index.shape[1]
        if index.shape[0] == 1:  # [s, n, d] -> [1, n, s, d]
            q, k, v = (x[first : first + s].transpose(0, 1).unsqueeze(0) for x in qkv)
        else:  # [m * s, n, d] -> [m, n, s, d]
            rows = index.reshape(-1)
            q, k, v = (x.index_select(0, rows).view(*index.shape, *x.shape[1:]) for x in qkv)
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        # 4-D: SDPA takes its CPU flash kernel for 4-D inputs only (3-D ones go to the math
        # path, which materializes the scores)
        context = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1),
        )  # fmt: skip
        # [m, n, s, d] -> [m * s, n * d]
        return context.transpose(1, 2).reshape(-1, q.size(1) * q.size(3))


def use_sdpa_attention(block_spec) -> None:
    """Swap megatron's local `DotProductAttention` for `SdpaAttention` in a block spec, in place."""
    for layer in block_spec.layer_specs:
        attn = getattr(layer.submodules.self_attention, "submodules", None)
        if attn is not None and dataclasses.is_dataclass(attn):
            if getattr(attn, "core_attention", None) is DotProductAttention:
                attn.core_attention = SdpaAttention
