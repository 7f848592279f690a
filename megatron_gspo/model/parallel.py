"""Parallelism set up in one place, in a fixed order, over named axes.

`ParallelConfig`, the run config's `parallel` section, names the axes (tp, pp, vpp, ep, etp);
`ParallelDims` is those axes with the launch's world size (dp derived from it) and checks them
against the model before anything is built (both defined in model/parallel_config.py, which
imports no torch, and importable from here). `init_distributed` starts torch.distributed
(gloo on a CPU, NCCL on a GPU), applies the CPU compatibility layer on a CPU run only, and
initializes megatron-core's parallel state in megatron's order "tp-cp-ep-dp-pp".
"""

from __future__ import annotations

import atexit
import copy
import datetime
import os
import sys
import types

import torch
import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.model.parallel_config import ParallelConfig, ParallelDims

__all__ = [
    "ParallelConfig",
    "ParallelDims",
    "device_type",
    "init_distributed",
    "shutdown",
    "world_size_from_env",
]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(dims: ParallelDims, *, seed: int = 1234, timeout_min: int = 10) -> None:
    """Start torch.distributed and megatron's parallel state for `dims` (idempotent)."""
    if device_type() == "cpu":
        from megatron_gspo.model import cpu_compat

        cpu_compat.apply()
    from megatron_gspo.model import without_te

    without_te.apply()
    start_process_group(timeout_min)
    if dist.get_world_size() != dims.world_size:
        raise UserError(
            f"layout expects {dims.world_size} processes but {dist.get_world_size()} were started"
        )
    from megatron.core import tensor_parallel

    _enter_layout(dims)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def start_process_group(timeout_min: int = 10) -> None:
    """torch.distributed's default group (gloo on a CPU, NCCL on this rank's GPU), without
    megatron: what ranks need to agree before a model is built (idempotent)."""
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        _LAYOUT_STATES.clear()  # their groups went with the process group they belonged to
        _init_process_group(timeout_min)
        _shutdown_at_exit()


# megatron's parallel state (its module's globals: groups, ranks, sizes, buffers) as it was right
# after `initialize_model_parallel` for each layout this process initialized, and as it was
# before the first. megatron's `destroy_model_parallel` forgets most of its groups without
# destroying them (gloo groups keep their threads, ~50 a layout), so a process that changes
# layouts (test workers trying many) reuses a layout's groups when it comes back to it instead of
# making more.
_LAYOUT_STATES: dict[tuple, dict] = {}
_BEFORE_INIT: dict = {}


def _enter_layout(dims: ParallelDims) -> None:
    from megatron.core import parallel_state as mpu

    if not _LAYOUT_STATES and mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()  # initialized by someone else: megatron's own reset
    if not _BEFORE_INIT:
        _BEFORE_INIT.update(_megatron_state(mpu))
    key = (dims.tp, dims.pp, dims.virtual_stages, dims.ep, dims.expert_tp)
    if key in _LAYOUT_STATES:
        _restore(mpu, _LAYOUT_STATES[key])
        return
    _restore(mpu, _BEFORE_INIT)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.virtual_stages,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
    )
    _LAYOUT_STATES[key] = _megatron_state(mpu)


def _megatron_state(mpu) -> dict:
    """The state globals of megatron's parallel_state module (lists and dicts copied)."""
    state = {}
    for name, value in vars(mpu).items():
        if not name.startswith("_") or name.startswith("__") or callable(value):
            continue
        if isinstance(value, types.ModuleType):
            continue
        state[name] = _copied(value)
    return state


def _restore(mpu, state: dict) -> None:
    for name, value in state.items():
        setattr(mpu, name, _copied(value))


def _copied(value):
    """A container megatron may change in place, copied; anything else as it is."""
    return copy.copy(value) if isinstance(value, (list, dict, set)) else value


def _init_process_group(timeout_min: int) -> None:
    backend = "nccl" if device_type() == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_min)
    if "RANK" not in os.environ:  # a plain single process: a private loopback rendezvous, on a
        # port the store binds itself (one picked first could be taken before the bind), and
        # nothing in the environment that a child process would inherit
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


_EXIT_HOOKED = False


def _shutdown_at_exit() -> None:
    """Destroy the process groups before the interpreter finalizes, on a clean exit.

    A gloo group left to finalization can abort the process ("terminate called without an active
    exception"): its worker threads still hold finished work whose tensors need the GIL to be
    freed, and a thread that asks for the GIL while the interpreter is being torn down is ended
    mid-way through C++ code. An exit through an uncaught exception (which the interpreter leaves
    in sys.last_value) skips this: its peers may be inside a collective that would never finish,
    and torchrun stops the job anyway.
    """
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        _EXIT_HOOKED = True
        atexit.register(lambda: None if hasattr(sys, "last_value") else shutdown())


def shutdown() -> None:
    # (megatron not imported: no parallel state to destroy, and none imported at exit for it)
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    _LAYOUT_STATES.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
