"""Parallelism set up in one place, in a fixed order, over named axes.

`ParallelConfig`, the run config's `parallel` section, names the axes (tp, pp, vpp, ep, etp);
`ParallelDims` is those axes with the launch's world size (dp derived from it) and checks them
against the model before anything is built. `init_distributed` starts torch.distributed
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
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_gspo.checks import positive
from megatron_gspo.errors import UserError


@dataclass(frozen=True)
class ParallelConfig:
    """The sizes of the parallel axes (the world size is the launch's: dp = world / (tp * pp))."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int | None = None  # virtual pipeline chunks per rank; null: no interleaving
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel; null: the same as tp

    def check(self) -> None:
        for name in ("tp", "pp", "ep", "vpp", "etp"):
            if getattr(self, name) is not None:
                positive(getattr(self, name), f"parallel.{name}")

    def dims(self, world_size: int) -> ParallelDims:
        """These axes in a launch of `world_size` processes."""
        return ParallelDims(**asdict(self), world_size=world_size)


@dataclass(frozen=True)
class ParallelDims(ParallelConfig):
    world_size: int = 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def virtual_stages(self) -> int | None:
        """megatron's virtual pipeline size: the chunks per rank where more than one, else None."""
        return self.chunks if self.chunks > 1 else None

    def validate(self, spec=None, keys: bool = False) -> None:
        """Raise UserError for a layout that cannot work, naming the fix: the command-line
        flags (--tp 2), or with `keys` the config keys (parallel.tp=2) that set it."""
        n = _Names(self, keys)
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise UserError(f"{n.key(name)} must be >= 1")
        if spec is not None:
            self._validate_model(spec, n)
        if self.world_size % (self.tp * self.pp):
            raise UserError(
                f"world size {self.world_size} is not divisible by tp*pp={self.tp * self.pp}; "
                f"change {n.key('tp')}/{n.key('pp')} or the number of processes"
            )
        if self.world_size % (self.expert_tp * self.ep * self.pp):
            raise UserError(
                f"world size {self.world_size} is not divisible by etp*ep*pp="
                f"{self.expert_tp * self.ep * self.pp}; change {n.key('ep')}/{n.key('etp')}"
            )
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise UserError(f"{n.key('vpp')} needs {n.key('pp')} >= 2")

    def _validate_model(self, spec, n: _Names) -> None:
        if spec.num_heads % self.tp or spec.num_kv_heads % self.tp:
            raise UserError(
                f"{n.set('tp')} does not divide the model's {spec.num_heads} attention heads and "
                f"{spec.num_kv_heads} key/value heads; choose a {n.key('tp')} that divides both"
            )
        if spec.ffn_hidden_size % self.tp:
            raise UserError(
                f"{n.set('tp')} does not divide intermediate_size {spec.ffn_hidden_size}"
            )
        if spec.is_moe and spec.num_experts % self.ep:
            raise UserError(
                f"{n.set('ep')} does not divide the model's {spec.num_experts} experts; "
                f"choose a {n.key('ep')} that divides it"
            )
        if not spec.is_moe and self.ep > 1:
            raise UserError(f"{n.set('ep')} needs an MoE model; this {spec.architecture} is dense")
        if spec.is_moe and spec.moe_ffn_hidden_size % self.expert_tp:
            raise UserError(
                f"{n.set('etp', self.expert_tp)} does not divide moe_intermediate_size "
                f"{spec.moe_ffn_hidden_size}"
            )
        stages = self.pp * self.chunks
        if spec.num_layers % stages:
            raise UserError(
                f"{spec.num_layers} layers cannot be split into pp*vpp={stages} equal stages; "
                f"change {n.key('pp')}/{n.key('vpp')}"
            )


@dataclass(frozen=True)
class _Names:
    """How an error names a parallel size: a command-line flag or a config key."""

    dims: ParallelDims
    keys: bool

    def key(self, name: str) -> str:
        return f"parallel.{name}" if self.keys else f"--{name}"

    def set(self, name: str, value: int | None = None) -> str:
        value = getattr(self.dims, name) if value is None else value
        return f"parallel.{name}={value}" if self.keys else f"--{name} {value}"


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
