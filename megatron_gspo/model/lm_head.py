"""The LM head a chunk of tokens at a time: log p(target) and the entropy from hidden states and
the output weight, without the logits or their gradient ever existing whole.

Legend: N tokens (flat), H hidden, V this rank's slice of the padded vocabulary (V_valid of it
real), C tokens per chunk.

Deviation from megatron's GPTModel, on purpose: its output layer forms the logits [N, V] and
autograd keeps them and their gradient, the largest tensors of the step (Qwen3-30B-A3B:
151,936 x 32k tokens = 10 GB each in bf16). With the chunked head the output layer hands back
its (TP-replicated) hidden states instead (`use_chunked_lm_head`) and `ChunkedLMHead` computes,
chunk by chunk,

    x_CV = h_CH W_VH^T    ->   per-token statistics (model/vocab_softmax.py), combined over TP
                               with one MAX and one SUM all-reduce after the last chunk

saving only h, W and three numbers per token. Backward recomputes each chunk's logits, forms
their gradient dx_CV, and from it grad_h_CH = dx_CV W_VH and grad_W_VH += dx_CV^T h_CH
(accumulated in fp32: into megatron DDP's main_grad of an untied weight, as megatron's own
gradient-accumulation fusion does, else a fp32 buffer) before the next chunk. Peak extra
memory: a chunk's logits and three temporaries (C x V x 12 bytes with the entropy).

Where a call's whole logits are small (N x V x bytes <= `keep_bytes`, default 256 MiB: a small
vocabulary or few tokens), the forward keeps them for the backward instead, which then skips
one of its three GEMMs per chunk (the recomputation: a third of the head's backward FLOPs).
At Qwen3's vocabulary 256 MiB is ~880 bf16 tokens, so a real microbatch recomputes; at a
vocabulary of 8k it is 8k fp32 tokens, and the TRL comparison's small model keeps them.

TP: W is split over the vocabulary (ColumnParallelLinear). The hidden states entering the head
must be every rank's same full sequence, as megatron's layer makes them: all-gathered along the
sequence under sequence parallelism (backward: reduce-scatter), else copied (backward: the
all-reduce of the partial grad_h each rank forms from its vocabulary slice). grad_W needs no
communication: each rank's slice sees every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from megatron_gspo.gemm_rows import MIN_GEMM_ROWS
from megatron_gspo.model.modes import DEFAULT_CHUNK_TOKENS, DEFAULT_KEEP_MB
from megatron_gspo.model.vocab_softmax import (
    chunk_grad,
    chunk_stats,
    combine,
    row_chunks,
    target_columns,
)

# The defaults (tokens per chunk, and logits kept up to DEFAULT_KEEP_MB) live in model/modes.py,
# where the run config reads them without importing torch.
DEFAULT_KEEP_BYTES = DEFAULT_KEEP_MB << 20


@dataclass(frozen=True)
class HeadCall:
    """What `ChunkedLMHead` needs besides its tensors."""

    vocab_start: int  # this rank's first vocabulary id
    n_valid: int  # rows of this rank's weight that are real vocabulary (the rest: padding)
    tp_group: object  # None: one rank
    with_entropy: bool
    chunk_tokens: int
    into_main_grad: bool = False
    keep_logits: bool = False  # the forward keeps the logits for the backward


class ChunkedLMHead(torch.autograd.Function):
    """(h [N, H], W [V, H], targets [N], how, rows) -> (log p(targets), entropy or None), fp32
    [N]; with `rows` (a `RowPlan`) only the planned rows are computed, the others give 0."""

    @staticmethod
    def forward(ctx, h, weight, targets, how: HeadCall, plan: RowPlan):
        n_valid = how.n_valid
        w = weight[:n_valid]  # padded vocabulary rows: no logits, zero gradient
        hs, ts = plan.take(h), plan.take(targets)
        index, owned = target_columns(ts, how.vocab_start, n_valid)
        stats = torch.empty((3 if how.with_entropy else 2, ts.numel()), device=h.device)
        kept = h.new_empty((hs.shape[0], n_valid)) if how.keep_logits else None
        for _, r, _ in plan.parts:
            x = torch.matmul(hs[r], w.t(), out=None if kept is None else kept[r])
            chunk_stats(x, index[r], owned[r], how.with_entropy, stats[:, r])
            del x
        lp, entropy, log_w = combine(stats, owned, how.tp_group)
        ctx.save_for_backward(h, weight, index, owned, log_w, entropy, kept)
        ctx.n_valid, ctx.plan, ctx.into_main_grad = n_valid, plan, how.into_main_grad
        ctx.set_materialize_grads(False)
        return plan.spread(lp), (None if entropy is None else plan.spread(entropy))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, weight, index, owned, log_w, entropy, kept = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        n_valid, plan = ctx.n_valid, ctx.plan
        w = weight[:n_valid]
        hs = plan.take(h) if kept is None else None  # (recomputing the logits)
        grad_hs = h.new_empty((plan.count, h.shape[1])) if need_h else None
        grad_w = _weight_grad_buffer(weight, ctx.into_main_grad) if need_w else None
        g_lp, g_ent = (None if g is None else plan.take(g.float()) for g in (g_lp, g_ent))
        for chunk, r, local in plan.parts:
            x = torch.matmul(hs[r], w.t()) if kept is None else kept[r]
            dx = torch.empty_like(x)
            chunk_grad(x, index[r], owned[r], log_w[r], _at(entropy, r), _at(g_lp, r),
                       _at(g_ent, r), dx)  # fmt: skip
            del x
            if need_h:
                torch.matmul(dx, w, out=grad_hs[r])
            if grad_w is not None:  # over the whole chunk: rows not computed add zeros
                accumulate_fp32(grad_w[:n_valid], plan.whole(dx, chunk, local).t(), h[chunk])
        grad_h = plan.spread(grad_hs) if need_h else None
        if grad_w is not None and grad_w is getattr(weight, "main_grad", None):
            # Added where megatron's DDP would add it; its hook skips the placeholder returned.
            weight.grad_added_to_main_grad = True
            grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        elif grad_w is not None and weight.dtype != torch.float32:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


@dataclass(frozen=True)
class RowPlan:
    """The rows of [N] the head computes (`rows`, ascending; None: all N) and its chunks: per
    chunk of the whole rows (`row_chunks`), (that chunk, its computed rows' range in the computed
    ones, their positions in the chunk or None where it computes the chunk whole).

    A chunk computes a selection of at least `MIN_GEMM_ROWS` rows, else the chunk whole (or
    nothing where none is selected), so every computed row's logits and gradient are bit for
    bit those of the head without a selection; the weight's gradient is formed over the whole
    chunk (zeros at rows not computed, whose log-probs must then have no gradient: the loss's
    masked positions), as its sum over the chunk's rows would round otherwise."""

    n: int
    rows: torch.Tensor | None
    parts: tuple[tuple[slice, slice, torch.Tensor | None], ...]

    @property
    def count(self) -> int:
        return self.n if self.rows is None else int(self.rows.numel())

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The computed rows of an [N, ...] tensor."""
        return t if self.rows is None else t.index_select(0, self.rows.to(t.device))

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        """Computed rows [count, ...] -> [N, ...], zeros at the rows not computed."""
        if self.rows is None:
            return t
        out = t.new_zeros((self.n, *t.shape[1:]))
        return out.index_copy_(0, self.rows.to(t.device), t)

    @staticmethod
    def whole(dx: torch.Tensor, chunk: slice, local: torch.Tensor | None) -> torch.Tensor:
        """A chunk's computed rows `dx` as the whole chunk's (zero rows where not computed)."""
        if local is None:
            return dx
        full = dx.new_zeros((chunk.stop - chunk.start, dx.shape[1]))
        return full.index_copy_(0, local.to(dx.device), dx)


def plan_rows(n: int, width: int, device, chunk_tokens: int, rows=None) -> RowPlan:
    """The `RowPlan` of `rows` (ascending positions in [0, n); None: all) over chunks of
    `chunk_tokens` rows of the [n, width] logits."""
    chunks = list(row_chunks(n, width, device, chunk_tokens))
    if rows is None:
        return RowPlan(n, None, tuple((c, c, None) for c in chunks))
    rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
    starts = torch.tensor([c.start for c in chunks] + [n], dtype=torch.int64)
    bounds = torch.searchsorted(rows, starts).tolist()
    picked, parts, at = [], [], 0
    for c, lo, hi in zip(chunks, bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        size, local = c.stop - c.start, rows[lo:hi] - c.start
        if hi - lo >= size or min(hi - lo, size) < MIN_GEMM_ROWS:
            local_or_none, chosen = None, torch.arange(c.start, c.stop)
        else:
            local_or_none, chosen = local, local + c.start
        parts.append((c, slice(at, at + len(chosen)), local_or_none))
        picked.append(chosen)
        at += len(chosen)
    if at == n:
        return RowPlan(n, None, tuple((c, c, None) for c in chunks))
    selected = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)
    return RowPlan(n, selected, tuple(parts))


def _weight_grad_buffer(weight, into_main_grad: bool):
    """Where grad_W accumulates in fp32: megatron DDP's main_grad buffer of the weight when
    allowed (no fp32 copy of W, no add afterwards), else a zeroed fp32 tensor."""
    main = getattr(weight, "main_grad", None)
    usable = main is not None and main.dtype == torch.float32 and main.shape == weight.shape
    if into_main_grad and usable and hasattr(weight, "grad_added_to_main_grad"):
        return main
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def accumulate_fp32(acc, a, b) -> None:
    """acc (fp32) += a @ b. A bf16 product goes to fp32 inside the GEMM where the backend has
    such a GEMM (CUDA), else its bf16 result is added (one rounding per chunk)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            pass
    acc.add_(a @ b)


