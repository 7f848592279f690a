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
    SAPO = "sapo"  # token-level ratio through a soft sigmoid gate (Qwen's SAPO)
    CISPO = "cispo"  # clipped, detached IS weight times log pi (MiniMax-M1's CISPO)


class Agg(StrEnum):
    """How token terms become the loss."""

    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    # Dr. GRPO's: each sequence's token sum over a constant length, then the sequence mean
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class AdvNorm(StrEnum):
    """What a group's centered rewards are divided by."""

    STD = "std"  # the group's reward std (GRPO, GSPO)
    NONE = "none"  # nothing (Dr. GRPO)


class Tis(StrEnum):
    """Truncated importance sampling against the train-vs-rollout mismatch."""

    NONE = "none"
    TOKEN = "token"  # each token's objective times min(pi_old / pi_rollout, cap)
    SEQUENCE = "sequence"  # each sequence's, with the sequence's ratio


class TisReduce(StrEnum):
    """How sequence-level TIS makes one ratio of a sequence's token ratios."""

    SUM = "sum"  # the likelihood ratio pi_old(y) / pi_rollout(y)
    MEAN = "mean"  # its geometric mean per token (length-normalized, like GSPO's ratio)


class KLEstimator(StrEnum):
    """Schulman's per-token estimators of KL(pi || pi_ref) (algo/kl.py); k3 the low-variance one."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class Mismatch(StrEnum):
    """The train-vs-rollout correction (algo/mismatch.py decides its weights)."""

    NONE = "none"
    TIS = "tis"  # truncated IS: min(rho, tis_cap), per token or per sequence
    MIS = "mis"  # masked IS: rho where rho in [mis_low, mis_high], else 0 (token or sequence)
    ICEPOP = "icepop"  # IcePop: rho_t where rho_t in [1/icepop_k, icepop_k], else 0 (per token)


class Level(StrEnum):
    """Where a mismatch ratio is taken."""

    TOKEN = "token"
    SEQUENCE = "sequence"


# The published defaults of each kind: (clip_low, clip_high). GSPO: the paper's 3e-4 / 4e-4.
# GRPO: DAPO's clip-higher 0.2 / 0.28. SAPO clips nothing (its gate has temperatures instead).
# CISPO: MiniMax-M1 sets no lower bound on the IS weight (1 - eps_low = 0: clip_low 1) and
# tunes the upper one; the paper gives no number, 0.28 is its DAPO baseline's.
DEFAULT_CLIP: dict[LossKind, tuple[float, float]] = {
    LossKind.GSPO: (3e-4, 4e-4),
    LossKind.GSPO_TOKEN: (3e-4, 4e-4),
    LossKind.GRPO: (0.2, 0.28),
    LossKind.SAPO: (0.2, 0.28),  # (unused by the loss; reported as the ratio band of the stats)
    LossKind.CISPO: (1.0, 0.28),
}


@dataclass(frozen=True)
class LossConfig:
    kind: LossKind = LossKind.GSPO
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    agg: Agg | None = None  # None: the kind's published default
    tis: Tis = Tis.NONE
    tis_cap: float = 2.0
    tis_reduce: TisReduce = TisReduce.SUM
    # SAPO's gate temperatures for A > 0 and A < 0 (the paper's 1.0 and 1.05: negative
    # advantages are damped faster off policy)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    norm_length: int | None = None  # seq-mean-token-sum-norm's constant (None: max_new_tokens)
    mismatch: Mismatch = Mismatch.NONE  # (tis != none means mismatch tis at that level)
    mismatch_level: Level = Level.TOKEN
    mis_low: float = 0.5
    mis_high: float = 2.0
    icepop_k: float = 2.0
    # KL(pi || pi_ref) to the run's starting weights in the loss, per token (0: off, no reference)
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3

    def check(self, section: str = "algo") -> None:
        """Ranges (the modes are checked where the config is read); keys named `section.key`."""
        in_range(self.clip_low, f"{section}.clip_low", 0, 1, lo_open=True)
        in_range(self.clip_high, f"{section}.clip_high", 0, lo_open=True)
        in_range(self.tis_cap, f"{section}.tis_cap", 1)
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            in_range(getattr(self, name), f"{section}.{name}", 0, lo_open=True)
        if self.norm_length is not None:
            in_range(self.norm_length, f"{section}.norm_length", 1)
        in_range(self.mis_low, f"{section}.mis_low", 0)
        in_range(self.mis_high, f"{section}.mis_high", self.mis_low, lo_open=True)
        in_range(self.icepop_k, f"{section}.icepop_k", 1, lo_open=True)
        in_range(self.kl_coef, f"{section}.kl_coef", 0)

    def loss_kwargs(self) -> dict:
        """The keywords of `policy_loss` this config sets (all but the mismatch weights)."""
        return dict(kind=self.kind, clip_low=self.clip_low, clip_high=self.clip_high,
                    agg=self.agg, sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg,
                    norm_length=self.norm_length)  # fmt: skip

    @property
    def correction(self) -> tuple[Mismatch, Level]:
        """The mismatch correction and its level, `tis` (today's spelling) included."""
        if self.mismatch == Mismatch.NONE and self.tis != Tis.NONE:
            return Mismatch.TIS, Level(self.tis)
        if self.mismatch == Mismatch.ICEPOP:
            return Mismatch.ICEPOP, Level.TOKEN
        return self.mismatch, self.mismatch_level
