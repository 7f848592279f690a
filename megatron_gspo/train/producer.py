"""Rank 0's batch producer: a step's prompts -> G responses each (generation.py: completions or
episodes) -> rewards -> group advantages -> the `StepBatch`, with its facts and metrics; and the
greedy eval on held-out prompts. share.py hands its results to the other ranks.

Determinism: every request carries `sampling_seed = f(seed, step)` + its index, so a resumed run
draws the same responses as an uninterrupted one (the servers hold the same weights after the
resume's first sync).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.config import Config
from megatron_gspo.rollout.sample import Sample, older_than
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.train.generate import Generation
from megatron_gspo.train.io_thread import IoThread
from megatron_gspo.train.results import Collected
from megatron_gspo.train.samples import (
    check_samples,
    nonfinite_inputs,
    report_broken_rows,
    reward_failures,
    rollout_metrics,
    sample_versions,
    to_batch,
)

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient

log = logging.getLogger(__name__)


class PromptSet:
    """The train and eval prompts (`data.train`, `data.eval`) and their tokenization."""

    def __init__(self, cfg: Config, hf_dir: Path):
        from transformers import AutoTokenizer

        from megatron_gspo.data.prompts import load_prompts

        d = cfg.data
        self.train = load_prompts(d.train, "train", cfg.seed)
        self.eval = load_prompts(d.eval or d.train, "eval", cfg.seed)
        report_broken_rows(self.train, "data.train")
        if d.eval and d.eval != d.train:
            report_broken_rows(self.eval, "data.eval")
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.template, self.max_tokens = d.template, d.max_prompt_tokens
        line = self.cut_notice()
        if line:
            print(line, flush=True)

    def encode(self, text: str) -> list[int]:
        """A prompt's tokens under `data.template`, its last `data.max_prompt_tokens` kept."""
        ids = self.encode_whole(text)
        return ids[-self.max_tokens :] if len(ids) > self.max_tokens else ids

    def encode_whole(self, text: str) -> list[int]:
        from megatron_gspo.data.prompts import encode_prompt

        return encode_prompt(self.tokenizer, text, self.template)

    def longest(self, among: int = 1024) -> int:
        """The longest of the first `among` train prompts, in tokens (SGLang's sizing)."""
        return max((len(self.encode(row.prompt)) for row in self.train.rows[:among]), default=0)

    def cut_notice(self, among: int = 1024) -> str | None:
        """A line saying how many of the first `among` train prompts are longer than
        data.max_prompt_tokens, which `encode` cuts to their last tokens; None if none is."""
        rows = self.train.rows[:among]
        over = [n for n in (len(self.encode_whole(r.prompt)) for r in rows) if n > self.max_tokens]
        if not over:
            return None
        where = f"the first {len(rows)}" if len(rows) < len(self.train.rows) else str(len(rows))
        return (
            f"data.train: {len(over)} of {where} prompts are longer than data.max_prompt_tokens "
            f"({self.max_tokens} tokens; the longest {max(over)}); each is cut to its last "
            f"{self.max_tokens} tokens: raise data.max_prompt_tokens or shorten them"
        )


