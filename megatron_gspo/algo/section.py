"""The run config's `algo` section: the loss (LossConfig's keys, one set of defaults), the
advantages, the schedule of updates per rollout batch, routing replay and the mismatch correction.

A clip range left out (null) is the loss's published one (config.DEFAULT_CLIP), so switching
`algo.loss` alone gives that loss as its paper ran it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.algo.config import (
    DEFAULT_CLIP,
    AdvNorm,
    Agg,
    KLEstimator,
    Level,
    LossConfig,
    LossKind,
    Mismatch,
    Tis,
    TisReduce,
)
from megatron_gspo.checks import positive
from megatron_gspo.errors import UserError
from megatron_gspo.routing.replay import ReplayMode

_LOSS = LossConfig()  # the loss keys' defaults, defined once (algo/config.py)


@dataclass
class AlgoSection:
    loss: LossKind = _LOSS.kind
    clip_low: float | None = None  # None: the loss's published range (algo/config.py)
    clip_high: float | None = None
    agg: Agg | None = _LOSS.agg  # None: the loss's published aggregation
    norm_length: int | None = _LOSS.norm_length  # agg seq-mean-token-sum-norm's constant
    sapo_tau_pos: float = _LOSS.sapo_tau_pos  # loss sapo: the gate's temperature for A > 0
    sapo_tau_neg: float = _LOSS.sapo_tau_neg  # ... and for A < 0
    minibatches: int = 4  # optimizer steps per rollout batch
    # The first update takes its old log-probs from its own forward (exact: the weights have not
    # moved yet), so the old-log-prob forward skips that minibatch. Not under r3.
    on_policy_first_update: bool = True
    routing_replay: ReplayMode = ReplayMode.NONE
    adv_norm: AdvNorm = AdvNorm.STD  # none: Dr. GRPO (no division by the group's reward std)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    # the train-vs-rollout mismatch correction: none | tis | mis | icepop (algo/mismatch.py)
    mismatch: Mismatch = _LOSS.mismatch
    mismatch_level: Level = _LOSS.mismatch_level  # tis, mis: token | sequence
    # truncated importance sampling at a level: today's spelling of mismatch=tis (off: none)
    tis: Tis = _LOSS.tis
    tis_cap: float = _LOSS.tis_cap
    tis_reduce: TisReduce = _LOSS.tis_reduce  # sequence level: sum (likelihood ratio) | mean
    mis_low: float = _LOSS.mis_low  # mis: keep rho in [mis_low, mis_high]
    mis_high: float = _LOSS.mis_high
    icepop_k: float = _LOSS.icepop_k  # icepop: keep rho_t in [1/k, k]
    # KL penalty to a reference policy, the run's starting weights (model/reference.py), in the
    # loss per token as GRPO's paper puts it: 0 is off (no reference weights are kept)
    kl_coef: float = _LOSS.kl_coef
    kl_estimator: KLEstimator = _LOSS.kl_estimator  # k1 | k2 | k3 (low variance)
    ref_offload: bool = False  # keep the reference weights in host memory between uses (GPU)

    @property
    def advantage_std_norm(self) -> bool:
        """Whether the group advantages divide by the group's reward std (adv_norm: std)."""
        return self.adv_norm == AdvNorm.STD

    def check(self) -> None:
        self.loss_config().check("algo")
        positive(self.minibatches, "algo.minibatches")
        if self.tis != Tis.NONE and self.mismatch not in (Mismatch.NONE, Mismatch.TIS):
            raise UserError(f"algo.tis={self.tis} is truncated IS and algo.mismatch="
                            f"{self.mismatch} another correction; set algo.tis=none")  # fmt: skip
        if self.agg == Agg.SEQ_MEAN_TOKEN_SUM_NORM and self.norm_length is None:
            raise UserError(f"algo.agg={self.agg} divides by a constant length: set "
                            "algo.norm_length (Dr. GRPO: rollout.max_new_tokens)")  # fmt: skip

    def loss_config(self) -> LossConfig:
        low, high = DEFAULT_CLIP[LossKind(self.loss)]
        level = Level(self.tis) if self.tis != Tis.NONE else self.mismatch_level
        return LossConfig(
            kind=self.loss,
            clip_low=low if self.clip_low is None else self.clip_low,
            clip_high=high if self.clip_high is None else self.clip_high,
            agg=self.agg,
            tis=self.tis,
            tis_cap=self.tis_cap,
            tis_reduce=self.tis_reduce,
            sapo_tau_pos=self.sapo_tau_pos,
            sapo_tau_neg=self.sapo_tau_neg,
            norm_length=self.norm_length,
            mismatch=self.mismatch,
            mismatch_level=level,
            mis_low=self.mis_low,
            mis_high=self.mis_high,
            icepop_k=self.icepop_k,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
        )
