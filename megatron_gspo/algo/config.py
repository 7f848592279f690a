"""The loss's modes and settings: `LossConfig`, the one definition of the loss keys of the run
config's `algo` section (their defaults and their checks)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from megatron_gspo.checks import in_range


class LossKind(StrEnum):
    GSPO = "gspo"  # sequence-level ratio (Qwen's GSPO)
    GSPO_TOKEN = "gspo_token"  # GSPO-token: the sequence ratio with per-token gradients
    GRPO = "grpo"  # token-level ratio (DeepSeek's GRPO)


class Agg(StrEnum):
    """How token terms become the loss."""

    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"


class Tis(StrEnum):
    """Truncated importance sampling against the train-vs-rollout mismatch."""

    NONE = "none"
    TOKEN = "token"  # each token's objective times min(pi_old / pi_rollout, cap)
    SEQUENCE = "sequence"  # each sequence's, with the sequence's ratio


class TisReduce(StrEnum):
    """How sequence-level TIS makes one ratio of a sequence's token ratios."""

    SUM = "sum"  # the likelihood ratio pi_old(y) / pi_rollout(y)
    MEAN = "mean"  # its geometric mean per token (length-normalized, like GSPO's ratio)


@dataclass(frozen=True)
class LossConfig:
    kind: LossKind = LossKind.GSPO
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    agg: Agg | None = None  # None: the kind's published default
    tis: Tis = Tis.NONE
    tis_cap: float = 2.0
    tis_reduce: TisReduce = TisReduce.SUM

    def check(self, section: str = "algo") -> None:
        """Ranges (the modes are checked where the config is read); keys named `section.key`."""
        in_range(self.clip_low, f"{section}.clip_low", 0, 1, lo_open=True, hi_open=True)
        in_range(self.clip_high, f"{section}.clip_high", 0, lo_open=True)
        in_range(self.tis_cap, f"{section}.tis_cap", 1)
