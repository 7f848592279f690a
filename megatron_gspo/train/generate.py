"""How a step's prompts become scored samples: one completion per sample or, with `env.fn`, one
episode per sample (rollout/episodes.py), and the rewards of either.

A completion's reward is `reward.fn(prompt, response, answer)`. An episode's is the last reward
its environment gave, else `reward.fn` on its last model turn (the answer, for a tool-calling
episode); an episode whose environment failed gets 0 (RUN_DIR/logs/env.log says why), or, when it
failed before the model wrote anything, counts as a failed reward (its group is dropped).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, cast

from megatron_gspo.config import Config
from megatron_gspo.rewards import Scored, load_reward, score_each
from megatron_gspo.rollout.partial import finish
from megatron_gspo.rollout.sample import Sample

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient


class Generation:
    """Rank 0: the step's samples (`groups`) and their rewards (`score`)."""

    def __init__(self, cfg: Config, tokenizer, run_dir: Path):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.reward_fn = load_reward(cfg.reward.fn)
        self.runner = None
        if cfg.env.fn is not None:
            self.runner = _runner(cfg, tokenizer, run_dir / "logs" / "env.log")

    def close(self) -> None:
        if self.runner is not None:
            self.runner.calls.close()

    async def groups(self, client: RolloutClient, rows, prompts: list[list[int]], n: int,
                     sampling: dict, routed: bool = False, grouped: bool = False
                     ) -> list[list[Sample]]:  # fmt: skip
        """result[i][j]: sample j of prompt i (its completion, or its episode)."""
        if self.runner is None:
            holds = client.hold.holds
            out = await client.generate(prompts, n=n, sampling_params=sampling,
                                        return_routed_experts=routed, grouped=grouped)  # fmt: skip
            # samples a weight update interrupted go on on the new weights (rollout/partial.py)
            cut = [(s, _seeded(sampling, i * n + s.sample_index))
                   for i, group in enumerate(out) for s in group if s.aborted]  # fmt: skip
            await asyncio.gather(*(finish(client.hold, s, sp, routed, holds) for s, sp in cut))
            return out
        runner = self.runner
        stride = len(prompts) * n  # turn t of episode k draws seed + k + t * stride
        tasks = [
            runner.run(client, row, ids, _seeded(sampling, i * n + j), routed, (i, j), stride)
            for i, (row, ids) in enumerate(zip(rows, prompts))
            for j in range(n)
        ]
        done = await asyncio.gather(*tasks)
        return [list(done[i * n : (i + 1) * n]) for i in range(len(prompts))]

    def score(self, rows, samples: list[Sample]) -> Scored:
        """Each sample's reward (None: failed, `failures` says why)."""
        rewards: list[float | None] = [None] * len(samples)
        failures: list[str] = []
        ask = []  # the samples reward.fn scores
        for k, s in enumerate(samples):
            if s.env_error is not None and not s.tokens:
                failures.append(f"environment {self.cfg.env.fn!r} failed: {s.env_error}")
            elif s.env_error is not None:
                rewards[k] = 0.0
            elif s.env_reward is not None:
                rewards[k] = float(s.env_reward)
            else:
                ask.append(k)
        items = [(rows[samples[k].prompt_index].prompt, self.text(samples[k]),
                  rows[samples[k].prompt_index].answer) for k in ask]  # fmt: skip
        scored = score_each(self.reward_fn, items, self.cfg.reward.fn)
        for k, value in zip(ask, scored.rewards):
            rewards[k] = value
        return Scored(rewards, failures + scored.failures)

    def text(self, s: Sample) -> str:
        """The response text a reward function sees: the last model turn of an episode."""
        tokens = s.tokens
        if s.loss_mask is not None and 0 in s.loss_mask:
            last_env = len(s.loss_mask) - 1 - s.loss_mask[::-1].index(0)
            tokens = tokens[last_env + 1 :]
        return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True))


def _seeded(sampling: dict, k: int) -> dict:
    if sampling.get("sampling_seed") is None:
        return sampling
    return sampling | {"sampling_seed": int(sampling["sampling_seed"]) + k}


def _runner(cfg: Config, tokenizer, log_path: Path):
    from megatron_gspo.rollout.env import EnvCalls, load_env
    from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits
    from megatron_gspo.rollout.tool_env import tool_env

    e = cfg.env
    factory = tool_env(e.tools) if e.fn == "tools" else load_env(cast(str, e.fn))
    calls = EnvCalls(factory, e.timeout_s, len(tokenizer))
    limits = Limits(e.max_turns, e.max_turn_tokens or cfg.rollout.max_new_tokens, e.max_tokens)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return EpisodeRunner(calls, ChatRender(tokenizer), limits, log_path)
