"""The KL penalty in the reward (`algo.kl_in: reward`), as InstructGPT and verl put it: each
sample's reward loses beta times its KL to the reference policy summed over its trained tokens,
and the group advantages are computed again from the penalized rewards:

    KL_i  = sum_t mask_{i,t} * k(log pi_old(y_{i,t}), log pi_ref(y_{i,t}))
    r'_i  = r_i - beta * KL_i
    A_i   = group_advantages(r', G)        (divided by the group's std or not: algo.adv_norm)

with k the `algo.kl_estimator` (algo/kl.py) and pi_old the step's weights before its updates (the
old log-probs; under R3 their forward replays the rollout's routing, as the reference's does). With
k1 the sum is the sample's log-ratio log pi_old(y) / pi_ref(y), an unbiased one-sample estimate of
the sequence KL. The objective then has no KL term of its own (`AlgoConfig.kl_in_loss`).

The rows of a step's batch are its kept groups in order (G consecutive rows a group), so row i is
in group i // G. On many ranks a rank holds a shard (its data-parallel replica's rows), with
log-probs on the last pipeline stage only: each row's reward, KL sum and token count are summed
over all ranks from the one rank that counts that row (`shard.reports_rows`: its replica's last
stage, first tensor- and context-parallel rank), so every rank has every row's and computes the
same advantages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.model.parallel import device_type
from megatron_gspo.train.batch import StepBatch
from megatron_gspo.train.shard import reports_rows


def penalized_advantages(
    rewards: torch.Tensor, kl_sums: torch.Tensor, group_size: int, algo: AlgoConfig
) -> torch.Tensor:
    """A_i of r'_i = r_i - kl_coef * KL_i, [B] over the step's whole batch (float64)."""
    shaped = rewards.double() - algo.kl_coef * kl_sums.double()
    return group_advantages(shaped, group_size, scale_by_std=algo.advantage_std_norm)


def row_kl_sums(batch: StepBatch, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `batch` (float64 [B] each): the estimator summed over its trained tokens, and
    their count. Tokens without both log-probs (NaN) count 0 (a stage before the last)."""
    old, ref = batch["old_logprobs"].double(), batch["ref_logprobs"].double()
    mask = batch["loss_mask"].bool() & old.isfinite() & ref.isfinite()
    per_token = torch.where(mask, kl_estimate(old.nan_to_num(), ref.nan_to_num(), estimator), 0.0)
    row = torch.repeat_interleave(torch.arange(len(batch)), batch.lengths)
    sums = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, row, per_token)
    counts = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, row, mask.double())
    return sums, counts


def apply_reward_kl(batch: StepBatch, algo: AlgoConfig, group_size: int) -> dict[str, float]:
    """Set the batch's advantages to those of its KL-penalized rewards (every rank: its rows);
    returns the step's `kl/ref` (the estimator's mean over the trained tokens) and
    `kl/reward_penalty` (beta * KL_i, the mean over samples). Collective when the batch is a
    shard (every rank calls it)."""
    if "rewards" not in batch.fields:
        raise ValueError("algo.kl_in: reward needs the batch's rewards (train/samples.to_batch)")
    if "token_advantages" in batch.fields:
        raise ValueError("algo.kl_in: reward recomputes per-sample advantages; this batch has "
                         "per-token ones")  # fmt: skip
    sums, counts = row_kl_sums(batch, algo.kl_estimator)
    table = torch.zeros(3, batch.global_size, dtype=torch.float64)
    sharded = batch.sharded and dist.is_initialized() and dist.get_world_size() > 1
    if not sharded or reports_rows():
        rows = torch.as_tensor(batch.global_index(), dtype=torch.int64)
        table[:, rows] = torch.stack([sums, counts, batch["rewards"].double()])
    if sharded:
        table = table.to(device_type())
        dist.all_reduce(table)
        table = table.cpu()
    kl, tokens, rewards = table
    advantages = penalized_advantages(rewards, kl, group_size, algo)
    batch.set("advantages", advantages[torch.as_tensor(batch.global_index())].float())
    return {
        "kl/ref": float(kl.sum() / tokens.sum().clamp(min=1.0)),
        "kl/reward_penalty": float(algo.kl_coef * kl.mean()),
    }
