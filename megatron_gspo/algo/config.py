"""The run config's `algo` section, `AlgoConfig`: the loss and its modes, the advantages, the
schedule of updates per rollout batch, routing replay, the train-vs-rollout mismatch correction
and the KL penalty. The trainer takes the section as it is: one name per key, one set of
defaults, checked by `check()`.

A clip range left out (null) is the loss's published one (DEFAULT_CLIP), so switching
`algo.loss` alone gives that loss as its paper ran it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from megatron_gspo.checks import choice, in_range, positive
from megatron_gspo.errors import UserError
from megatron_gspo.routing.modes import ReplayMode


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


KINDS: tuple[LossKind, ...] = tuple(LossKind)
AGGS: tuple[Agg, ...] = tuple(Agg)

# Published defaults. GRPO (DeepSeekMath): mean over each sequence's tokens, then over sequences.
# GSPO: (1/G) sum_i of one clipped term per sequence, which is seq-mean-token-mean of that term
# broadcast over the tokens. So both defaults carry the same name, as SAPO's (1/G) sum_i 1/|y_i|
# sum_t. CISPO: 1 / sum_i |o_i| over all tokens, the token mean.
DEFAULT_AGG: dict[LossKind, Agg] = {kind: Agg.SEQ_MEAN_TOKEN_MEAN for kind in KINDS}
DEFAULT_AGG[LossKind.CISPO] = Agg.TOKEN_MEAN


def resolve_agg(kind: str, agg: str | None) -> Agg:
    """The aggregation to use: `agg`, or the kind's published default when None."""
    if kind not in KINDS:
        raise ValueError(f"unknown loss kind {kind!r}; expected one of {KINDS}")
    if agg is None:
        return DEFAULT_AGG[LossKind(kind)]
    if agg not in AGGS:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {AGGS}")
    return Agg(agg)


class AdvNorm(StrEnum):
    """What a group's centered rewards are divided by."""

    STD = "std"  # the group's reward std (GRPO, GSPO)
    NONE = "none"  # nothing (Dr. GRPO)


class TisReduce(StrEnum):
    """How sequence-level TIS makes one ratio of a sequence's token ratios."""

    SUM = "sum"  # the likelihood ratio pi_old(y) / pi_rollout(y)
    MEAN = "mean"  # its geometric mean per token (length-normalized, like GSPO's ratio)


