"""Multi-turn rollouts: the model writes a turn, the environment answers, the model writes again.

An episode is one sample. Each model turn is a /generate request that continues from token ids
(the prompt and every token so far, as they were: no text is tokenized twice, so nothing drifts
between turns, and SGLang's radix cache shares the prefix). The sample's response is everything
after the prompt: model tokens (loss mask 1, with their rollout log-probs) and environment tokens
(loss mask 0, no log-probs). Environment answers become tokens as the chat template continues a
conversation (`ChatRender.continuation`): the text the template puts after an assistant turn
that ended with the model's end-of-turn token.

R3: each request returns the routing of every token it processed; the sample keeps, for each
position, the routing of the request that first computed it (a model token's from the turn that
wrote it), so the whole sequence is covered and matches what the behavior policy did.

The episode ends when the environment says done, after `max_turns` model turns, when `max_tokens`
tokens follow the prompt (an environment answer that would cross it is not appended), or when
the environment's code fails (env.py: EnvError, recorded on the sample).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_gspo.bounded import LOG_BYTES, FailureLog, one_line
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.env import EnvCalls, EnvError, Episode, Step, Turn
from megatron_gspo.rollout.partial import finish
from megatron_gspo.rollout.sample import Sample, oldest_version


@dataclass
class Limits:
    max_turns: int
    max_turn_tokens: int
    max_tokens: int
    max_prompt_tokens: int | None = None  # an environment's first prompt (data.max_prompt_tokens)


class ChatRender:
    """Prompts and environment answers as token ids, by the tokenizer's chat template."""

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.eos_token or ""
        # no token stands for more characters than this (4x its longest entry: a normalizer may
        # shorten text), so a longer text needs more tokens than a budget, known untokenized
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.chars_per_token = 4 * max(map(len, vocab), default=64)

    def fits(self, texts: list[str], tokens: int) -> bool:
        """Whether `texts` may fit in `tokens` tokens (False: they certainly do not)."""
        return sum(map(len, texts)) <= tokens * self.chars_per_token

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: list[dict], tools=None, generation: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise EnvError("the environment gave chat messages, but the tokenizer has no chat "
                           "template; give text or token ids instead")  # fmt: skip
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=False
            )
        except Exception as e:  # (the template's raise_exception: a role it does not take, ...)
            raise EnvError(
                f"the tokenizer's chat template refused the environment's messages "
                f"({one_line(f'{type(e).__name__}: {e}', 200)}); give messages it renders, or text"
            ) from e

    def prompt(self, messages: list[dict], tools=None) -> list[int]:
        return self.encode(self._render(messages, tools, generation=True))

    def continuation(self, messages: list[dict]) -> list[int]:
        """What the template writes after an assistant turn for `messages` (tool results, a user
        message), the next generation prompt included; the turn's own end-of-turn token, which
        the model wrote, excluded."""
        before = self._render(self._BASE)
        after = self._render(self._BASE + messages, generation=True)
        if not after.startswith(before):
            raise EnvError("the chat template renders a conversation's start differently once "
                           "more messages follow; give the observation as text")  # fmt: skip
        cut = before.rfind(self.end_of_turn) if self.end_of_turn else -1
        tail = before[cut + len(self.end_of_turn) :] if cut >= 0 else ""
        return self.encode(tail + after[len(before) :])


@dataclass
class _Episode:
    """The sample being built, turn by turn."""

    sample: Sample
    routing: list[np.ndarray]
    rows: int = 0  # positions whose routing is in `routing`
    reward: float | None = None

    def add_model(self, turn: Sample) -> None:
        s = self.sample
        s.tokens += turn.tokens
        s.loss_mask = (s.loss_mask or []) + [1] * len(turn.tokens)
        s.logprobs = (s.logprobs or []) + list(turn.logprobs or [None] * len(turn.tokens))
        s.versions += turn.versions or [str(turn.weight_version)]
        s.token_versions = (s.token_versions or []) + (
            turn.token_versions or [str(turn.weight_version)] * len(turn.tokens)
        )
        s.server, s.latency_s, s.turns = turn.server, s.latency_s + turn.latency_s, s.turns + 1
        if turn.routed_experts is not None:
            self.routing.append(turn.routed_experts[self.rows :])
            self.rows = len(turn.routed_experts)

    def add_env(self, ids: list[int]) -> None:
        s = self.sample
        s.tokens += ids
        s.loss_mask = (s.loss_mask or []) + [0] * len(ids)
        s.logprobs = (s.logprobs or []) + [None] * len(ids)
        s.token_versions = (s.token_versions or []) + [None] * len(ids)

    def finish(self, reason: str) -> Sample:
        s = self.sample
        s.finish_reason = reason
        s.env_reward = self.reward
        # the oldest weights any turn came from (train/ahead.py); none wrote an episode that
        # failed before its first model turn (it is never stale: train/producer.py)
        s.weight_version = oldest_version(s.versions) if s.versions else None
        if self.routing:
            s.routed_experts = np.concatenate(self.routing)
        return s


def _over(size: str, cap: int) -> EnvError:
    return EnvError(f"prompt() returned {size}, over data.max_prompt_tokens ({cap} tokens); "
                    "return a shorter prompt or raise data.max_prompt_tokens")  # fmt: skip


