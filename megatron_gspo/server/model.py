"""A plain-torch Qwen3-MoE / Qwen3 / Qwen2 causal LM for inference, with a slotted KV cache.

This is the compute of the built-in rollout server. It computes exactly what HF transformers
computes for these architectures (RMSNorm statistics in fp32, router softmax in fp32, top-k in
descending order, optional renormalisation), so its log-probs and routed experts can be checked
against an HF forward.

One `forward` call runs a batch of *chunks*: each chunk is a run of new tokens for one sequence,
which owns a slot of the KV cache and already has `start` tokens cached. A prefill is a chunk of
the whole prompt, a decode step a chunk of one token; both mix freely in a batch (continuous
batching). Tokens travel packed ([T, ...] over all chunks); attention pads queries per chunk.
A batch of one-token chunks (every decode step) takes a shorter path: index tensors built in one
copy from Python lists, a rope table lookup, one flat index_copy per k/v, and the scores as one
baddbmm with the mask as an additive bias; the numbers are the same as the general path's.
Where a compiled decode kernel is attached (`kernels.attach`, decode_kernel.c: the whole step in
one C call, as dispatch dominates a torch step at these sizes), one-token chunks go through it
and the rest through torch; both give the same numbers up to float rounding.

Weights are held under their HF checkpoint names, except that experts are stacked per layer
(gate/up [E, F, D], down [E, D, F]); `load_weights` takes HF names (per expert, or the fused
transformers-5 `experts.gate_up_proj` / `experts.down_proj`) so weight updates use the names the
trainer's bridge exports.

Shape legend: T packed tokens, B chunks, Q longest chunk, K longest cached length, D hidden,
H heads, G kv heads, Dh head dim, E experts, F expert ffn, V vocab, L MoE layers, k top-k.
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F

from megatron_gspo.gemm_rows import at_least_gemm_rows, padded_blocks
from megatron_gspo.hf.config import ModelSpec, load_hf_config, model_spec
from megatron_gspo.server.kv_cache import KVCache
from megatron_gspo.server.weights import ModelWeights

if TYPE_CHECKING:
    from megatron_gspo.server.kernels import CompiledDecode

_GROUPED_MM = hasattr(torch, "_grouped_mm")  # one matmul over all experts (CPU too, torch >= 2.9)


@dataclass
class Chunk:
    """New tokens for one sequence: `tokens` go at positions start, start+1, ... of `slot`."""

    slot: int
    start: int
    tokens: list[int]
    logits_from: int = -1  # first index in `tokens` whose logits are wanted (-1: only the last)


@dataclass
class StepOutput:
    rows_NV: torch.Tensor  # the wanted logits of all chunks, packed in chunk order, fp32
    counts: list[int]  # rows of each chunk in rows_NV (n_i - logits_from_i)
    routed: list[torch.Tensor] | None  # per chunk, [n_i, L, k] int32 (None when not recorded)

    @functools.cached_property
    def logits(self) -> list[torch.Tensor]:
        """Per chunk, [n_i - logits_from_i, V]."""
        return list(self.rows_NV.split(self.counts))

    @functools.cached_property
    def last_BV(self) -> torch.Tensor:
        """Each chunk's last logits row: the one its next token is sampled from."""
        if len(self.counts) == self.rows_NV.shape[0]:
            return self.rows_NV
        return self.rows_NV[_longs(list(itertools.accumulate(self.counts))) - 1]


