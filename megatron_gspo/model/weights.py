"""Move weights between HF tensors and this rank's Megatron model chunks, through the bridge.

`local_params` resolves every parameter of every chunk to its `ParamMap` (global layer and expert
indices); a grouped experts' weight (one tensor for all local experts, model/experts.py) is
listed as its per-expert views under SequentialMLP's names, so everything below sees the same
names and shapes whichever experts the model was built with. `load_hf` fills the chunks from an
HF reader, each rank reading only the tensors it needs. `iter_hf` yields full HF tensors
gathered over TP / expert-TP one parameter at a time, so the extra memory is one full tensor;
weight sync consumes it.

Conversion moves tensors between the two formats without a model holding them:
`hf_sharded_state` is the model's own sharded state dict (so the checkpoint has exactly the keys,
shapes and shards the trainer's model expects) with every entry pointing at HF tensors instead of
parameters; a fused SwiGLU fc1 is stored as its gate and up halves anyway, so those are the HF
tensors themselves, never concatenated. `stored_params` / `read_stored` go the other way, from a
dist-checkpoint's keys to HF tensors.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.model.bridge import get_bridge
from megatron_gspo.model.bridge.base import Layout, ParamMap, merge, shard, split, unshard
from megatron_gspo.model.lora import is_lora_param, merged_weight

EXPERTS = ".mlp.experts.experts."  # SequentialMLP's checkpoint key: experts on a leading axis


@dataclass
class LocalParam:
    chunk: int
    param: torch.Tensor  # the parameter, or a per-expert view of a grouped experts' weight
    map: ParamMap

    @property
    def is_view(self) -> bool:
        return not isinstance(self.param, torch.nn.Parameter)


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
            if is_lora_param(name):  # adapters are merged into their base weight (lora.py)
                continue
            for view_name, t in _per_expert(name, p, local_experts, spec.hidden_size):
                pm = bridge.param_map(
                    view_name, layer_ids, ep_rank * local_experts, spec.tie_embeddings
                )
                out.append(LocalParam(i, t, pm))
    return out


def _per_expert(name: str, p, local_experts: int, hidden: int) -> list[tuple[str, torch.Tensor]]:
    from megatron_gspo.model.experts import expert_views, is_grouped

    if is_grouped(name):
        return expert_views(name, p, local_experts, hidden)
    return [(name, p)]


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
            raise UserError(
                f"{lp.map.hf_names} give {tuple(local.shape)} for {lp.map.megatron_name} "
                f"{tuple(lp.param.shape)}: checkpoint and config disagree"
            )
        if lp.is_view:  # one expert of a grouped weight: written in place
            lp.param.copy_(local)
            continue
        # Take the tensor over instead of copying into the freshly built one (a checkpoint-sized
        # copy saved); a slice of a larger tensor is copied so it does not pin the rest.
        owns_storage = local.untyped_storage().nbytes() == local.numel() * local.element_size()
        lp.param.data = local.to(lp.param.device, lp.param.dtype, copy=not owns_storage)


@torch.no_grad()
def gather_full(lp: LocalParam, info: ShardInfo) -> torch.Tensor:
    """The full megatron tensor of one parameter, gathered over its TP group (on every member);
    with a LoRA adapter, the merged W + s * B A."""
    t = merged_weight(lp.param)
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


# ---- conversion ------------------------------------------------------------------------------


@torch.no_grad()
def hf_sharded_state(chunks, reader) -> dict:
    """The chunks' sharded state dict with each entry's data taken from the HF tensors.

    Entries are matched to parameters by storage, so the chunks' parameters are never written
    (built with `perform_initialization=False` they are never even touched)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_gspo.model.checkpoint import sharded_model_state

    params = local_params(chunks)
    if any(lp.is_view for lp in params):
        raise ValueError("conversion builds sequential experts (moe_grouped_gemm=False)")
    state = sharded_model_state(chunks)
    apply_factories(state)
    owners = {lp.param.untyped_storage().data_ptr(): lp for lp in params}
    kw = dict(_geometry(chunks), padded_vocab=chunks[0].padded_vocab_size)
    for sh in nested_values(state):
        if not isinstance(sh, ShardedTensor):
            continue
        lp = owners.get(sh.data.untyped_storage().data_ptr())
        if lp is None:
            raise ValueError(f"{sh.key} of the sharded state dict is not a model parameter")
        rows = _row_range(sh.data, lp.param)
        data = _hf_rows(lp, reader, rows, **kw).to(lp.param.dtype)
        if data.shape != sh.data.shape:
            raise UserError(
                f"{lp.map.hf_names} give {tuple(data.shape)} for {lp.map.megatron_name} "
                f"{tuple(sh.data.shape)}: checkpoint and config disagree"
            )
        sh.data = data if data.is_contiguous() else data.contiguous()
    return state


