"""Make megatron-core run on a CPU (gloo), without a GPU or Transformer Engine.

Applied by `apply()` only when the run's device is the CPU (`model.parallel.init_distributed`
decides); a GPU run never imports this module. It redirects megatron-core's CUDA-only calls
(current device, "cuda" literals, RNG state, streams, uneven gathers, fused CUDA extensions) to
CPU equivalents, each listed with its reason in docs/architecture.md ("megatron-core on a CPU").
"""

from __future__ import annotations

import contextlib
import types

import torch

_APPLIED = False
_CPU = torch.device("cpu")
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
    "eye",
    "triu",
    "tril",
)
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
# Modules that create tensors with a literal device="cuda".
_LITERAL_CUDA_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.random",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)


def is_applied() -> bool:
    return _APPLIED


def apply() -> None:
    """Patch torch.cuda and megatron-core for CPU execution. Idempotent."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat must not be applied on a machine with a usable GPU")
    _patch_torch_cuda()
    _patch_tensor_methods()
    import importlib

    for name in _LITERAL_CUDA_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # moved or gone in this megatron-core version
            continue
        module.torch = _CpuTorchNamespace()
    _patch_rng()
    _patch_token_dispatcher()
    _patch_uneven_collectives()
    _patch_buffer_collectives()
    _patch_identity_chunk_sort()
    _patch_wgrad_accumulation()
    _keep_freed_memory()
    _APPLIED = True


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _keep_freed_memory() -> bool:
    """glibc only: allocate from the heap, never mmap; trim the heap only past 2 GiB free."""
    import ctypes
    import os

    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl, macOS): left as it is
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _map_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CpuTorchNamespace(types.ModuleType):
    """`torch` as seen by a module that hard-codes device="cuda": factories land on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, __f=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _map_device(kwargs["device"])
                return __f(*args, **kwargs)

            return factory
        return attr


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent(_NullStream):
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    if not hasattr(cuda, "nvtx") or not hasattr(cuda.nvtx, "range_push"):
        cuda.nvtx = types.SimpleNamespace(range_push=lambda *a: None, range_pop=lambda: None)


def _patch_tensor_methods() -> None:
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.record_stream = lambda self, *args, **kwargs: None
    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return _CUDA_TYPE_NAMES.get(self.dtype) or orig_type(self)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    _replace(mrandom, "_get_cuda_rng_state", get_state)
    _replace(mrandom, "_set_cuda_rng_state", set_state)


def _patch_token_dispatcher() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    orig_gather = getattr(mappings, "_gather_along_first_dim", None)
    orig_reduce_scatter = getattr(mappings, "_reduce_scatter_along_first_dim", None)
    if orig_gather is None or orig_reduce_scatter is None:
        return

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, None, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_reduce_scatter(input_, group, None, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        rank = dist.get_rank(group)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _patch_buffer_collectives() -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        orig = getattr(pgb, name, None)
        if orig is None or getattr(orig, "_single_rank_skip", False):
            continue

        def collective(output, input_, *args, group=None, async_op=False, __orig=orig, **kwargs):
            if group is None or group.size() > 1:
                return __orig(output, input_, *args, group=group, async_op=async_op, **kwargs)
            if output.data_ptr() != input_.data_ptr() or output.numel() != input_.numel():
                output.copy_(input_.view_as(output))
            return None

        collective._single_rank_skip = True
        setattr(pgb, name, collective)


def _patch_wgrad_accumulation() -> None:
    """The kernel behind megatron's gradient-accumulation fusion, in torch: the weight gradient
    of a parallel linear layer is added straight into its fp32 `main_grad` (one addmm) instead of
    being computed into a new tensor that DDP's hook then adds (a second pass over every weight
    gradient, per backward). `enable_wgrad_accumulation` turns it on per layer."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return

    def accumulate(total_input, grad_output, main_grad):
        # bf16/fp16 activations into an fp32 main_grad: the CUDA kernel multiplies the half
        # inputs with fp32 accumulation; here the inputs are widened to main_grad's dtype.
        dt = main_grad.dtype
        main_grad.addmm_(grad_output.t().to(dt), total_input.to(dt))

    layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
        wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate
    )


def enable_wgrad_accumulation(chunks) -> int:
    """Gradient-accumulation fusion on the parallel linear layers of DDP-wrapped `chunks` whose
    weight has a `main_grad` (DDP's gradient buffer) and is their own: not the output layer of
    tied embeddings, which gets the shared weight passed in and whose gradient autograd sums
    with the embedding's. Returns how many layers. megatron reads the flag per layer and call,
    and a layer without `main_grad` (no DDP: scoring, conversion) must keep it off."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            weight = getattr(module, "weight", None)
            if weight is not None and hasattr(weight, "main_grad"):
                module.gradient_accumulation_fusion = True
                n += 1
    return n


def _patch_identity_chunk_sort() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    orig = getattr(token_dispatcher, "sort_chunks_by_idxs", None)
    if orig is None or getattr(orig, "_identity_skip", False):
        return

    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        n = sorted_idxs.numel()
        if not fused and torch.equal(sorted_idxs.cpu(), torch.arange(n, dtype=sorted_idxs.dtype)):
            return input, probs
        return orig(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    sort_chunks_by_idxs._identity_skip = True
    token_dispatcher.sort_chunks_by_idxs = sort_chunks_by_idxs


def _replace(module, name: str, value) -> None:
    """Patch a module attribute that this megatron-core version has; skip it otherwise (the
    names are private and move between versions: feature detection, not version pins)."""
    if hasattr(module, name):
        setattr(module, name, value)
