"""From rollout samples to the trainer's batch: their checks, the StepBatch, the rollout metrics, the
samples whose reward failed."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.sample import version_index
from megatron_gspo.train.batch import StepBatch

log = logging.getLogger(__name__)


def report_broken_rows(ps, key: str) -> None:
    from megatron_gspo.data.prompts import broken_rows

    line = broken_rows(ps, key)
    if line:
        print(line, flush=True)


def model_sizes(hf_dir: Path) -> tuple[int | None, int, int]:
    """The model's top-k (None: dense), vocabulary size and layers, which a rollout answer must
    fit."""
    from megatron_gspo.hf.config import load_hf_config, model_spec

    spec = model_spec(load_hf_config(hf_dir))
    return (spec.topk if spec.is_moe else None), spec.vocab_size, spec.num_layers


def check_samples(samples) -> None:
    # (an episode whose environment failed before the model wrote, or a sample that ended for
    # a reason the client does not know, is a failed reward instead)
    bad = [s for s in samples
           if s.aborted or (not s.tokens and s.env_error is None and not s.ended_unknown)]  # fmt: skip
    if bad:
        raise UserError(
            f"{len(bad)} of {len(samples)} rollouts came back aborted or empty "
            f"(first from {bad[0].server}); check the rollout server logs in RUN_DIR/logs"
        )
    partial = [s for s in samples if str(s.weight_version).startswith("partial:")]
    if partial:
        raise UserError(
            f"{len(partial)} rollouts came from a server caught mid weight update "
            f"({partial[0].weight_version}); the last weight sync did not complete"
        )


def to_batch(samples, advantages: list[float], rewards: list[float] | None = None) -> StepBatch:
    """The step's batch of `samples` (groups in order) with their advantages, and the rewards
    those came from (algo.kl_in: reward computes them again, train/reward_kl.py)."""
    tokens, mask, rollout_lp, experts = [], [], [], []
    for s in samples:
        p = len(s.prompt_ids)
        tokens.append(list(s.prompt_ids) + list(s.tokens))
        mask.append([0] * p + (s.loss_mask or [1] * len(s.tokens)))
        lp = s.logprobs or [None] * len(s.tokens)
        rollout_lp.append([None] * p + list(lp))
        experts.append(s.routed_experts)
    routed = experts if any(e is not None for e in experts) else None
    batch = StepBatch.from_rows(
        tokens, mask, advantages, rollout_logprobs=rollout_lp, rollout_experts=routed
    )
    if rewards is not None:
        batch.set("rewards", torch.tensor(rewards, dtype=torch.float64))
    return batch


def rollout_metrics(samples, rewards: list[float | None], seconds: float) -> dict:
    """The step's rollout metrics; reward statistics over the samples whose reward was scored
    (None: the reward function failed on it)."""
    r = torch.tensor([v for v in rewards if v is not None] or [0.0], dtype=torch.float64)
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.float64)
    return {
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std(correction=0)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": sum(s.finish_reason == "length" for s in samples)
        / len(samples),
        "time/rollout_s": seconds,
        "rollout/samples": float(len(samples)),
        "rollout/tokens": float(sum(len(s.prompt_ids) + len(s.tokens) for s in samples)),
    } | (_episode_metrics(samples) if any(s.turns for s in samples) else {})


def _episode_metrics(samples) -> dict:
    """Multi-turn rollouts: turns, the model's and the environment's tokens, failed episodes."""
    n = len(samples)
    model = [sum(s.loss_mask) if s.loss_mask else len(s.tokens) for s in samples]
    return {
        "env/turns_mean": sum(s.turns for s in samples) / n,
        "env/model_tokens_mean": sum(model) / n,
        "env/env_tokens_mean": sum(len(s.tokens) - m for s, m in zip(samples, model)) / n,
        "env/errors": float(sum(s.env_error is not None for s in samples)),
        "env/reward_given": float(sum(s.env_reward is not None for s in samples)),
    }


def sample_versions(samples) -> tuple[float, float, float]:
    """The weight versions the trained samples came from, by their servers' word: the oldest
    any sample started on, the mean over the model's tokens (a partial rollout's come from
    several: rollout/partial.py), and the share of samples written by more than one."""
    tokens = [v for s in samples
              for v in (s.token_versions or [str(s.weight_version)] * len(s.tokens))
              if v is not None]  # (the model's tokens: an environment's have None)  # fmt: skip
    written = [s.weight_version for s in samples if s.weight_version is not None]
    return (
        float(min(map(version_index, written), default=0)),
        sum(map(version_index, tokens)) / max(len(tokens), 1),
        sum(len(set(s.versions)) > 1 for s in samples) / len(samples),
    )


def reward_failures(scored, step: int) -> list[int]:
    """The samples whose reward failed (their groups are dropped); an error when every sample
    failed, whatever the stage (its environment's start or step(), its reward): the user's code
    is broken, and the step would have nothing to train on. The lines name the logs with the
    tracebacks."""
    failed, n = scored.failed, len(scored.rewards)
    if scored.all_failed:
        first = next(e for e in scored.errors if e is not None)
        raise UserError(f"{first.line} (all {n} samples of step {step} failed"
                        f"{scored.logs_text(list(range(n)))})")  # fmt: skip
    if failed:
        log.warning("step %d: the reward failed on %d of %d samples; their groups are dropped "
                    "(first: %s)%s", step, len(failed), n, scored.failures[0],
                    scored.logs_text(failed))  # fmt: skip
    return failed


NONFINITE_INPUTS = {  # input -> what the non-finite guard's error calls it (train/loop.py)
    "advantages": "advantages",
    "logprobs": "rollout log-probs",
}


def nonfinite_inputs(samples, advantages: torch.Tensor) -> dict[str, int]:
    """The step's inputs that are not finite, counted (absent when none): advantages (finite
    rewards too large for them), the servers' log-probs of the model's tokens. Rewards are
    checked finite where they are scored. (Logged as input/nonfinite_<input>.)"""
    counts = {
        "advantages": int((~torch.isfinite(advantages)).sum()),
        "logprobs": sum(
            not math.isfinite(v) for s in samples for v in (s.logprobs or ()) if v is not None
        ),
    }
    return {k: n for k, n in counts.items() if n}
