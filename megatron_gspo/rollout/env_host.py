"""The environment's side of an episode, in a worker process (megatron_gspo/bounded): the episode
objects started there, by key, and the calls into them (rollout/env.py says how episodes are
placed and bounded).

Each call's result is checked here, where the object is (a message can name what is wrong with
it), and sent back as plain data; the trainer checks it again. An `async def` method is run to
its end on this worker's own event loop, kept for the worker's life (an episode may hold objects
bound to it).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from megatron_gspo.bounded import Refused
from megatron_gspo.rollout.env import TOOLS, EnvError, checked_prompt, checked_step, load_env


def episode_host(spec: dict) -> Callable[..., Any]:
    """The handler a worker calls: host(op, key, payload) (the loader bounded/worker.py names)."""
    return EpisodeHost(spec)


async def _awaited(value: Any) -> Any:
    return await value


class EpisodeHost:
    def __init__(self, spec: dict):
        if spec["fn"] == TOOLS:
            from megatron_gspo.rollout.tool_env import tool_env

            self.factory = tool_env(spec["tools"])
        else:
            self.factory = load_env(spec["fn"])
        self.vocab_size: int = spec["vocab_size"]
        self.episodes: dict[int, Any] = {}
        self.loop = asyncio.new_event_loop()
        self.ops: dict[str, Callable[[int, Any], Any]] = {
            "start": self.start, "prompt": self.prompt, "step": self.step, "end": self.end,
        }  # fmt: skip

    def __call__(self, op: str, key: int, payload: Any) -> Any:
        try:
            return self.ops[op](key, payload)
        except EnvError as e:  # (what the checks found wrong with a result)
            raise Refused(str(e)) from None

    def _run(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            return self.loop.run_until_complete(_awaited(value))
        return value

    def _episode(self, key: int) -> Any:
        if key not in self.episodes:
            raise Refused("the episode is not in its worker any more")
        return self.episodes[key]

    def start(self, key: int, row: Any) -> dict:
        episode = self._run(self.factory(row))
        self.episodes[key] = episode
        tools = getattr(episode, "tools", None)
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):  # fmt: skip
            raise Refused(f"the episode's `tools` is a {type(tools).__name__}; give a list of "
                          "function schemas (dicts) or None")  # fmt: skip
        return {"tools": tools}

    def prompt(self, key: int, _: Any) -> Any:
        fn = getattr(self._episode(key), "prompt", None)
        return None if fn is None else checked_prompt(self._run(fn()))

    def step(self, key: int, turn: Any) -> dict:
        episode = self._episode(key)
        fn = getattr(episode, "step", None)
        if not callable(fn):
            raise Refused(f"the episode ({type(episode).__name__}) has no step(turn) method")
        step = checked_step(self._run(fn(turn)), self.vocab_size)
        reward = None if step.reward is None else float(step.reward)
        return {"observation": step.observation, "done": step.done, "reward": reward}

    def end(self, key: int, _: Any) -> None:
        self.episodes.pop(key, None)
