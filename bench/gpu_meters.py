"""The instruments of bench/gpu_mfu.py: device clocks, the optimizer's share of a step timed from
inside it, the static memory of an actor by kind, a kernel profile, a plain matmul's TFLOP/s."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gb(n: float) -> float:
    return n / 1e9


def matmul_tflops(n: int, device: torch.device, iters: int = 20) -> float:
    """A plain n x n x n bf16 matmul's achieved TFLOP/s (torch.matmul, cuBLAS on a GPU)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - t) / 1e12


class OptimizerClock:
    """Times the optimizer's part of a step (norm, clip, update) from inside `train_step`, by
    wrapping the methods the step calls; synchronizes the device around each."""

    def __init__(self, optimizer, device: torch.device):
        self.seconds, self.device = 0.0, device
        for name in ("prepare_grads", "get_grad_norm", "step"):
            setattr(optimizer, name, self._timed(getattr(optimizer, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            sync(self.device)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds += time.perf_counter() - t

        return run


def static_memory(actor) -> dict:
    """Bytes of the state that lives between steps, by kind. Gradient buffers are megatron
    DDP's (fp32 main grads); the optimizer's share is the rest of what stays allocated after a
    step (fp32 master weights, Adam moments, megatron's bookkeeping)."""
    params = sum(p.numel() * p.element_size() for c in actor.chunks for p in c.parameters())
    grads = 0
    for c in actor.chunks:
        for buf in [*getattr(c, "buffers", []), *getattr(c, "expert_parallel_buffers", [])]:
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    out = {"parameters_gb": gb(params), "gradients_gb": gb(grads)}
    if torch.cuda.is_available():
        total = torch.cuda.memory_allocated()
        out["optimizer_gb"] = gb(total - params - grads)
        out["static_gb"] = gb(total)
    return out


def timed(fn, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def profile_step(step, device: torch.device, top: int) -> list[dict]:
    """The `top` costliest kernels of one call of `step` (device time on a GPU, CPU time here)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    out = [{"name": e.key[:120], "ms": getattr(e, key, 0) / 1e3, "calls": e.count} for e in rows]
    for r in out:
        print(f"    {r['ms']:9.2f} ms  {r['calls']:6d} x  {r['name']}", flush=True)
    return out
