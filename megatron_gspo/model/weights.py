"""Move weights between HF tensors and this rank's Megatron model chunks, through the bridge.

`local_params` resolves every parameter of every chunk to its `ParamMap` (global layer and expert
indices). `load_hf` fills the chunks from an HF reader, each rank reading only the tensors it
needs. `iter_hf` yields full HF tensors gathered over TP / expert-TP one parameter at a time, so
the extra memory is one full tensor; conversion and weight sync both consume it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.model.bridge import get_bridge
from megatron_gspo.model.bridge.base import Layout, ParamMap, merge, shard, split, unshard


@dataclass
class LocalParam:
    chunk: int
    param: torch.nn.Parameter
    map: ParamMap


@dataclass(frozen=True)
class ShardInfo:
    """Where a parameter's TP slices live and which rank writes it out."""

    group: object  # the TP (or expert-TP) process group
    rank: int
    size: int
    writer: bool  # TP-rank 0 of the first data-parallel replica


def local_params(chunks) -> list[LocalParam]:
    from megatron.core import parallel_state as mpu

    spec = chunks[0].model_spec
    bridge = get_bridge(spec.arch)
    ep_rank = mpu.get_expert_model_parallel_rank()
    local_experts = (
        spec.num_experts // mpu.get_expert_model_parallel_world_size() if spec.is_moe else 0
    )
    out = []
    for i, chunk in enumerate(chunks):
        layer_ids = {j: layer.layer_number - 1 for j, layer in enumerate(chunk.decoder.layers)}
        for name, p in chunk.named_parameters():
            pm = bridge.param_map(name, layer_ids, ep_rank * local_experts, spec.tie_embeddings)
            out.append(LocalParam(i, p, pm))
    return out


def shard_info(pm: ParamMap) -> ShardInfo:
    from megatron.core import parallel_state as mpu

    if pm.expert:
        return ShardInfo(
            mpu.get_expert_tensor_parallel_group(),
            mpu.get_expert_tensor_parallel_rank(),
            mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_expert_tensor_parallel_rank() == 0 and mpu.get_expert_data_parallel_rank() == 0,
        )
    return ShardInfo(
        mpu.get_tensor_model_parallel_group(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0,
    )


def _geometry(chunks) -> dict:
    spec = chunks[0].model_spec
    return dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)


@torch.no_grad()
def load_hf(chunks, reader) -> None:
    """Fill this rank's parameters from HF tensors (exact: a dtype cast only if they differ)."""
    geo = _geometry(chunks)
    padded = chunks[0].padded_vocab_size
    for lp in local_params(chunks):
        full = merge(lp.map, [reader.get(n) for n in lp.map.hf_names], padded_vocab=padded, **geo)
        info = shard_info(lp.map)
        local = shard(lp.map.layout, full, info.rank, info.size)
        if local.shape != lp.param.shape:
            raise ValueError(
                f"{lp.map.hf_names} give {tuple(local.shape)} for {lp.map.megatron_name} "
                f"{tuple(lp.param.shape)}: checkpoint and config disagree"
            )
        # Take the tensor over instead of copying into the freshly built one (a checkpoint-sized
        # copy saved); a slice of a larger tensor is copied so it does not pin the rest.
        owns_storage = local.untyped_storage().nbytes() == local.numel() * local.element_size()
        lp.param.data = (
            local.to(lp.param.dtype) if owns_storage else local.to(lp.param.dtype, copy=True)
        )


@torch.no_grad()
def gather_full(lp: LocalParam, info: ShardInfo) -> torch.Tensor:
    """The full megatron tensor of one parameter, gathered over its TP group (on every member)."""
    t = lp.param.detach()
    if info.size == 1 or lp.map.layout is Layout.REPLICATED:
        return t
    parts = [torch.empty_like(t) for _ in range(info.size)]
    dist.all_gather(parts, t.contiguous(), group=info.group)
    return unshard(lp.map.layout, parts)


def iter_hf(chunks, *, only_writer: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for this rank's parameters.

    Every TP member takes part in the gather (a collective); with `only_writer` only the writer
    rank of each parameter yields it, so across all ranks each HF tensor is yielded exactly once.
    The tied output layer is skipped (the embedding carries it).
    """
    spec = chunks[0].model_spec
    geo = _geometry(chunks)
    for lp in local_params(chunks):
        if spec.tie_embeddings and lp.map.megatron_name == "output_layer.weight":
            continue
        info = shard_info(lp.map)
        full = gather_full(lp, info)
        if only_writer and not info.writer:
            continue
        yield from zip(lp.map.hf_names, split(lp.map, full, vocab=spec.vocab_size, **geo))
