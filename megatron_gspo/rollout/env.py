"""Environments of multi-turn rollouts: the code that answers the model's turns.

    env:
      fn: my_envs:GuessEnv      # module:name or path/to/file.py:name; or `tools` (rollout/tools.py)

`fn(row)` starts an episode for a data row (`row.prompt`, `row.answer`, and `row.extra`: the
dataset row's other fields). It is a class or a function; what it returns is the episode, an
object with

    step(turn) -> Step                    required; `turn` is a Turn (the model's text and ids)
    prompt() -> str | list[dict] | None   optional: the first prompt as text, or chat messages
                                          (rendered with the tokenizer's chat template); None or
                                          absent: the row's prompt, as single-turn rollouts use it

Either method may be `async def`: many episodes are in flight at once, and an awaitable is
awaited on the rollouts' event loop. A plain method runs on a worker thread, so a slow one does
not hold the others up. `Step.observation` is what the environment says next: text (tokenized
as it is), chat messages (`[{"role": "tool", "content": "42"}]`: rendered as the chat template
continues a conversation, the generation prompt included), or token ids. `done` ends the episode;
`reward` (at any step, the last one given counts) replaces `reward.fn` for it.

A call that raises, runs past `env.timeout_s` or returns something else than the above fails its
episode: EnvError, which the runner counts and logs (with the traceback) in RUN_DIR/logs/env.log;
the episode's reward is 0. Nothing the environment does ends the run. A plain method that hangs
keeps its worker thread (Python cannot stop it): the pool has ENV_THREADS of them.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

ENV_THREADS = 64


@dataclass
class Turn:
    """One model turn: its text (decoded with special tokens, as a parser needs it), ids, why it
    ended (stop: the model's end of turn; length: the turn's token limit), its index."""

    text: str
    ids: list[int]
    finish_reason: str
    index: int


@dataclass
class Step:
    observation: str | list[int] | list[dict] | None = None
    done: bool = False
    reward: float | None = None


class EnvError(Exception):
    """The environment's code failed on an episode (which then ends, with reward 0)."""


def load_env(spec: str):
    """The episode factory named by `spec` (module:name or file.py:name)."""
    from megatron_gspo.rewards.plugin import load_plugin

    return load_plugin(spec, kind="environment", usage="fn(row) -> an episode with step(turn)")


class EnvCalls:
    """Calls into the environment's code: each bounded by `timeout_s`, plain ones on a thread of
    a pool of their own, results checked."""

    def __init__(self, factory, timeout_s: float, vocab_size: int):
        self.factory, self.timeout_s, self.vocab_size = factory, timeout_s, vocab_size
        self._pool = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="env")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, what: str, fn, *args) -> Any:
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(self._pool, fn, *args), self.timeout_s
            )
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self.timeout_s)
        except TimeoutError:
            raise EnvError(f"{what} ran past env.timeout_s ({self.timeout_s:g} s)") from None
        except Exception as e:
            raise EnvError(f"{what} raised {type(e).__name__}: {e}") from e
        return result

    async def start(self, row) -> Any:
        return await self._call("starting the episode", self.factory, row)

    async def prompt(self, episode) -> str | list[dict] | None:
        fn = getattr(episode, "prompt", None)
        if fn is None:
            return None
        value = await self._call("prompt()", fn)
        if value is None or isinstance(value, str) or _messages(value):
            return value
        raise EnvError(f"prompt() returned {_short(value)}; return text, chat messages or None")

    async def step(self, episode, turn: Turn) -> Step:
        fn = getattr(episode, "step", None)
        if not callable(fn):
            raise EnvError(f"the episode ({type(episode).__name__}) has no step(turn) method")
        return self.checked(await self._call("step()", fn, turn))

    def checked(self, value) -> Step:
        """`value` as a Step, or EnvError saying what is wrong with it."""
        if not isinstance(value, Step):
            raise EnvError(f"step() returned {_short(value)}; return a Step")
        obs, reward = value.observation, value.reward
        if not isinstance(value.done, bool):
            raise EnvError(f"Step.done is {_short(value.done)}; it must be True or False")
        if reward is not None and not (
            isinstance(reward, numbers.Real) and not isinstance(reward, bool)
            and math.isfinite(reward)
        ):  # fmt: skip
            raise EnvError(f"Step.reward is {_short(reward)}; give a finite number or None")
        if obs is None or isinstance(obs, str) or _messages(obs) or self._ids(obs):
            return value
        raise EnvError(
            f"Step.observation is {_short(obs)}; give text, chat messages or token ids in "
            f"[0, {self.vocab_size})"
        )

    def _ids(self, value) -> bool:
        return isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
            for t in value
        )


def _messages(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )  # fmt: skip
    )


def _short(value, limit: int = 80) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