def _at(t, rows):
    return None if t is None else t[rows]


def lm_head_logprobs(  # noqa: PLR0913 - three tensors, then keyword-only options
    h, weight, targets, *, vocab_start: int = 0, vocab_size: int | None = None,
    tp_group=None, with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    into_main_grad: bool = False, keep_bytes: int = DEFAULT_KEEP_BYTES, rows=None,
):  # fmt: skip
    """log p(targets) (and the entropy, else None) from hidden states h [..., H] and this rank's
    output weight [V, H] (vocabulary ids from `vocab_start`; `vocab_size` the true size). fp32,
    shaped like `targets` ([...]). `into_main_grad`: grad_W goes straight into megatron DDP's
    fp32 `main_grad` of the weight, which must then have no other use in the graph (an
    embedding tied to it would have its own gradient skipped by DDP's hook). `keep_bytes`: a
    backward's logits up to this size are kept from the forward, not recomputed (0: never).
    `rows`: the positions of the flat [N] tokens (ascending) whose log-probs are wanted; the head
    computes those only (`RowPlan`), giving 0 elsewhere, where the caller's loss must then have
    no gradient (None: all)."""
    import torch.distributed as dist

    n_valid = weight.shape[0] if vocab_size is None else vocab_size - vocab_start
    n_valid = min(max(n_valid, 0), weight.shape[0])
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    flat_h = h.reshape(-1, h.shape[-1])
    plan = plan_rows(flat_h.shape[0], n_valid, flat_h.device, chunk_tokens, rows)
    backward = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    keep = backward and plan.count * n_valid * h.element_size() <= keep_bytes
    how = HeadCall(vocab_start, n_valid, tp_group, with_entropy, chunk_tokens, into_main_grad,
                   keep_logits=keep)  # fmt: skip
    lp, ent = ChunkedLMHead.apply(flat_h, weight, targets.reshape(-1), how, plan)
    return lp.view(targets.shape), (None if ent is None else ent.view(targets.shape))


