"""Checkpointing the distributed optimizer's Adam state, reshardable across layouts.

megatron-core's own sharded state for the distributed optimizer with torch Adam is broken in
0.16.1 - 0.19.x (REFERENCE §3: `flattened_range` unsupported, in-place on a leaf view, and
`fully_reshardable` sharing one `step` tensor across all parameters, which corrupts Adam after
resume). We sidestep it: each data-parallel rank owns a contiguous range of every flattened
parameter; an all-reduce of zero-padded ranges over the (expert) data-parallel group rebuilds
the whole TP-local tensor exactly (disjoint ranges, every other entry +0). Those tensors are saved
under the SAME sharding metadata as the model parameter they belong to (key prefixed
`optimizer.<state>.`), so megatron's dist-checkpointing reshards them like the weights. On load
each rank copies its range back. Adam's step count is one integer shared by every parameter.

Extra memory while saving or loading: one TP-local parameter-sized tensor at a time per state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

STATES = ("param", "exp_avg", "exp_avg_sq")


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _owners(optimizer) -> dict:
    """model param -> the distributed optimizer that holds its shard."""
    out = {}
    for opt in _optimizers(optimizer):
        for p in getattr(opt, "model_param_group_index_map", {}):
            out[p] = opt
    return out


def _dp_group(param):
    from megatron.core import parallel_state as mpu

    if not getattr(param, "allreduce", True):  # expert parameter
        return mpu.get_expert_data_parallel_group()
    return mpu.get_data_parallel_group(with_context_parallel=True)


def _ensure_state(optimizer) -> None:
    for opt in _optimizers(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _full_states(param, owner) -> dict[str, torch.Tensor]:
    """The TP-local full tensors of this param's main value and Adam moments (collective)."""
    full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=param.device) for k in STATES}
    if owner is not None and param in owner.model_param_group_index_map:
        r = owner._get_model_param_range_map(param)["param"]
        local = owner._get_main_param_and_optimizer_states(param)
        for k in STATES:
            full[k][r.start : r.end] = local[k].detach().view(-1).float()
    group = _dp_group(param)
    for k in STATES:
        dist.all_reduce(full[k], group=group)
    return {k: v.view(param.shape) for k, v in full.items()}


def _step(optimizer) -> int:
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def sharded_state(optimizer, chunks, model_sd: dict, is_loading: bool) -> dict:
    """Sharded state of the distributed optimizer mirroring `model_sd` (from
    `model.checkpoint.sharded_model_state` of the unwrapped chunks)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    _ensure_state(optimizer)
    owners = _owners(optimizer)
    by_data = {id(sh.data): sh for sh in nested_values(model_sd) if hasattr(sh, "data")}
    out: dict = {k: {} for k in STATES}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            sh = by_data.get(id(p))
            if sh is None:
                continue
            full = (
                {k: torch.zeros(p.shape, dtype=torch.float32) for k in STATES}
                if is_loading
                else _full_states(p, owners.get(p))
            )
            for k in STATES:
                out[k][f"{i}.{name}"] = dataclasses.replace(
                    sh, key=f"optimizer.{k}.{sh.key}", data=full[k]
                )
    out["step"] = _step(optimizer)
    return out


@torch.no_grad()
def restore(optimizer, chunks, loaded: dict) -> None:
    """Copy each rank's ranges of the loaded full tensors into its optimizer shards."""
    owners = _owners(optimizer)
    step = torch.tensor(float(loaded["step"]))
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            owner = owners.get(p)
            key = f"{i}.{name}"
            if owner is None or key not in loaded["param"]:
                continue
            r = owner._get_model_param_range_map(p)["param"]
            local = owner._get_main_param_and_optimizer_states(p)
            for k in STATES:
                src = loaded[k][key].reshape(-1)[r.start : r.end]
                local[k].view(-1).copy_(src.to(local[k].dtype))
            if "step" in local:
                local["step"].copy_(step) if torch.is_tensor(local["step"]) else None
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = int(loaded["step"])
