"""The machinery shared by every architecture's bridge.

Legend: H hidden, V vocab (Vp padded), d head dim, nq query heads, nkv key/value heads (query
groups), F ffn size, E experts.

A `Layout` says how one Megatron parameter is built from its HF tensors and split over TP:
- REPLICATED: norms, the router; every rank holds the whole tensor.
- COLUMN: split along dim 0 (output features).
- ROW: split along dim 1 (input features).
- VOCAB: COLUMN over a vocabulary padded to Vp with zero rows (dropped again on export).
- QKV: q [nq*d, H], k and v [nkv*d, H] fused per query group, [nkv, (nq/nkv + 2) * d, H], then
  COLUMN: each TP rank holds whole groups (TP must divide nkv).
- GLU: gate and up [F, H] each; the full tensor is cat(gate, up) [2F, H], and TP rank r holds
  cat(gate_r, up_r), megatron's SwiGLU layout.
Expert parameters split over the expert-TP group instead of TP.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch


class Layout(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GLU = "glu"


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter (global names resolved) and the HF tensors behind it."""

    megatron_name: str  # chunk-local name
    hf_names: tuple[str, ...]
    layout: Layout
    expert: bool = False


@dataclass(frozen=True)
class Rule:
    pattern: str  # regex over the chunk-local megatron name; groups: layer, expert
    hf: tuple[str, ...]  # templates with {layer} and {expert}
    layout: Layout
    expert: bool = False


@dataclass
class Bridge:
    arch: str
    rules: tuple[Rule, ...]

    def __post_init__(self):
        self._compiled = [(re.compile(r.pattern + r"$"), r) for r in self.rules]

    def param_map(self, name: str, layer_ids: dict[int, int], expert_offset: int, tied: bool):
        """Map a chunk-local megatron name; `layer_ids` maps local -> global layer index."""
        for rx, rule in self._compiled:
            m = rx.match(name)
            if m is None:
                continue
            fields = m.groupdict()
            layer = layer_ids[int(fields["layer"])] if "layer" in fields else None
            expert = int(fields["expert"]) + expert_offset if "expert" in fields else None
            hf = tuple(t.format(layer=layer, expert=expert) for t in rule.hf)
            if tied and hf == ("lm_head.weight",):
                hf = ("model.embed_tokens.weight",)
            return ParamMap(name, hf, rule.layout, rule.expert)
        raise KeyError(f"no {self.arch} mapping for megatron parameter {name!r}")


# ---- full (unsharded) tensors <-> HF tensors -------------------------------------------------


def merge(
    pm: ParamMap, hf: list[torch.Tensor], *, num_heads: int, num_kv_heads: int, padded_vocab: int
) -> torch.Tensor:
    """HF tensors -> the full megatron tensor."""
    if pm.layout is Layout.QKV:
        return fuse_qkv(*hf, num_heads=num_heads, num_kv_heads=num_kv_heads)
    if pm.layout is Layout.GLU:
        return torch.cat(hf, dim=0)
    (t,) = hf
    if pm.layout is Layout.VOCAB and t.shape[0] < padded_vocab:
        pad = t.new_zeros((padded_vocab - t.shape[0], *t.shape[1:]))
        t = torch.cat([t, pad], dim=0)
    return t


def split(
    pm: ParamMap, full: torch.Tensor, *, num_heads: int, num_kv_heads: int, vocab: int
) -> list[torch.Tensor]:
    """The full megatron tensor -> HF tensors, in `pm.hf_names` order."""
    if pm.layout is Layout.QKV:
        return list(unfuse_qkv(full, num_heads=num_heads, num_kv_heads=num_kv_heads))
    if pm.layout is Layout.GLU:
        return list(full.chunk(2, dim=0))
    if pm.layout is Layout.VOCAB:
        return [full[:vocab]]
    return [full]


def fuse_qkv(q, k, v, *, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[nq*d, ...], [nkv*d, ...] x2 -> [nkv * (nq/nkv + 2) * d, ...], grouped per kv head."""
    g = num_kv_heads
    rest = q.shape[1:]
    qg = q.reshape(g, -1, *rest)
    kg = k.reshape(g, -1, *rest)
    vg = v.reshape(g, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def unfuse_qkv(qkv, *, num_heads: int, num_kv_heads: int):
    g = num_kv_heads
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    per_group = num_heads // g * d
    grouped = qkv.reshape(g, -1, *rest)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


# ---- full tensors <-> TP shards --------------------------------------------------------------


def shard(layout: Layout, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor."""
    if size == 1 or layout is Layout.REPLICATED:
        return full
    if layout is Layout.ROW:
        return full.chunk(size, dim=1)[rank]
    if layout is Layout.GLU:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=0)[rank]  # COLUMN, VOCAB, QKV


def unshard(layout: Layout, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` given every rank's slice, in rank order."""
    if len(shards) == 1 or layout is Layout.REPLICATED:
        return shards[0]
    if layout is Layout.ROW:
        return torch.cat(shards, dim=1)
    if layout is Layout.GLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)