class BatchProducer:
    """Rank 0: `produce` a step's batch from the servers' `generator` client, `evaluate` the
    policy; `hold` / `abort` the generation in flight (rollout.partial, the end of a run)."""

    def __init__(
        self,
        cfg: Config,
        prompts: PromptSet,
        gen: Generation,
        generator: RolloutClient,
        io: IoThread,
    ):
        """`gen`: completions or episodes, and their rewards; `generator`: the client requests
        go through (the router, else every server); `io`: the loop the clients live on."""
        self.cfg, self.prompts, self.gen, self.generator, self.io = cfg, prompts, gen, generator, io

    @property
    def n_train_prompts(self) -> int:
        return len(self.prompts.train.rows)

    def produce(self, prompt_index: list[int], step: int, version: str | None = None) -> Collected:
        """The step's batch of the train prompts `prompt_index`, G samples each, and its metrics
        (any thread: ahead.py runs it on one of its own while the trainer trains). Groups with
        a sample from weights older than `version` (a restarted server's), or with a failed
        reward, are dropped: a group is trained on whole or not at all, since its baseline is
        the mean of its samples, which must all come from the policy the step's old log-probs
        belong to. No group left: `batch` is None."""
        from megatron_gspo.rewards import dynamic_sampling_keep, overlong_shaped

        cfg, r, G = self.cfg, self.cfg.rollout, self.cfg.rollout.group_size
        t0 = time.perf_counter()
        rows = [self.prompts.train.rows[i] for i in prompt_index]
        prompts = [self.prompts.encode(row.prompt) for row in rows]
        r3 = cfg.algo.routing_replay == ReplayMode.R3
        grouped = r.group_requests and not r.router_url  # (sglang-router takes no batches)
        out = self.io.run(self.gen.rollout(self.generator, rows, prompts, G,
                                           self.sampling(step), r3, grouped, step))  # fmt: skip
        t_gen = time.perf_counter() - t0 - out.reward_wait_s  # (until the generation ended)
        samples = [s for g in out.groups for s in g]
        check_samples(samples)
        scored = out.scored.rewards
        failed = reward_failures(out.scored, step)
        rewards = overlong_shaped(cfg, samples, [0.0 if v is None else v for v in scored])
        metrics = rollout_metrics(samples, scored, t_gen)
        facts = Collected(None, metrics, samples=len(samples), generation_s=t_gen)
        metrics["reward/failed_samples"] = float(len(failed))
        metrics["time/reward_wait_s"] = out.reward_wait_s  # (scoring after generation ended)
        stale = self._stale_groups(samples, step, version, facts)
        keep = list(range(len(out.groups)))
        if cfg.algo.dynamic_sampling:
            keep = dynamic_sampling_keep(rewards, G)
            metrics["rollout/groups_kept"] = float(len(keep))
        unscored = {k // G for k in failed}  # (a group without its baseline sample)
        metrics["rollout/reward_failed_groups_dropped"] = float(len(unscored))
        keep = [g for g in keep if g not in stale | unscored]
        if not keep:
            return facts
        samples = [samples[g * G + j] for g in keep for j in range(G)]
        facts.set_versions(*sample_versions(samples))  # (the weights the tokens came from)
        kept_rewards = torch.tensor(rewards, dtype=torch.float64).view(-1, G)[keep].flatten()
        adv = group_advantages(kept_rewards, G, scale_by_std=cfg.algo.advantage_std_norm)
        facts.set_nonfinite_inputs(nonfinite_inputs(samples, adv))  # (the guard names them)
        facts.batch = to_batch(samples, adv.tolist(), kept_rewards.tolist())
        return facts

    def _stale_groups(
        self, samples: list[Sample], step: int, version: str | None, facts: Collected
    ) -> set[int]:
        """The groups with a sample from weights older than `version` (a server restarted onto
        an older restore point), counted into `facts`; a sample no weights wrote (an episode
        that failed before the model's first turn) is not stale."""
        if version is None:
            return set()
        G = self.cfg.rollout.group_size
        old = [k for k, s in enumerate(samples) if older_than(s, version)]
        stale = {k // G for k in old}
        facts.metrics["rollout/stale_samples"] = float(len(old))
        facts.stale_samples = len(old)
        facts.unwritten = sum(s.weight_version is None for s in samples)
        facts.stale_version = str(samples[old[0]].weight_version) if old else ""
        facts.metrics["rollout/stale_groups_dropped"] = float(len(stale))
        if old:
            log.warning("step %d: %d samples came from weights older than %s; their %d groups "
                        "are dropped", step, len(old), version, len(stale))  # fmt: skip
        return stale

    def sampling(self, step: int, greedy: bool = False) -> dict:
        """The requests' sampling parameters: seeded by (seed, step), or greedy (eval)."""
        r = self.cfg.rollout
        params = {"max_new_tokens": r.max_new_tokens}
        if greedy:
            return params | {"temperature": 0.0}
        seed = (self.cfg.seed * 1_000_003 + step * 65_537) % (2**31)
        return params | {"temperature": r.temperature, "top_p": r.top_p, "sampling_seed": seed}

    def evaluate(self) -> float:
        """Mean greedy reward on the first `train.eval_prompts` held-out prompts (a failed
        reward counts as wrong)."""
        rows = self.prompts.eval.rows[: self.cfg.train.eval_prompts]
        prompts = [self.prompts.encode(row.prompt) for row in rows]
        greedy = self.sampling(0, greedy=True)
        scored = self.io.run(self.gen.rollout(self.generator, rows, prompts, 1, greedy)).scored
        if scored.failures:
            log.warning("eval: the reward failed on %d of %d samples, counted wrong (first: %s)%s",
                        len(scored.failures), len(rows), scored.failures[0],
                        scored.logs_text(scored.failed))  # fmt: skip
        return sum(v or 0.0 for v in scored.rewards) / max(len(rows), 1)

    def hold(self, on: bool) -> None:
        """rollout.partial: hold the generation in flight before a weight sync (its requests
        are aborted and none is sent), or let it go on after (rollout/partial.py)."""
        hold = self.generator.hold
        self.io.run(hold.pause()) if on else self.io.call(hold.resume)

    def abort(self) -> None:
        """Abort every request in flight (they return what they have so far), for good."""
        self.io.call(self.generator.hold.stop)
        self.io.run(self.generator.abort())
