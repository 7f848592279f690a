"""Running megatron-core without Transformer Engine: always on a CPU, and on a GPU machine that
lacks it (the model then uses the local layer spec, builder.py).

Upstream bugs worked around there, applied by `model.parallel.init_distributed` on every device
when TE is missing (call sites as of megatron-core 0.16.1 - 0.19.x):

- `moe_utils.te_general_gemm` is undefined when TE is missing (0.16.1): NameError in router
  gating with `moe_router_dtype`. Defined as None, which selects the torch path.
- `CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None`, i.e. True, and then
  needs TE's FP8 state manager: selective recompute fails. Fixed to `bool(fp8)`.

And one cost: without TE or apex, megatron's gradient norm and gradient scaling (clipping, the
fp16/bf16 main-param copies) fall back to per-tensor loops (`local_multi_tensor_l2_norm` takes a
norm per tensor and then reads every one back to the host, one device sync each). On a GPU those
are replaced by torch's multi-tensor (`_foreach_*`) kernels, `foreach_l2_norm` and
`foreach_scale`, a few launches for all tensors and no sync. They compute the same values (tested
equal on a CPU). On a CPU only the scaling is replaced: `_foreach_mul_` scales in place where
megatron's `dst.copy_(src * scale)` makes and copies a temporary per tensor (measured: 19 vs 43 ms
over the 88.7M parameters of the TRL comparison's small model, bit for bit the same); a CPU
norm per tensor costs what `_foreach_norm` does, so megatron's stays.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


_APPLIED = False


def apply() -> None:
    """Idempotent; does nothing where Transformer Engine is installed."""
    global _APPLIED
    if _APPLIED or have_transformer_engine():
        return
    _APPLIED = True
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cwo = getattr(mrandom, "CheckpointWithoutOutput", None)
    if cwo is not None:
        orig_init = cwo.__init__

        def init(self, fp8=False):
            orig_init(self, fp8=fp8)
            self.fp8 = bool(fp8)

        cwo.__init__ = init
    use_foreach_grad_ops(norm=torch.cuda.is_available())


def use_foreach_grad_ops(norm: bool = True) -> None:
    """Megatron's per-tensor fallbacks become `foreach_scale` and (`norm`) `foreach_l2_norm`
    (only those: Transformer Engine's or apex's kernels, where megatron found them, stay)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if norm and clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: (||concat(tensors)||_2 as a [1] fp32 tensor,
    the per-tensor norms or None). sqrt(sum_i ||t_i||^2) = || (||t_1||, ..., ||t_n||) ||_2."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """amp_C.multi_tensor_scale's contract: dst_i = src_i * scale (in place when dst is src;
    a copy into dst's dtype otherwise, as megatron's fallback `dst.copy_(src * scale)`)."""
    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))
