"""Running megatron-core without Transformer Engine: always on a CPU, and on a GPU machine that
lacks it (the model then uses the local layer spec, builder.py).

Upstream bugs worked around there, applied by `model.parallel.init_distributed` on every device
when TE is missing (call sites as of megatron-core 0.16.1 - 0.19.x):

- `moe_utils.te_general_gemm` is undefined when TE is missing (0.16.1): NameError in router
  gating with `moe_router_dtype`. Defined as None, which selects the torch path.
- `CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None`, i.e. True, and then
  needs TE's FP8 state manager: selective recompute fails. Fixed to `bool(fp8)`.
"""

from __future__ import annotations

import functools


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
