"""LoRA adapters on Megatron's parallel linears and per-expert MLPs, inside the parallel step.

A targeted linear computes y = W x + s * B A dropout(x), s = alpha / rank, with W frozen and only
A [rank, in] and B [out, rank] trained (B starts at zero, so step 0 is the base policy). Which
factor is sharded follows the base weight's split over its tensor-parallel group (size tp):

  column-parallel W_t [out/tp, in]: A replicated, B_t [out/tp, r] sharded (dim 0)
      no SP: h = A x (x replicated) -> copy_to_tp (backward all-reduce: dh = sum_t B_t^T g_t)
             -> y_t = B_t h. dA and dx are then full on every rank; x's own backward all-reduce
             belongs to the base path, so the LoRA path adds its full dx directly.
      SP:    h = A x_local -> all-gather over the sequence (backward reduce-scatter) -> B_t h.
             dA is a partial sum over the sequence shards: A is tagged `sequence_parallel`, so
             megatron's finalize_model_grads all-reduces it over TP (as it does LayerNorm's).
  row-parallel W_t [out, in/tp]: A_t [r, in/tp] sharded (dim 1), B replicated
      no SP: h = all_reduce_t(A_t x_t) (backward identity) -> y = B h (replicated, as W's).
      SP:    h = reduce_scatter_seq(A_t x_t) (backward all-gather) -> y = B h_local. dB is a
             partial sum over the sequence shards: B is tagged `sequence_parallel`.
  expert linears (SequentialMLP; the token dispatcher owns the communication): with expert-TP 1
      a plain local product. With expert-TP e > 1 the dispatcher hands every expert-TP rank the
      same tokens (it reduce-scatters their gradient) and sums fc2's partial outputs (its
      backward all-gathers): fc1: h = A x, dh all-reduced over the group, and dx scaled by 1/e
      in backward only (the dispatcher sums the e identical copies); fc2: h = all_reduce(A_t
      x_t), y = B h / e in forward only (the dispatcher sums e copies; B's gradient stays g h^T).

Fused megatron weights carry one adapter per HF module, as PEFT puts them (so a PEFT adapter is
the same function): linear_qkv holds q, k, v parts (three A blocks, three B's, rows interleaved
per query group like the weight), a dense linear_fc1 holds gate and up. An expert's fc1 holds one
A and a B over [gate; up] (HF's fused `gate_up_proj` 3-D parameter, which PEFT adapts per
expert through `target_parameters`). Every part's B is stored in HF row order, split by rows
over TP; the whole adapter's B is assembled block-diagonally: out = B_blk (A_stack x), B_blk
[out_local, n_blocks * r].

Adapters are registered as siblings of their base linear (`linear_qkv_lora` next to
`linear_qkv`), so the base's parameter names, its sharded checkpoint and the HF bridge are
untouched; a forward hook on the base adds the LoRA term. The base weight carries a reference
to its adapter (`lora_adapter`), which `merged_weight` uses to give W + s * B A for weight sync
and export. An adapter shared by a layer's experts (`lora.experts: shared`) is registered once
on the MoE layer (`experts_fc1_lora`, `experts_fc2_lora`) and hooked on every local expert's
linear, whose weights all carry it. Initial A is drawn from a generator seeded by the adapter's
global name, then sliced, so every parallel layout starts from the same adapters.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from megatron_gspo.errors import UserError
from megatron_gspo.model.bridge.base import fuse_qkv
from megatron_gspo.model.lora_config import LoraConfig


class Rows(enum.Enum):
    """How the parts' B rows make the base weight's rows."""

    ONE = "one"
    QKV = "qkv"  # interleaved per query group (bridge.base.fuse_qkv)
    GLU = "glu"  # [gate; up]


class Kind(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"


@dataclass(frozen=True)
class Site:
    """Where an adapter sits: its global name (HF-independent, layout-independent), its kind,
    and its parts: (A block, full out rows) per B, in HF order."""

    name: str
    kind: Kind
    rows: Rows
    parts: tuple[tuple[int, int], ...]
    in_full: int
    groups: int = 1  # query groups (Rows.QKV)
    shared_by: int = 0  # an adapter shared by the layer's experts: their number (else 0)


class LoraAdapter(nn.Module):
    """The trainable factors of one targeted linear (see the module docstring for the math)."""

    def __init__(self, base: nn.Module, site: Site, cfg: LoraConfig, seed: int,
                 weight: torch.Tensor | None = None):  # fmt: skip
        """`base`: the adapted module (its TP group, SP flag); `weight`: its weight (dtype,
        device), `base.weight` unless given (grouped experts hold theirs as weight1/weight2)."""
        super().__init__()
        self.site, self.r, self.scale = site, cfg.rank, cfg.scale
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.group = _tp_group(base, site)
        self.tp, self.tp_rank = self.group.size(), self.group.rank()
        self.sp = bool(getattr(base, "sequence_parallel", False)) and site.kind in (
            Kind.COLUMN,
            Kind.ROW,
        )
        weight = base.weight if weight is None else weight  # type: ignore[assignment]
        row_split = site.kind in (Kind.ROW, Kind.EXPERT_ROW)
        blocks = 1 + max(a for a, _ in site.parts)
        a_full = _init_a(blocks * self.r, site.in_full, seed, site.name, weight.device)
        a = a_full.chunk(self.tp, dim=1)[self.tp_rank] if row_split else a_full
        self.A = nn.Parameter(a.to(weight.dtype).contiguous())
        self.B = nn.ParameterList(
            nn.Parameter(weight.new_zeros(out // (1 if row_split else self.tp), self.r))
            for _, out in site.parts
        )
        self._tag(weight, row_split)

    def _tag(self, weight: torch.Tensor, row_split: bool) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        sharded = [self.A] if row_split else list(self.B)
        for p in sharded:
            set_tensor_model_parallel_attributes(p, True, 1 if row_split else 0, 1)
        replicated = list(self.B) if row_split else [self.A]
        for p in replicated:
            p.sequence_parallel = self.sp  # type: ignore[union-attr,attr-defined]  # SP: partial sums
        # allreduce False: an expert's param under EP (DDP's mark); an adapter shared by the
        # experts of every EP rank is a dense parameter
        dense = self.site.shared_by > 0 or getattr(weight, "allreduce", True)
        for p in self.parameters():
            p.allreduce = dense  # type: ignore[attr-defined]

    def b_block(self) -> torch.Tensor:
        """B_blk [out_local, blocks * r]: each part's B in its A block's columns, rows in the
        base weight's local order."""
        blocks = self.A.shape[0] // self.r
        parts = []
        for (blk, _), b in zip(self.site.parts, self.B):
            cols = [b if j == blk else b.new_zeros(b.shape) for j in range(blocks)]
            parts.append(torch.cat(cols, dim=1) if blocks > 1 else b)
        if self.site.rows is Rows.QKV:
            nq, nkv = _qkv_heads(self.site, self.tp)
            return fuse_qkv(*parts, num_heads=nq, num_kv_heads=nkv)
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]

    def delta_weight(self) -> torch.Tensor:
        """s * B A, this rank's shard of the base weight's shape."""
        return self.scale * (self.b_block() @ self.A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as tpm

        x = self.dropout(x)
        kind, g = self.site.kind, self.group
        if kind is Kind.COLUMN:
            h = x @ self.A.t()
            if self.sp:
                h = tpm.gather_from_sequence_parallel_region(h, True, group=g)
            elif self.tp > 1:
                h = tpm.copy_to_tensor_model_parallel_region(h, group=g)
            return self.scale * (h @ self.b_block().t())
        if kind is Kind.ROW:
            h = x @ self.A.t()
            if self.sp:
                h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=g)
            elif self.tp > 1:
                h = tpm.reduce_from_tensor_model_parallel_region(h, group=g)
            return self.scale * (h @ self.b_block().t())
        if kind is Kind.EXPERT_COLUMN:
            if self.tp > 1:
                x = _ScaleGrad.apply(x, 1.0 / self.tp)
                h = tpm.copy_to_tensor_model_parallel_region(x @ self.A.t(), group=g)
            else:
                h = x @ self.A.t()
            return self.scale * (h @ self.b_block().t())
        h = x @ self.A.t()
        if self.tp > 1:
            h = tpm.reduce_from_tensor_model_parallel_region(h, group=g)
            return _ScaleForward.apply(self.scale * (h @ self.b_block().t()), 1.0 / self.tp)
        return self.scale * (h @ self.b_block().t())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Dist-checkpoint entries: sharded factors split along their TP dim, the rest
        replicated (megatron's own helper; expert offsets come from SequentialMLP)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        if self.site.kind in (Kind.ROW, Kind.EXPERT_ROW):
            axes = {"A": 1}
        else:
            axes = {f"B.{i}": 0 for i in range(len(self.B))}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `k` (one of k identical copies is summed)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class _ScaleForward(torch.autograd.Function):
    """Forward times `k` (k copies are summed downstream); the gradient passes unscaled."""

    @staticmethod
    def forward(ctx, x, k):
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g, None


def _tp_group(base: nn.Module, site: Site):
    """The base linear's TP group (expert-TP for experts); TE wrappers may not keep one."""
    group = getattr(base, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state as mpu

    if site.kind in (Kind.EXPERT_COLUMN, Kind.EXPERT_ROW):
        return mpu.get_expert_tensor_parallel_group()
    return mpu.get_tensor_model_parallel_group()


def _init_a(rows: int, cols: int, seed: int, name: str, device) -> torch.Tensor:
    """Kaiming-uniform (a = sqrt(5), PEFT's and nn.Linear's default), seeded by the name."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(cols)  # kaiming_uniform with a=sqrt(5): sqrt(6/((1+5) fan_in))
    a = (torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    return a.to(device)


def _qkv_heads(site: Site, tp: int) -> tuple[int, int]:
    q_rows, kv_rows = site.parts[0][1], site.parts[1][1]
    d = kv_rows // site.groups
    return q_rows // d // tp, site.groups // tp


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """W + s * B A for a base weight with an adapter (this rank's shard), else W itself."""
    adapter = getattr(param, "lora_adapter", None)
    w = param.detach()
    if adapter is None:
        return w
    with torch.no_grad():
        return w + adapter.delta_weight().to(w.dtype)


def has_adapter(param: torch.Tensor) -> bool:
    return getattr(param, "lora_adapter", None) is not None


def is_lora_param(name: str) -> bool:
    return "_lora." in name


def attach(parent: nn.Module, child: str, site: Site, cfg: LoraConfig, seed: int) -> LoraAdapter:
    """Put an adapter on `parent.<child>` (a megatron linear returning (out, bias))."""
    base = getattr(parent, child)
    adapter = LoraAdapter(base, site, cfg, seed)
    parent.add_module(f"{child}_lora", adapter)
    _hook(base, adapter)
    return adapter


def attach_shared(owner: nn.Module, name: str, bases: list[nn.Module], site: Site,
                  cfg: LoraConfig, seed: int) -> LoraAdapter:  # fmt: skip
    """One adapter, registered on `owner` as `name`, added to every linear of `bases` (the
    layer's local experts' fc1 or fc2)."""
    adapter = LoraAdapter(bases[0], site, cfg, seed)
    owner.add_module(name, adapter)
    for base in bases:
        _hook(base, adapter)
    return adapter


def attach_grouped(experts: nn.Module, owner: nn.Module, fc: str, site: Site, cfg: LoraConfig,
                   seed: int) -> LoraAdapter:  # fmt: skip
    """A shared adapter on grouped experts' fc1 or fc2 (`fc`): registered on `owner` (the MoE
    layer) as `experts_{fc}_lora`, called by the experts' forward (model/experts.py) on all of
    their tokens, and carried by the grouped weight (weight1 / weight2) for merging."""
    weight = experts.weight1 if fc == "fc1" else experts.weight2
    adapter = LoraAdapter(experts, site, cfg, seed, weight=weight)
    owner.add_module(f"experts_{fc}_lora", adapter)
    experts.lora[fc] = adapter
    weight.lora_adapter = adapter
    return adapter


def _hook(base: nn.Module, adapter: LoraAdapter) -> None:
    base.weight.lora_adapter = adapter

    def hook(module, args, output):
        out, bias = output
        return out + adapter(_adapter_input(module, args[0])).to(out.dtype), bias

    base.register_forward_hook(hook)


def _adapter_input(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input the base weight multiplies: Transformer Engine's LayerNorm-fused column linear
    normalizes inside, so its RMSNorm (weight, eps; zero-centred gamma) is applied here."""
    w: torch.Tensor | None = getattr(base, "layer_norm_weight", None)
    if w is None:
        return x
    if getattr(base, "normalization", "RMSNorm") != "RMSNorm":
        raise UserError("LoRA on a LayerNorm-fused linear supports RMSNorm only")
    gamma = w + 1 if getattr(base, "zero_centered_gamma", False) else w
    xf = x.float()
    eps: float = getattr(base, "eps", 1e-6)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * gamma.float()).to(x.dtype)
