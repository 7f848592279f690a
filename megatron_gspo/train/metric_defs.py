"""What each key of `metrics.jsonl` means: one definition per key, the source of docs/metrics.md
(`python -m megatron_gspo.docs_gen`). tests/e2e/test_metric_keys.py ties the table to real runs:
a key a run logs that this table lacks fails it, and so does a key here that no run (or, for a key
only a fault writes, its writer) writes, so the glossary cannot fall behind the code or ahead of it.

A key `a/b_<i>` stands for a family (`<i>` a layer index); metrics are for logging only: the
loop decides on typed results, never on these keys.
"""

from __future__ import annotations

import re

GROUPS: dict[str, dict[str, str]] = {
    "Reward and answers": {
        "reward/mean": "mean reward of the step's generated samples (before any group is "
        "dropped; samples whose reward failed left out)",
        "reward/std": "std of those rewards",
        "eval/reward": "greedy reward on held-out prompts (every `train.eval_every` steps, step 0)",
        "response/length_mean": "mean answer length in tokens (a multi-turn episode's: the "
        "model's and the environment's tokens after the prompt; `env/model_tokens_mean` is the "
        "model's alone)",
        "response/length_max": "longest answer in tokens (as `response/length_mean` counts them)",
        "response/truncated_fraction": "share of answers cut at `rollout.max_new_tokens`",
        "reward/failed_samples": "samples with no reward: reward.fn failed (raised, hung, no finite "
        "number), the episode failed before the model's first turn, or the server ended it for "
        "a finish reason the trainer does not know",
    },
    "The update": {
        "loss/policy": "the policy loss (mean over the step's minibatch updates)",
        "grad_norm": "gradient norm before clipping (mean over updates)",
        "lr": "learning rate of the last update",
        "entropy": "mean token entropy of the policy on the trained tokens",
        "kl/old": "approximate KL to the old policy (k3 on the trained tokens)",
        "kl/ref": "KL to the reference policy (the run's starting weights; `algo.kl_coef` > 0): "
        "the mean of `algo.kl_estimator` over the trained tokens",
        "kl/reward_penalty": "`algo.kl_in: reward`: the mean over samples of `algo.kl_coef` x "
        "the sample's summed KL, taken off its reward before the advantages",
        "ratio/mean": "importance ratio: the sequence ratio for GSPO, the token ratio for GRPO",
        "ratio/std": "its std",
        "ratio/max": "its largest value",
        "ratio/min": "its smallest value",
        "ratio/first_update_mean": "the first update's mean ratio (1 when old log-probs are exact)",
        "ratio/clip_fraction_tokens": "share of tokens whose ratio was clipped",
        "ratio/clip_fraction_seqs": "share of sequences with a clipped ratio",
        "ratio/token_std_routing_same": "std of token log-ratios where the MoE routing did not move",
        "ratio/token_std_routing_changed": "std of token log-ratios where the routing moved",
        "tis/weight_mean": "mean truncated importance-sampling weight (`algo.mismatch: tis`)",
        "mismatch/masked_fraction_tokens": "share of trained tokens masked by `algo.mismatch` "
        "mis or icepop",
        "mismatch/masked_fraction_seqs": "share of sequences masked by it (sequence level)",
        "sapo/gate_mean": "mean of SAPO's soft gate over the trained tokens (`algo.loss: sapo`)",
        "update/skipped": "updates skipped this step (a non-finite loss or gradient norm)",
        "update/nonfinite": "updates whose loss or gradient norm was not finite",
        "input/nonfinite_advantages": "non-finite advantages found in the step's batch "
        "(written only on a step that has some)",
        "input/nonfinite_logprobs": "non-finite log-probs found in the step's batch (written "
        "only on a step that has some)",
    },
    "Train-inference mismatch and routing": {
        "mismatch/logprob_abs_diff": "mean abs trainer - rollout log-prob over the trained tokens",
        "mismatch/logprob_abs_diff_routing_same": "the same where routing agreed in every layer (R3)",
        "mismatch/logprob_abs_diff_routing_differs": "the same where some layer's routing differed",
        "routing/changed_fraction": "share of token x MoE-layer top-k sets that moved since the "
        "old log-probs",
        "routing/changed_fraction/layer_<i>": "the same in MoE layer i",
        "routing/tokens_changed_any": "share of trained tokens whose routing moved in any layer",
        "routing/rollout_train_agreement": "share of (token, layer) top-k sets the trainer and "
        "the rollout agree on (R3)",
        "routing/rollout_train_agreement/layer_<i>": "the same in MoE layer i",
        "routing/bytes_per_token": "bytes of recorded routing per token",
    },
    "Rollouts": {
        "rollout/samples": "samples generated for the step",
        "rollout/groups_kept": "`algo.dynamic_sampling` only: the groups it kept (rewards not "
        "all equal), before the stale and failed-reward groups are dropped",
        "rollout/stale_samples": "samples from weights other than the step's",
        "rollout/regenerated_samples": "samples generated again once a restarted server caught up",
        "rollout/stale_groups_dropped": "groups dropped for stale samples",
        "rollout/reward_failed_groups_dropped": "groups dropped for a failed reward",
        "rollout/staleness_mean": "weight versions between the samples' and the trainer's "
        "(mean over the model's tokens)",
        "rollout/staleness_max": "the largest of those",
        "rollout/version_oldest": "the oldest weight version a trained sample came from",
        "rollout/version_mean": "mean weight version of the trained samples",
        "rollout/partial_fraction": "samples whose tokens came from more than one version",
        "weight_version": "the weight version the servers hold after the step's sync",
        "env/turns_mean": "mean turns per episode (multi-turn environments)",
        "env/model_tokens_mean": "mean model tokens per episode",
        "env/env_tokens_mean": "mean environment tokens per episode",
        "env/errors": "episodes ended by the environment's failure",
        "env/reward_given": "episodes whose environment gave a reward",
    },
    "Time and throughput": {
        "time/rollout_s": "generation (and rewards) of the step's batch",
        "time/reward_wait_s": "waiting for rewards after the generation ended",
        "time/old_logprobs_s": "the old-log-prob forward",
        "time/train_s": "the training phase (every minibatch update)",
        "time/sync_s": "the weight sync to the servers",
        "time/catch_up_s": "bringing a restarted server to the current weights",
        "time/eval_s": "the greedy eval",
        "time/step_s": "the whole step",
        "time/trainer_idle_s": "the trainer waiting for its batch",
        "time/servers_idle_s": "the step's time before its sync that a server's engine did not work",
        "tokens_per_s": "prompt and response tokens of the step's generated samples (an "
        "episode's environment tokens included; before any group is dropped) per second of the "
        "step",
        "train/padding_fraction": "share of the microbatches' token slots that are padding "
        "(`train.pack`: packed under `train.max_tokens_per_microbatch`, else padded rows)",
        "train/tokens_per_microbatch": "real tokens per microbatch",
        "sync/gb_per_s": "weight-sync bandwidth",
        "sync/failed_servers": "servers the sync failed on",
        "sync/caught_up_servers": "servers caught up after a restart",
    },
}

DEFINITIONS: dict[str, str] = {k: v for group in GROUPS.values() for k, v in group.items()}
_FAMILIES = [
    (re.compile("^" + re.escape(k).replace(re.escape("<i>"), r"\d+") + "$"), k)
    for k in DEFINITIONS
    if "<i>" in k
]


def entry(key: str) -> str | None:
    """The registered key that a logged `key` falls under: itself, or its family
    (`routing/changed_fraction/layer_3` -> `routing/changed_fraction/layer_<i>`); None: none."""
    if key in DEFINITIONS:
        return key
    for pattern, family in _FAMILIES:
        if pattern.match(key):
            return family
    return None


def definition(key: str) -> str | None:
    """What `key` means, or None when it is not defined."""
    found = entry(key)
    return None if found is None else DEFINITIONS[found]


def undefined(keys) -> list[str]:
    """The keys of a metrics row (`step` aside) that have no definition."""
    return sorted(k for k in keys if k != "step" and definition(k) is None)
