"""RL algorithms in pure torch (no Megatron import): policy losses, advantages, KL estimators,
the train-vs-rollout mismatch corrections (TIS, MIS, IcePop).

The names below are imported from their modules on first use (megatron_gspo/lazy.py): the run
config imports algo/config.py, which runs this file, without loading torch."""

from typing import TYPE_CHECKING

from megatron_gspo.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron_gspo.algo.advantages import group_advantages
    from megatron_gspo.algo.kl import kl_estimate, kl_k1, kl_k2, kl_k3
    from megatron_gspo.algo.loss_stats import (
        combine_stats,
        log_ratio_split_stats,
        stat_reduce_op,
        summarize_stats,
    )
    from megatron_gspo.algo.mismatch import (
        correction_weights,
        logprob_abs_diff,
        sequence_mismatch_mask,
        sequence_tis_weights,
        token_mismatch_mask,
        token_tis_weights,
    )
    from megatron_gspo.algo.policy_loss import (
        AGGS,
        DEFAULT_AGG,
        KINDS,
        loss_denominator,
        policy_loss,
        resolve_agg,
    )

__all__ = [
    "AGGS",
    "DEFAULT_AGG",
    "KINDS",
    "combine_stats",
    "correction_weights",
    "group_advantages",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "log_ratio_split_stats",
    "logprob_abs_diff",
    "loss_denominator",
    "policy_loss",
    "resolve_agg",
    "sequence_mismatch_mask",
    "sequence_tis_weights",
    "stat_reduce_op",
    "summarize_stats",
    "token_mismatch_mask",
    "token_tis_weights",
]

lazy_exports(
    __name__,
    {
        "group_advantages": "advantages",
        **dict.fromkeys(["kl_estimate", "kl_k1", "kl_k2", "kl_k3"], "kl"),
        **dict.fromkeys(
            ["combine_stats", "log_ratio_split_stats", "stat_reduce_op", "summarize_stats"],
            "loss_stats",
        ),
        **dict.fromkeys(
            [
                "correction_weights",
                "logprob_abs_diff",
                "sequence_mismatch_mask",
                "sequence_tis_weights",
                "token_mismatch_mask",
                "token_tis_weights",
            ],
            "mismatch",
        ),
        **dict.fromkeys(
            ["AGGS", "DEFAULT_AGG", "KINDS", "loss_denominator", "policy_loss", "resolve_agg"],
            "policy_loss",
        ),
    },
)