class RolloutModel(ModelWeights):
    """Inference-only causal LM over HF-named weights. Not an nn.Module: no autograd, no hooks."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype | None = None, quantization: str | None = None
    ):
        super().__init__(spec, dtype, quantization)
        self.moe_layer_ids = spec.moe_layer_ids
        hd = spec.head_dim
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self._rope_CSd = torch.zeros(0, 2, hd, dtype=self.dtype)  # grown by _rope_table
        # Decode steps through the compiled kernel (kernels.attach sets it), else torch.
        self.decode_kernel: CompiledDecode | None = None
        # Batch-invariant numerics (--enable-deterministic-inference): every sequence's logits
        # independent of what else is in its batch, so a rerun with the same seeds gives the
        # same tokens whatever the timing of the requests (see `forward`, `batch_invariant`).
        self._batch_invariant = False
        self._onednn_before = True
        # torch's grouped matmul needs rows of a multiple of 16 bytes (hidden and expert widths
        # times the element size); narrower experts (e.g. 4 bf16 values) take the per-expert loop.
        item = torch.empty(0, dtype=self.dtype).element_size()
        widths = (spec.hidden_size, spec.moe_ffn_hidden_size or 0)
        self.grouped_mm = all(w * item % 16 == 0 for w in widths)

    @property
    def batch_invariant(self) -> bool:
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        """Turning it on also turns oneDNN off for the process (`torch.backends.mkldnn`, restored
        when turned off): torch computes a reduced-precision product with oneDNN or with its own
        kernel by the product's size (batch x rows x inner x columns against 16^3), and the two
        round differently, so a row's bits would change with the number of rows beside it (a
        decode step's attention over [rows at a position x kv heads] crosses that size). Without
        oneDNN every product takes one kernel, each row summed in one order; only reduced
        precision is slower (an fp32 product is MKL's either way). MKL itself takes another
        kernel for 1-3 rows: with the mode on, products of fewer rows are padded to 4
        (`_linear`, `_experts`)."""
        on, onednn = bool(on), torch.backends.mkldnn
        if on and not self._batch_invariant:
            self._onednn_before = bool(onednn.enabled)
            onednn.enabled = False  # type: ignore[assignment]  # (a torch flags property)
        elif self._batch_invariant and not on:
            onednn.enabled = self._onednn_before  # type: ignore[assignment]
        self._batch_invariant = on

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype | None = None, quantization: str | None = None
    ) -> RolloutModel:
        model = cls(model_spec(load_hf_config(path)), dtype, quantization)
        model.load_checkpoint(path)
        return model

    # ---- compute -------------------------------------------------------------------------

    def new_cache(self, slots: int = 8, capacity: int = 256) -> KVCache:
        return KVCache(self.spec, self.dtype, slots, capacity)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], cache: KVCache, record_routing: bool = False):
        """Run one batch of chunks, writing their k/v into `cache`. Returns a StepOutput.
        With a decode kernel attached, the one-token chunks go through it, the rest (prefills)
        through torch.

        torch's batched forward is not batch-invariant: a sequence's logits change in their
        last bits with the batch it is in (its attention is padded to the batch's longest row).
        With `batch_invariant` torch runs the chunks in parts that need no padding (`_torch`),
        and every product in one kernel whatever its size (the property's setter; products of
        1-3 rows padded to 4, `_linear`), so each one's logits depend on its own tokens only;
        the compiled decode step is batch-invariant as it is (each row's sums in one order)."""
        lens = [len(c.tokens) for c in chunks]
        if self.decode_kernel is None or min(lens) > 1:
            return self._torch(chunks, lens, cache, record_routing)
        if max(lens) == 1:
            return self._compiled_decode(chunks, cache, record_routing)
        return self._mixed(chunks, lens, cache, record_routing)

    def _torch(self, chunks: list[Chunk], lens: list[int], cache: KVCache, record_routing):
        """The torch forward of `chunks`: one batch, or with batch_invariant in parts whose rows
        all attend over as many positions: the decode steps at each position together, each
        prefill alone. A batch pads every row's attention to its longest, and the padding
        moves the last bits of the softmax's and the value product's sums (rows of one length
        need none); the matmuls, in one kernel over at least 4 rows (`batch_invariant`,
        `_linear`), give each row the same bits in any batch."""
        if not self.batch_invariant or len(chunks) == 1:
            return self._forward(chunks, lens, cache, record_routing)
        parts: dict[tuple[int, int], list[int]] = {}
        for i, (c, n) in enumerate(zip(chunks, lens)):
            parts.setdefault((c.start, -1) if n == 1 else (c.start, i), []).append(i)
        return _merge(len(chunks), [
            (idx, self._forward([chunks[i] for i in idx], [lens[i] for i in idx], cache,
                                record_routing))
            for idx in parts.values()
        ])  # fmt: skip

    def _forward(self, chunks: list[Chunk], lens: list[int], cache: KVCache, record_routing):
        meta = self._batch(chunks, lens, cache)
        x = self.params["model.embed_tokens.weight"][meta.ids_T]
        routed: list[torch.Tensor] = []
        for i in range(self.spec.num_layers):
            topk_Tk = self._layer(i, x, cache, meta)
            if topk_Tk is not None:
                routed.append(topk_Tk)
        firsts = [n - 1 if c.logits_from < 0 else c.logits_from for c, n in zip(chunks, lens)]
        counts = [n - f for f, n in zip(firsts, lens)]
        if meta.q_len > 1:  # only the wanted rows go through the norm and the head
            offsets = [0, *itertools.accumulate(lens)][:-1]
            rows = [r for o, f, n in zip(offsets, firsts, lens) for r in range(o + f, o + n)]
            x = x[_longs(rows)]
        x = _rms(x, self.params["model.norm.weight"], self.spec.rms_norm_eps)
        head = self.params.get("lm_head.weight", self.params["model.embed_tokens.weight"])
        rows_NV = self._linear(x, head).float()
        routed_out = None
        if record_routing and routed:
            routed_out = list(torch.stack(routed, 1).to(torch.int32).split(lens))
        return StepOutput(rows_NV, counts, routed_out)

    def _compiled_decode(self, chunks: list[Chunk], cache: KVCache, record_routing: bool):
        assert self.decode_kernel is not None  # forward() comes here only with one attached
        ids, pos, slots = zip(*((c.tokens[0], c.start, c.slot) for c in chunks))
        rows_NV, routed = self.decode_kernel.step(ids, pos, slots, cache, record_routing)
        routed_out = list(routed.split(1)) if routed is not None else None
        return StepOutput(rows_NV, [1] * len(chunks), routed_out)

    def _mixed(self, chunks: list[Chunk], lens: list[int], cache: KVCache, record_routing):
        """Decode steps through the kernel, prefills through torch; outputs in chunk order."""
        ones = [i for i, n in enumerate(lens) if n == 1]
        more = [i for i, n in enumerate(lens) if n > 1]
        cache.ensure(
            max(c.slot for c in chunks) + 1, max(c.start + n for c, n in zip(chunks, lens))
        )
        fast = self._compiled_decode([chunks[i] for i in ones], cache, record_routing)
        slow = self._torch(
            [chunks[i] for i in more], [lens[i] for i in more], cache, record_routing
        )
        return _merge(len(chunks), [(ones, fast), (more, slow)])

    def _batch(self, chunks: list[Chunk], lens: list[int], cache: KVCache) -> _Batch:
        G, q_len = self.spec.num_kv_heads, max(lens)
        k_len = max(c.start + n for c, n in zip(chunks, lens))
        cache.ensure(max(c.slot for c in chunks) + 1, k_len)
        cap, slots, starts = cache.capacity, [c.slot for c in chunks], [c.start for c in chunks]
        if q_len == 1:  # a decode step: token t is chunk t; index lists built in Python
            ids_T, pos_T, slot_B = _longs([c.tokens[0] for c in chunks], starts, slots)
            b_T = j_T = mask_BQK = None
            # Where each token's k/v rows go in the cache seen as [slots * G * capacity, Dh].
            kv_rows = _longs(
                [(sl * G + g) * cap + p for sl, p in zip(slots, starts) for g in range(G)]
            )
            # The causal mask as an additive bias, one row per chunk and kv head.
            bias_BG1K = torch.zeros(len(chunks), G, 1, k_len, dtype=self.dtype)
            future_B11K = (torch.arange(k_len) > pos_T[:, None])[:, None, None]
            bias_BG1K = bias_BG1K.masked_fill_(future_B11K, float("-inf")).view(-1, 1, k_len)
        else:
            ids_T = _longs([t for c in chunks for t in c.tokens])
            lens_B, start_B, slot_B = _longs(lens, starts, slots)
            b_T = torch.repeat_interleave(torch.arange(len(chunks)), lens_B)
            j_T = torch.arange(len(ids_T)) - (torch.cumsum(lens_B, 0) - lens_B)[b_T]
            pos_T = start_B[b_T] + j_T
            kv_rows = ((slot_B[b_T, None] * G + torch.arange(G)) * cap + pos_T[:, None]).view(-1)
            mask_BQK, bias_BG1K = _mask(start_B, q_len, k_len), None
        # Slots s0, s0+1, ... in order (the usual case: slots are handed out in order): the
        # cache rows are read as a view instead of gathered.
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        return _Batch(
            ids_T=ids_T,
            slot_B=slot_B,
            rows=slice(slots[0], slots[0] + len(slots)) if contiguous else slot_B,
            kv_rows=kv_rows,
            b_T=b_T,
            j_T=j_T,
            q_len=q_len,
            k_len=k_len,
            mask_BQK=mask_BQK,
            bias_BG1K=bias_BG1K,
            rope_T2d=self._rope_table(k_len)[pos_T],
        )

    def _layer(self, i: int, x: torch.Tensor, cache: KVCache, meta: _Batch):
        """One decoder layer, adding into the residual `x` in place; returns the top-k experts
        [T, k] of an MoE layer (None for a dense one)."""
        p, eps = f"model.layers.{i}.", self.spec.rms_norm_eps
        x += self._attention(
            i, _rms(x, self.params[p + "input_layernorm.weight"], eps), cache, meta
        )
        h = _rms(x, self.params[p + "post_attention_layernorm.weight"], eps)
        if self.spec.moe_layers[i]:
            out, topk_Tk = self._moe(i, h)
            x += out
            return topk_Tk
        x += self._mlp(p, h)
        return None

    def full_logits(self, tokens: list[int], record_routing: bool = False) -> StepOutput:
        """Logits at every position of one sequence (a fresh cache); for tests and scoring."""
        cache = self.new_cache(1, len(tokens))
        return self.forward([Chunk(0, 0, list(tokens), logits_from=0)], cache, record_routing)

    def _rope_table(self, n: int) -> torch.Tensor:
        """[P >= n, 2, Dh]: cos and sign-folded sin of positions 0..P-1, so that
        rope(x) = x * cos + swap_halves(x) * sin (HF's rotate_half with its sign in the table)."""
        if n > self._rope_CSd.shape[0]:
            pos = torch.arange(max(n, 2 * self._rope_CSd.shape[0], 256))
            freqs = pos.float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat([freqs, freqs], -1)
            sin = emb.sin()
            sin[:, : freqs.shape[1]].neg_()
            self._rope_CSd = torch.stack([emb.cos(), sin], 1).to(self.dtype)
        return self._rope_CSd

    def _qk_norm(self, i: int) -> torch.Tensor:
        """[H + G, Dh]: the q-norm weight for each q head, then the k-norm weight for each kv head."""
        key = f"{i}.qk_norm"
        if key not in self._derived:
            s, pre = self.spec, f"model.layers.{i}.self_attn."
            q = self.params[pre + "q_norm.weight"].expand(s.num_heads, -1)
            k = self.params[pre + "k_norm.weight"].expand(s.num_kv_heads, -1)
            self._derived[key] = torch.cat([q, k])
        return self._derived[key]

    def _attention(self, i: int, x: torch.Tensor, cache: KVCache, m: _Batch) -> torch.Tensor:
        s, p = self.spec, self.params
        pre = f"model.layers.{i}."
        T, hd, H, G = x.shape[0], s.head_dim, s.num_heads, s.num_kv_heads
        qkv = self._linear(x, self.fused[pre + "qkv"], self.fused.get(pre + "qkv_bias"))
        qkv = qkv.view(T, H + 2 * G, hd)
        qk, v = qkv[:, : H + G], qkv[:, H + G :]  # q and k heads normed and rotated together
        if s.qk_norm:
            qk = _rms(qk, self._qk_norm(i), s.rms_norm_eps)
        half = hd // 2
        swapped = torch.cat([qk[..., half:], qk[..., :half]], -1)
        qk = qk * m.rope_T2d[:, 0:1] + swapped * m.rope_T2d[:, 1:2]
        q, k = qk[:, :H], qk[:, H:]
        k_cache, v_cache = cache.k[i], cache.v[i]
        k_cache.view(-1, hd).index_copy_(0, m.kv_rows, k.reshape(-1, hd))
        v_cache.view(-1, hd).index_copy_(0, m.kv_rows, v.reshape(-1, hd))
        k_BGKd = k_cache[m.rows, :, : m.k_len]
        v_BGKd = v_cache[m.rows, :, : m.k_len]
        if m.q_len == 1:  # decode: one query per chunk; GQA as [B * G] small matmuls
            k_NKd = k_BGKd.reshape(T * G, m.k_len, hd)  # N = B * G
            assert m.bias_BG1K is not None  # _batch sets it for decode steps
            scores_NhK = torch.baddbmm(
                m.bias_BG1K, q.reshape(T * G, H // G, hd), k_NKd.transpose(1, 2), alpha=hd**-0.5
            )
            v_NKd = v_BGKd.reshape(T * G, m.k_len, hd)
            o_T = torch.bmm(torch.softmax(scores_NhK, -1), v_NKd).view(T, H * hd)
        else:
            assert m.mask_BQK is not None  # _batch sets it for prefill batches
            q_BQHd = q.new_zeros(len(m.slot_B), m.q_len, H, hd)
            q_BQHd[m.b_T, m.j_T] = q
            o = F.scaled_dot_product_attention(
                q_BQHd.transpose(1, 2), k_BGKd, v_BGKd, attn_mask=m.mask_BQK[:, None],
                enable_gqa=True,
            )  # fmt: skip
            o_T = o.transpose(1, 2)[m.b_T, m.j_T].reshape(T, H * hd)
        return self._linear(o_T, p[pre + "self_attn.o_proj.weight"])

    def _mlp(self, pre: str, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(x, self.fused[pre + "gate_up"]).chunk(2, -1)
        return self._linear(F.silu(gate) * up, self.params[pre + "mlp.down_proj.weight"])

    def _moe(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routed experts; returns the output and the chosen experts [T, k]."""
        s = self.spec
        logits_TE = self._linear(x, self.params[f"model.layers.{i}.mlp.gate.weight"])
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        w_Tk, idx_Tk = torch.topk(probs_TE, s.topk, dim=-1)
        if s.norm_topk_prob:
            w_Tk /= w_Tk.sum(-1, keepdim=True)
        return self._experts(i, x, w_Tk.to(x.dtype), idx_Tk), idx_Tk

    def _experts(self, i, x, w_Tk, idx_Tk) -> torch.Tensor:
        """The (token, expert) pairs sorted by expert once; each expert's block goes through its
        weights (`_expert_blocks`), and one index_add sums the k outputs of each token. With
        `batch_invariant` each block is computed among at least MIN_GEMM_ROWS rows (zero rows
        padding a smaller one), as `_linear` computes."""
        order_N = torch.argsort(idx_Tk.view(-1), stable=True)  # N = T * k pairs
        tok_N = order_N // self.spec.topk
        counts_E = torch.bincount(idx_Tk.view(-1), minlength=self.spec.num_experts)
        h_ND = x[tok_N]
        if self._batch_invariant:
            at_N, padded_E = padded_blocks(counts_E, idx_Tk.view(-1)[order_N])
            h_PD = h_ND.new_zeros((int(padded_E.sum()), h_ND.shape[1]))
            y_ND = self._expert_blocks(i, h_PD.index_copy_(0, at_N, h_ND), padded_E)[at_N]
        else:
            y_ND = self._expert_blocks(i, h_ND, counts_E)
        y_ND *= w_Tk.view(-1)[order_N, None]
        return torch.zeros_like(x).index_add_(0, tok_N, y_ND)

    def _expert_blocks(self, i: int, h_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, `counts_E` of them per expert, through their experts' MLPs:
        one grouped matmul for all experts where torch has it, else one expert at a time."""
        ex = self.experts[i]
        if _GROUPED_MM and self.grouped_mm:
            offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
            gate, up = torch._grouped_mm(h_ND, ex["gate_up"].transpose(1, 2), offs=offs).chunk(
                2, -1
            )
            return torch._grouped_mm(F.silu(gate) * up, ex["down"].transpose(1, 2), offs=offs)
        outs = []
        for e, h in enumerate(h_ND.split(counts_E.tolist())):
            if len(h):
                gate, up = F.linear(h, ex["gate_up"][e]).chunk(2, -1)
                outs.append(F.linear(F.silu(gate) * up, ex["down"][e]))
        return torch.cat(outs)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        """F.linear; with `batch_invariant` over at least MIN_GEMM_ROWS rows (zero rows padding
        fewer): a CPU's BLAS computes 1-3 rows with another kernel, rounding otherwise, so a
        row's bits would change with how many rows share its product (gemm_rows.py)."""
        if not self._batch_invariant:
            return F.linear(x, w, b)
        return F.linear(at_least_gemm_rows(x), w, b)[: x.shape[0]]


@dataclass
class _Batch:
    ids_T: torch.Tensor
    slot_B: torch.Tensor
    rows: slice | torch.Tensor  # the cache rows of the chunks, in chunk order
    kv_rows: torch.Tensor  # [T * G]: each token's k/v row per kv head in the flat cache
    b_T: torch.Tensor | None  # chunk and index in it of each token (prefill batches only)
    j_T: torch.Tensor | None
    q_len: int
    k_len: int
    mask_BQK: torch.Tensor | None  # prefill batches
    bias_BG1K: torch.Tensor | None  # decode steps (Q = 1): the mask as 0 / -inf, [B * G, 1, K]
    rope_T2d: torch.Tensor  # cos and sign-folded sin at each token's position


def _merge(n: int, parts: list[tuple[list[int], StepOutput]]) -> StepOutput:
    """One StepOutput in chunk order from the outputs of parts of the `n` chunks (each part:
    its chunks' indices and its output)."""
    logits: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
    routed: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
    for idx, out in parts:
        for k, i in enumerate(idx):
            logits[i] = out.logits[k]
            if out.routed is not None:
                routed[i] = out.routed[k]
    recorded = parts[0][1].routed is not None
    return StepOutput(torch.cat(logits), [len(x) for x in logits], routed if recorded else None)


@overload
def _longs(values: list[int], /) -> torch.Tensor: ...
@overload
def _longs(
    first: list[int], second: list[int], /, *more: list[int]
) -> tuple[torch.Tensor, ...]: ...
def _longs(*lists: list[int]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """int64 tensors from equally long int lists, in one copy (torch.tensor(list) is slow)."""
    flat = array.array("q", lists[0] if len(lists) == 1 else itertools.chain(*lists))
    t = torch.frombuffer(flat, dtype=torch.long)
    return t if len(lists) == 1 else t.view(len(lists), -1).unbind(0)


def _mask(start_B: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """Causal mask over cached keys: query j of chunk b (position start_b + j) sees keys <= it."""
    qpos_BQ = start_B[:, None] + torch.arange(q_len)[None, :]
    return torch.arange(k_len)[None, None, :] <= qpos_BQ[:, :, None]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; the same numbers as HF's in fp32
        return w * F.rms_norm(x, x.shape[-1:], eps=eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)