class KLEstimator(StrEnum):
    """Schulman's per-token estimators of KL(pi || pi_ref) (algo/kl.py); k3 the low-variance one."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class KLIn(StrEnum):
    """Where the KL penalty to the reference policy goes."""

    LOSS = "loss"  # a per-token term of the objective (GRPO's paper)
    REWARD = "reward"  # off each sample's reward before the advantages (InstructGPT, verl)


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
class AlgoConfig:
    """The loss, the advantages, the updates per rollout batch, routing replay, the mismatch
    correction and the KL penalty. The trainer's step takes this section as it is."""

    loss: LossKind = LossKind.GSPO  # the policy loss (algo/policy_loss.py)
    clip_low: float | None = None  # None: the loss's published range (DEFAULT_CLIP)
    clip_high: float | None = None  # None: the loss's published one
    agg: Agg | None = None  # None: the loss's published aggregation
    norm_length: int | None = None  # agg seq-mean-token-sum-norm's constant
    sapo_tau_pos: float = 1.0  # loss sapo: the gate's temperature for A > 0 (the paper's)
    sapo_tau_neg: float = 1.05  # ... and for A < 0 (the paper's: damped faster off policy)
    minibatches: int = 4  # optimizer steps per rollout batch
    # The first update takes its old log-probs from its own forward (exact: the weights have not
    # moved yet), so the old-log-prob forward skips that minibatch. Not under r3.
    on_policy_first_update: bool = True
    routing_replay: ReplayMode = ReplayMode.NONE
    adv_norm: AdvNorm = AdvNorm.STD  # none: Dr. GRPO (no division by the group's reward std)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    # the train-vs-rollout mismatch correction: none | tis | mis | icepop (algo/mismatch.py)
    mismatch: Mismatch = Mismatch.NONE
    mismatch_level: Level = Level.TOKEN  # tis, mis: token | sequence
    tis_cap: float = 2.0  # tis: the weight is min(rho, tis_cap)
    tis_reduce: TisReduce = TisReduce.SUM  # sequence level: sum (likelihood ratio) | mean
    mis_low: float = 0.5  # mis: keep rho in [mis_low, mis_high]
    mis_high: float = 2.0
    icepop_k: float = 2.0  # icepop: keep rho_t in [1/k, k]
    # KL penalty to a reference policy, the run's starting weights (model/reference.py): 0 is
    # off (no reference weights are kept)
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3  # k1 | k2 | k3 (low variance)
    # loss: per token in the objective (GRPO's paper); reward: each sample's summed KL off its
    # reward before the group advantages (InstructGPT, verl; train/reward_kl.py)
    kl_in: KLIn = KLIn.LOSS
    ref_offload: bool = False  # keep the reference weights in host memory between uses (GPU)

    def check(self) -> None:
        """Ranges and combinations (the modes are checked where the config is read)."""
        in_range(self.clip[0], "algo.clip_low", 0, 1, lo_open=True)
        in_range(self.clip[1], "algo.clip_high", 0, lo_open=True)
        in_range(self.tis_cap, "algo.tis_cap", 1)
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            in_range(getattr(self, name), f"algo.{name}", 0, lo_open=True)
        if self.norm_length is not None:
            in_range(self.norm_length, "algo.norm_length", 1)
        in_range(self.mis_low, "algo.mis_low", 0)
        in_range(self.mis_high, "algo.mis_high", self.mis_low, lo_open=True)
        in_range(self.icepop_k, "algo.icepop_k", 1, lo_open=True)
        in_range(self.kl_coef, "algo.kl_coef", 0)
        positive(self.minibatches, "algo.minibatches")
        if self.agg == Agg.SEQ_MEAN_TOKEN_SUM_NORM and self.norm_length is None:
            raise UserError(f"algo.agg={self.agg} divides by a constant length: set "
                            "algo.norm_length (Dr. GRPO: rollout.max_new_tokens)")  # fmt: skip

    @property
    def clip(self) -> tuple[float, float]:
        """(clip_low, clip_high): the ones given, else the loss's published ones."""
        low, high = DEFAULT_CLIP[LossKind(self.loss)]
        return (low if self.clip_low is None else self.clip_low,
                high if self.clip_high is None else self.clip_high)  # fmt: skip

    @property
    def kl_in_loss(self) -> bool:
        """Whether the objective has a KL term (a KL to the reference, in the loss)."""
        return self.kl_coef > 0 and self.kl_in == KLIn.LOSS

    @property
    def kl_in_reward(self) -> bool:
        """Whether the rewards lose a KL term before the advantages (train/reward_kl.py)."""
        return self.kl_coef > 0 and self.kl_in == KLIn.REWARD

    @property
    def advantage_std_norm(self) -> bool:
        """Whether the group advantages divide by the group's reward std (adv_norm: std)."""
        return self.adv_norm == AdvNorm.STD

    def loss_kwargs(self) -> dict:
        """The keywords of `policy_loss` this config sets (all but the mismatch weights)."""
        low, high = self.clip
        return dict(kind=self.loss, clip_low=low, clip_high=high, agg=self.agg,
                    sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg,
                    norm_length=self.norm_length, correction=self.correction[0])  # fmt: skip

    @property
    def correction(self) -> tuple[Mismatch, Level]:
        """The mismatch correction and its level (IcePop's is always the token's)."""
        if self.mismatch == Mismatch.ICEPOP:
            return Mismatch.ICEPOP, Level.TOKEN
        return self.mismatch, self.mismatch_level


def tis_as_mismatch(value: Any) -> dict[str, Any]:
    """The earlier key `algo.tis: L` (truncated IS at level L, token | sequence) in today's keys:
    `algo.mismatch: tis` at `algo.mismatch_level: L`; `algo.tis: none` (off) sets nothing."""
    choice(value, "algo.tis", (Mismatch.NONE.value, *(m.value for m in Level)))
    if value == Mismatch.NONE:
        return {}
    return {"algo.mismatch": Mismatch.TIS.value, "algo.mismatch_level": value}