@dataclass(frozen=True)
class LMHead:
    """One model chunk's output weight under megatron's TP group, as the loss uses it."""

    weight: torch.Tensor  # [V, H], this TP rank's slice
    vocab_size: int  # the true vocabulary (padding excluded)
    chunk_tokens: int
    into_main_grad: bool = False  # the weight is the head's alone (not tied to the embedding)
    keep_bytes: int = DEFAULT_KEEP_BYTES  # logits up to this size are not recomputed

    def logprobs(self, hidden, targets, with_entropy: bool = False, rows=None):
        """(log p(targets), entropy or None) from the output layer's hidden states [..., H];
        `rows`: only these flat positions (`lm_head_logprobs`)."""
        from megatron.core import parallel_state as mpu

        return lm_head_logprobs(
            hidden, self.weight, targets,
            vocab_start=mpu.get_tensor_model_parallel_rank() * self.weight.shape[0],
            vocab_size=self.vocab_size, tp_group=mpu.get_tensor_model_parallel_group(),
            with_entropy=with_entropy, chunk_tokens=self.chunk_tokens,
            into_main_grad=self.into_main_grad, keep_bytes=self.keep_bytes, rows=rows,
        )  # fmt: skip


def lm_head_of(chunk) -> LMHead | None:
    """The chunked head of a (DDP-wrapped) model chunk; None where its output layer gives logits
    (the head off) or it has none (not the last pipeline stage)."""
    model = getattr(chunk, "module", chunk)
    layer = getattr(model, "output_layer", None)
    tokens = getattr(layer, "lm_head_chunk_tokens", 0)
    if layer is None or not tokens or not getattr(model, "post_process", False):
        return None
    tied = model.share_embeddings_and_output_weights
    weight = model.shared_embedding_or_output_weight() if tied else layer.weight
    # use_chunked_lm_head sets the keep bound with the chunk size
    return LMHead(weight, model.model_spec.vocab_size, tokens, into_main_grad=not tied,
                  keep_bytes=layer.lm_head_keep_bytes)  # fmt: skip