class EpisodeRunner:
    """Runs episodes against the rollout servers and the environment (`calls`)."""

    def __init__(self, calls: EnvCalls, render: ChatRender, limits: Limits,
                 log_path: Path | None = None, log_bytes: int = LOG_BYTES):  # fmt: skip
        """`log_path`: each failed episode's line and traceback (RUN_DIR/logs/env.log), up to
        `log_bytes` (past it failed episodes are only counted, as env/errors)."""
        self.calls, self.render, self.limits = calls, render, limits
        self.log = FailureLog(log_path, "env/errors", log_bytes)

    async def run(self, client: RolloutClient, row, prompt_ids: list[int], sampling: dict,
                  routed: bool, where: tuple[int, int], seed_stride: int) -> Sample:  # fmt: skip
        """One episode for data row `row`, its turns generated by `client`'s servers: sample
        `where` = (prompt index, sample index); turn t draws with sampling_seed + t *
        seed_stride (every turn of every episode its own)."""
        ep = _Episode(Sample(where[0], where[1], list(prompt_ids), rid=f"episode-{where}"), [])
        episode = None
        try:
            episode = await self.calls.start(row)
            first = await self.calls.prompt(episode)
            if first is not None:
                ep.sample.prompt_ids = self._prompt(first, episode.tools)
            return await self._turns(client, ep, episode, sampling, routed, seed_stride)
        except EnvError as e:
            self._failed(ep.sample, e, row)
            return ep.finish("stop")
        finally:
            if episode is not None:
                self.calls.end(episode)

    def _prompt(self, first, tools) -> list[int]:
        """The environment's first prompt as tokens: not empty, and within the prompt length the
        config sized the servers and the context for (or the servers would refuse it)."""
        cap = self.limits.max_prompt_tokens
        texts = [first] if isinstance(first, str) else [m["content"] for m in first]
        if cap is not None and not self.render.fits(texts, cap):  # (megabytes: not tokenized)
            raise _over(f"{sum(map(len, texts))} characters", cap)
        ids = (
            self.render.encode(first)
            if isinstance(first, str)
            else self.render.prompt(first, tools)
        )
        if not ids:
            raise EnvError("prompt() returned an empty prompt; return text, chat messages, or "
                           "None for the row's prompt")  # fmt: skip
        if cap is not None and len(ids) > cap:
            raise _over(f"{len(ids)} tokens", cap)
        return ids

    async def _turns(self, client: RolloutClient, ep: _Episode, episode: Episode, sampling: dict,
                     routed: bool, seed_stride: int) -> Sample:  # fmt: skip
        lim, s = self.limits, ep.sample
        for t in range(lim.max_turns):
            budget = min(lim.max_turn_tokens, lim.max_tokens - len(s.tokens))
            sp = dict(sampling, max_new_tokens=budget)
            if sp.get("sampling_seed") is not None:
                sp["sampling_seed"] = int(sp["sampling_seed"]) + t * seed_stride
            ids, holds = s.prompt_ids + s.tokens, client.hold.holds
            [[turn]] = await client.generate([ids], 1, sp, return_routed_experts=routed)
            await finish(client.hold, turn, sp, routed, holds)  # (a weight update cut it short)
            if turn.aborted or turn.ended_unknown:  # (neither is trained on)
                ep.add_model(turn)
                return ep.finish(turn.finish_reason)
            ep.add_model(turn)
            text = self.render.tokenizer.decode(turn.tokens, skip_special_tokens=False)
            step = await self.calls.step(episode, Turn(text, list(turn.tokens),
                                                       turn.finish_reason, t))  # fmt: skip
            ep.reward = ep.reward if step.reward is None else float(step.reward)
            if step.done:
                return ep.finish("stop")
            room = lim.max_tokens - len(s.tokens)
            obs = self._observation(step, room)
            if t + 1 == lim.max_turns or obs is None or len(obs) >= room:
                break
            ep.add_env(obs)
        return ep.finish("length")

    def _observation(self, step: Step, room: int) -> list[int] | None:
        """The observation's tokens; None when its text cannot fit in `room` tokens, found
        without tokenizing it (megabytes of text would hold the trainer's loop for seconds)."""
        obs = step.observation
        if obs is None:
            return []
        texts = (
            [obs] if isinstance(obs, str) else [m["content"] for m in obs if isinstance(m, dict)]
        )
        if not self.render.fits(texts, room):
            return None
        if isinstance(obs, str):
            return self.render.encode(obs)
        if obs and isinstance(obs[0], dict):
            return self.render.continuation(obs)  # type: ignore[arg-type]
        return list(obs)  # type: ignore[arg-type]

    def _failed(self, sample: Sample, error: EnvError, row) -> None:
        """The episode's line (and traceback) in the log; the console gets one line a step
        (train/generate.py)."""
        sample.env_error = str(error)
        if self.log.path is not None:
            detail = error.detail or "".join(traceback.format_exception(error))
            self.log.write(f"episode {sample.rid} (prompt {row.prompt[:80]!r}): {error}\n"
                           f"{detail.rstrip()}\n\n")  # fmt: skip
