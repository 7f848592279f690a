"""The model section's modes (`model.recompute`, `model.moe_grouped_gemm`) and the LM head's
defaults (`model.lm_head_chunk`, `model.lm_head_keep_mb`), with no torch import, so the config
can name them without loading the Megatron side."""

from __future__ import annotations

from enum import StrEnum

# Tokens per chunk of the LM head (model/lm_head.py) by default. At Qwen3's vocabulary (151,936)
# one chunk's logits and their temporaries are 1.9 GB with the entropy (12 bytes a logit), against
# 2 x 10 GB for the whole logits and gradient at 32k tokens; the chunk's three GEMMs
# (1024 x 2048 x 151,936) still run at full speed, and 32 chunks of a dozen kernels each are no
# launch overhead.
DEFAULT_CHUNK_TOKENS = 1024
# A call's whole logits up to this size (MiB) are kept for the backward (no recomputation).
DEFAULT_KEEP_MB = 256


class Recompute(StrEnum):
    """Activation recompute in the training forward.

    selective: megatron's `recompute_granularity="selective"`: the core attention (and, with
    grouped experts, the experts' activation, `moe_act`) are recomputed in the backward instead
    of kept; full: every layer's input is kept and the layer run again in the backward."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @classmethod
    def coerce(cls, value):
        """YAML `true` / `false` (this key's former boolean form) read as full / none."""
        if isinstance(value, bool):
            return (cls.FULL if value else cls.NONE).value
        return value


class GroupedGemm(StrEnum):
    """MoE experts as one grouped GEMM per projection (`GroupedExperts`, TEGroupedMLP with
    Transformer Engine) or one matmul pair per expert (megatron's SequentialMLP). auto: grouped
    on a GPU, sequential on a CPU (model/builder.py says why)."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    @classmethod
    def coerce(cls, value):
        """YAML reads true / false as booleans."""
        if isinstance(value, bool):
            return (cls.ON if value else cls.OFF).value
        return value

    def resolve(self) -> bool | None:
        """The build option: True / False, or None for the builder's device default."""
        return {GroupedGemm.ON: True, GroupedGemm.OFF: False}.get(self)