def use_chunked_lm_head(output_layer, chunk_tokens: int, keep_mb: int = DEFAULT_KEEP_MB) -> None:
    """Have megatron's output layer hand back its hidden states, [s, b, H] as a view of
    [b, s - logits_from, H] (GPTModel's `transpose(0, 1).contiguous()` then copies nothing),
    gathered over TP as its matmul would have; `LMHead` takes the log-probs from them."""

    def hidden_states(input_, weight=None, runtime_gather_output=None):
        h = head_input(input_, output_layer.sequence_parallel, output_layer.logits_from)
        return h.transpose(0, 1), None

    output_layer.logits_from = 0
    output_layer.lm_head_chunk_tokens = chunk_tokens
    output_layer.lm_head_keep_bytes = keep_mb << 20
    output_layer.forward = hidden_states


def head_input(h_SBH, sequence_parallel: bool, start: int = 0):
    """The hidden states every TP rank's vocabulary slice needs, batch-major [b, s - start, H]
    from the decoder's [s, b, H] (its sequence split over TP under sequence parallelism), with
    megatron's mappings: all-gather along the sequence (backward: reduce-scatter), else a copy
    (backward: all-reduce of the partial gradients). The copy is applied to the contiguous
    batch-major tensor, whose gradient (the head's) is contiguous: megatron's all-reduce
    reduces `grad.contiguous()` and returns `grad`, so a strided gradient would stay unreduced."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp > 1 and sequence_parallel:
        h_SBH = gather_from_sequence_parallel_region(h_SBH, tensor_parallel_output_grad=True)
    h_BSH = h_SBH[start:].transpose(0, 1).contiguous()
    if tp > 1 and not sequence_parallel:
        h_BSH = copy_to_tensor_model_parallel_region(h_BSH)
    return h_BSH