def _row_range(view: torch.Tensor, param: torch.Tensor) -> tuple[int, int]:
    """Which rows of `param` the view (a whole parameter or a block of rows) covers."""
    if view.shape == param.shape:
        return 0, param.shape[0]
    row = param[0].numel()
    start = view.storage_offset() - param.storage_offset()
    if view.shape[1:] != param.shape[1:] or start % row or not view.is_contiguous():
        raise ValueError(f"unexpected view {tuple(view.shape)} of a {tuple(param.shape)} parameter")
    return start // row, start // row + view.shape[0]


def _hf_rows(lp: LocalParam, reader, rows, *, padded_vocab, **geo) -> torch.Tensor:
    """Rows [a, b) of this rank's slice of one parameter, made from its HF tensors."""
    a, b = rows
    info = shard_info(lp.map)
    if lp.map.layout is Layout.GLU:  # local = cat(gate_r, up_r): take the halves asked for
        n = lp.param.shape[0] // 2
        parts = []
        for i, name in enumerate(lp.map.hf_names):
            lo, hi = max(a, i * n), min(b, (i + 1) * n)
            if lo < hi:
                half = shard(Layout.COLUMN, reader.get(name), info.rank, info.size)
                parts.append(
                    half if (lo, hi) == (i * n, (i + 1) * n) else half[lo - i * n : hi - i * n]
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    hf = [reader.get(n) for n in lp.map.hf_names]
    local = shard(
        lp.map.layout, merge(lp.map, hf, padded_vocab=padded_vocab, **geo), info.rank, info.size
    )
    return local if (a, b) == (0, local.shape[0]) else local[a:b]


@dataclass(frozen=True)
class StoredParam:
    """One Megatron parameter in a dist-checkpoint: its key, its indices on the key's leading
    layer / expert axes (megatron stacks homogeneous layers on one, SequentialMLP experts on
    another), and its HF mapping."""

    key: str
    index: tuple[int, ...]
    map: ParamMap
    nbytes: int


def stored_params(reader, spec) -> list[StoredParam]:
    """Every parameter a dist-checkpoint holds, mapped to HF names (UserError if it does not
    fit `spec` or misses a tensor). A tied model has no output layer of its own (the embedding
    is it)."""
    bridge = get_bridge(spec.arch)
    layers = {i: i for i in range(spec.num_layers)}  # keys hold global layer numbers
    out = []
    for key in reader.keys():
        shape = reader.shape(key)
        itemsize = reader.tensors[key].properties.dtype.itemsize
        for index, name in _unstack(key, shape, spec):
            try:
                pm = bridge.param_map(name, layers, 0, spec.tie_embeddings)
            except KeyError:
                raise UserError(
                    f"dist-checkpoint tensor {key} does not fit the {spec.arch} model of its "
                    "config; was it made from another config?"
                ) from None
            if spec.tie_embeddings and name == "output_layer.weight":
                raise UserError(
                    "checkpoint and config disagree: tie_word_embeddings is true in config.json, "
                    "but the dist-checkpoint holds its own output layer; fix the config"
                )
            numel = int(torch.Size(shape[len(index) :]).numel())
            out.append(StoredParam(key, index, pm, itemsize * numel))
    _check_complete(out, spec)
    return out


def _unstack(key: str, shape, spec) -> list[tuple[tuple[int, ...], str]]:
    """(leading indices, megatron parameter name) of each parameter stored under `key`."""
    names = [((), key)]
    if re.match(r"decoder\.layers\.\D", key):  # homogeneous layers stacked on axis 0
        if shape[0] != spec.num_layers:
            raise UserError(f"{key} holds {shape[0]} layers, the model has {spec.num_layers}")
        names = [
            ((i,), key.replace("decoder.layers.", f"decoder.layers.{i}.", 1))
            for i in range(shape[0])
        ]
    if EXPERTS in key:
        axis = len(names[0][0])
        if shape[axis] != spec.num_experts:
            raise UserError(f"{key} holds {shape[axis]} experts, the model has {spec.num_experts}")
        names = [
            ((*index, e), name.replace(EXPERTS, f".mlp.experts.local_experts.{e}."))
            for index, name in names
            for e in range(shape[axis])
        ]
    return names


def _check_complete(params: list[StoredParam], spec) -> None:
    """Every layer is there with the same tensors as every other layer of its kind (dense /
    MoE), and so are the embedding and the final norm."""
    per_layer, top = defaultdict(set), set()
    for sp in params:
        for name in sp.map.hf_names:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", name)
            if m:
                per_layer[int(m[1])].add(m[2])
            else:
                top.add(name)
    kinds = spec.moe_layers or (False,) * spec.num_layers
    want = {}
    for layer in range(spec.num_layers):
        want.setdefault(kinds[layer], per_layer[layer])
        differ = want[kinds[layer]] ^ per_layer[layer]
        if differ:
            raise UserError(
                f"dist-checkpoint layer {layer} does not have the tensors of the other layers "
                f"({sorted(differ)[:3]}); it is incomplete"
            )
    needed = {"model.embed_tokens.weight", "model.norm.weight"}
    needed |= set() if spec.tie_embeddings else {"lm_head.weight"}
    if needed - top:
        raise UserError(f"dist-checkpoint lacks {sorted(needed - top)}; it is incomplete")


def read_stored(reader, sp: StoredParam, spec) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one stored parameter. A SwiGLU half or the unpadded vocabulary is read
    as its own region, so it comes back as stored, without a copy."""
    shape = reader.shape(sp.key)
    lead = sp.index
    inner = shape[len(lead) :]

    def rows(a: int, b: int) -> torch.Tensor:
        offsets = (*lead, a, *(0,) * (len(inner) - 1))
        sizes = (*(1,) * len(lead), b - a, *inner[1:])
        t = reader.read(sp.key, offsets, sizes)
        return t.reshape(sizes[len(lead) :])

    return _hf_parts(sp, spec, inner, rows)


def stored_hf_shapes(reader, params: list[StoredParam], spec) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} that `read_stored` would give for `params`, worked out on the meta
    device (nothing is read); a tensor that cannot be split as the config says is a UserError."""
    out = {}
    for sp in params:
        inner = reader.shape(sp.key)[len(sp.index) :]

        def rows(a: int, b: int, inner=inner) -> torch.Tensor:
            return torch.empty((b - a, *inner[1:]), device="meta")

        try:
            parts = _hf_parts(sp, spec, inner, rows)
        except (RuntimeError, ValueError) as e:  # a reshape the config's head counts do not fit
            raise UserError(
                f"dist-checkpoint tensor {sp.key} {tuple(inner)} does not split as config.json "
                f"says ({str(e).splitlines()[0]}): checkpoint and config disagree"
            ) from None
        out.update({name: tuple(t.shape) for name, t in parts})
    return out


def check_vocab_padding(reader, params: list[StoredParam], spec) -> None:
    """The embedding's rows past config.json's vocab_size are padding, which is zero (merge pads
    with zeros and a row no token selects gets no gradient); a non-zero row there means the
    config's vocab_size is smaller than the vocabulary the weights were trained with."""
    for sp in params:
        if sp.map.hf_names != ("model.embed_tokens.weight",):
            continue
        rows, hidden = reader.shape(sp.key)
        if rows > spec.vocab_size:
            pad = reader.read(sp.key, (spec.vocab_size, 0), (rows - spec.vocab_size, hidden))
            if pad.any():
                raise UserError(
                    f"checkpoint and config disagree: the embedding has trained rows past "
                    f"config.json's vocab_size {spec.vocab_size}; fix vocab_size in hf/config.json"
                )


def _hf_parts(sp: StoredParam, spec, inner, rows) -> list[tuple[str, torch.Tensor]]:
    names, layout = sp.map.hf_names, sp.map.layout
    if layout is Layout.GLU:
        n = inner[0] // 2
        return [(names[0], rows(0, n)), (names[1], rows(n, 2 * n))]
    if layout is Layout.VOCAB:
        return [(names[0], rows(0, min(spec.vocab_size, inner[0])))]
    geo = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads)
    return list(zip(names, split(sp.map, rows(0, inner[0]), vocab=spec.vocab_size, **geo)))
