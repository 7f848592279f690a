"""The model section's modes (`model.recompute`, `model.moe_grouped_gemm`), with no torch import,
so the config can name them without loading the Megatron side."""

from __future__ import annotations

from enum import StrEnum


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
