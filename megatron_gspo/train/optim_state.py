"""Checkpointing the optimizer's Adam state, reshardable across every layout.

megatron-core's own sharded optimizer state does not move between layouts here: for the
distributed optimizer with torch Adam it is broken in 0.16.1 - 0.19.x (REFERENCE §3:
`flattened_range` unsupported, in-place on a leaf view, and `fully_reshardable` sharing one
`step` tensor across all parameters, which corrupts Adam after resume); for the plain optimizer
the keys carry a `chained_<i>` prefix that exists only when EP > 1 splits the parameters into a
dense and an expert optimizer, so EP1 and EP2 checkpoints do not meet. We sidestep both. For the
distributed optimizer each data-parallel rank owns a contiguous range of every flattened
parameter; an all-reduce of zero-padded ranges over the (expert) data-parallel group rebuilds the
whole TP-local tensor exactly (disjoint ranges, every other entry +0). The plain optimizer holds
the whole tensor already. Those tensors are saved
under the SAME sharding metadata as the model parameter they belong to (key prefixed
`optimizer.<state>.`), so megatron's dist-checkpointing reshards them like the weights. On load
each rank copies its range back. Adam's step count is one integer shared by every parameter.

Extra memory while saving or loading: one TP-local parameter-sized tensor at a time per state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.model import lora_ckpt
from megatron_gspo.model.lora import is_lora_param

STATES = ("param", "exp_avg", "exp_avg_sq")


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


_DIST_OPT_API = (
    "_get_model_param_range_map",
    "_get_main_param_and_optimizer_states",
    "_init_optimizer_states_with_dummy_values",
)


def _distributed(opt) -> bool:
    if not hasattr(opt, "model_param_group_index_map"):
        return False
    missing = [name for name in _DIST_OPT_API if not hasattr(opt, name)]
    if missing:
        raise UserError(
            f"this megatron-core's distributed optimizer lacks {missing}; checkpoint with "
            "use_distributed_optimizer: false"
        )
    return True


def _main_params(opt) -> dict:
    """Plain optimizers: model param -> the fp32 param the optimizer steps."""
    if hasattr(opt, "float16_groups"):  # mixed precision: fp32 copies of bf16/fp16 params
        pairs = zip(
            opt.float16_groups + opt.fp32_from_fp32_groups,
            opt.fp32_from_float16_groups + opt.fp32_from_fp32_groups,
        )
        return {m: f for mg, fg in pairs for m, f in zip(mg, fg)}
    return {p: p for g in opt.optimizer.param_groups for p in g["params"]}


def _owners(optimizer) -> dict:
    """model param -> (its optimizer, main param or None for the distributed optimizer)."""
    out = {}
    for opt in _optimizers(optimizer):
        if _distributed(opt):
            out.update({p: (opt, None) for p in opt.model_param_group_index_map})
        else:
            out.update({p: (opt, main) for p, main in _main_params(opt).items()})
    return out


def _local(param, owner) -> tuple[int, int, dict]:
    """This rank's slice [start, end) of the flattened param and its state tensors."""
    opt, main = owner
    if main is None:
        r = opt._get_model_param_range_map(param)["param"]
        return r.start, r.end, opt._get_main_param_and_optimizer_states(param)
    return 0, param.numel(), {"param": main, **opt.optimizer.state[main]}


def _dp_group(param):
    from megatron.core import parallel_state as mpu

    if not getattr(param, "allreduce", True):  # expert parameter
        return mpu.get_expert_data_parallel_group()
    return mpu.get_data_parallel_group(with_context_parallel=True)


def _ensure_state(optimizer) -> None:
    """Adam creates its state at the first step; make it exist so it can be filled in."""
    for opt in _optimizers(optimizer):
        if opt.optimizer.state:
            continue
        if _distributed(opt):
            opt._init_optimizer_states_with_dummy_values()
        else:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.optimizer.step()
            opt.optimizer.zero_grad()


def _full_states(param, owner, distributed: bool) -> dict[str, torch.Tensor]:
    """The TP-local full tensors of this param's main value and Adam moments (collective for
    the distributed optimizer)."""
    full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=param.device) for k in STATES}
    local = _local(param, owner) if owner is not None else None
    if local is not None:
        start, end, tensors = local
        for k in STATES:
            full[k][start:end] = tensors[k].detach().view(-1).float()
    if distributed:
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
    distributed = any(_distributed(o) for o in _optimizers(optimizer))
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
                else _full_states(p, owners.get(p), distributed)
            )
            for k in STATES:
                # fp32 main values and moments, also for a bf16 model's parameters
                dtype = {"dtype": full[k].dtype} if hasattr(sh, "dtype") else {}
                out[k][f"{i}.{name}"] = dataclasses.replace(
                    sh, key=f"optimizer.{k}.{sh.key}", data=full[k], **dtype
                )
    out["step"] = _step(optimizer)
    return out


@torch.no_grad()
def restore(optimizer, chunks, loaded: dict) -> None:
    """Copy each rank's slice of the loaded full tensors into its optimizer state."""
    owners = _owners(optimizer)
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            key = f"{i}.{name}"
            if p not in owners or key not in loaded["param"]:
                continue
            start, end, tensors = _local(p, owners[p])
            for k in STATES:
                src = loaded[k][key].reshape(-1)[start:end]
                tensors[k].view(-1).copy_(src.to(tensors[k].dtype))
    step = int(loaded["step"])
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:  # a tensor keeps its device (a fused CUDA Adam's is there)
                old = state["step"]
                state["step"] = torch.full_like(old, float(step)) if torch.is_tensor(old) else step


def _sharded_actor_state(chunks, optimizer, is_loading: bool) -> dict:
    from megatron_gspo.model.checkpoint import sharded_model_state

    modules = [c.module for c in chunks]
    model = sharded_model_state(modules)
    if lora_ckpt.lora_record(modules) is not None:  # the frozen base stays at its own path
        model = {k: {n: v for n, v in sd.items() if is_lora_param(n)} for k, sd in model.items()}
    return {"model": model, "optimizer": sharded_state(optimizer, modules, model, is_loading)}


def save_actor(chunks, optimizer, directory) -> None:
    """The actor's model + optimizer state as one dist-checkpoint (collective; the directory
    exists, empty). Written by this process (megatron's torch_dist format): megatron's default
    writer forks writer processes and spawns a queue manager that outlives a trainer killed
    with SIGKILL."""
    from megatron_gspo.model.checkpoint import save_sharded

    save_sharded(_sharded_actor_state(chunks, optimizer, is_loading=False), directory)
    if dist.get_rank() == 0:
        lora_ckpt.write(directory, [c.module for c in chunks])


def load_actor(chunks, optimizer, directory) -> None:
    """Load `save_actor`'s checkpoint under any layout and either optimizer kind (collective)."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.model.checkpoint import take_over

    lora_ckpt.check(directory, [c.module for c in chunks])
    state = dist_checkpointing.load(
        _sharded_actor_state(chunks, optimizer, is_loading=True), str(directory)
    )
    modules = [c.module for c in chunks]
    for i, c in enumerate(modules):
        keep = is_lora_param if lora_ckpt.lora_record(modules) is not None else None
        take_over(c, state["model"][f"model{i}"], directory, copy=True, keep=keep)
    restore(optimizer, modules, state["optimizer"])
