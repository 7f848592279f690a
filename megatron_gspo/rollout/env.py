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

Either method may be `async def`. `Step.observation` is what the environment says next: text
(tokenized as it is), chat messages (`[{"role": "tool", "content": "42"}]`: rendered as the chat
template continues a conversation, the generation prompt included), or token ids. `done` ends
the episode; `reward` (at any step, the last one given counts) replaces `reward.fn` for it.

Where the code runs: episodes live in worker processes (megatron_gspo/bounded), `env.workers`
of them (default 16, or one per core where there are more), never in the trainer. An episode is
started in the worker holding the fewest and stays there: its object keeps its state between
turns. A worker runs one call at a time (an `async def` method is run to its end there), so
`env.workers` calls run at once; the tools of `env.fn: tools` run inside their episode's step.
Threads were not enough: a call that hangs or spins cannot be stopped on a thread, and kept the
trainer alive after its run and the thread pool used up.

A call that raises (anything: SystemExit and KeyboardInterrupt raised by the code included),
runs past `env.timeout_s`, kills its process or returns something else than the above fails its
episode: EnvError, counted, one summary line per step on the console and each episode's line
(with the traceback) in RUN_DIR/logs/env.log. The episode's reward is 0, or, when it failed
before the model's first turn (`fn(row)`, `prompt()`), it is a failed reward whose group is
dropped (train/generate.py); a step on which every sample failed, at any stage, ends the run
(train/samples.py). A call past
its time limit, or whose process dies, takes its worker down, and with it the episodes living
there (they end as well, within env.timeout_s plus a worker's start); a new worker takes the
next episodes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_gspo.bounded import Kind, Outcome, Pool, default_workers
from megatron_gspo.errors import UserError
from megatron_gspo.rewards.plugin import load_plugin, loading_failed

TOOLS = "tools"  # env.fn of the built-in tool-calling environment (rollout/tool_env.py)
_HOST = "megatron_gspo.rollout.env_host:episode_host"


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


@dataclass
class EnvRow:
    """The data row an episode starts from, as the worker gets it."""

    prompt: str
    answer: str
    extra: dict


class EnvError(Exception):
    """The environment's code failed on an episode (which then ends; train/generate.py scores
    it); `detail`: the traceback, where its code raised."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def load_env(spec: str):
    """The episode factory named by `spec` (module:name or file.py:name)."""
    return load_plugin(spec, kind="environment", usage="fn(row) -> an episode with step(turn)",
                       args=1)  # fmt: skip


@dataclass
class Episode:
    """An episode living in worker `worker` (as it was started: `incarnation`), by its key;
    `tools`: the function schemas the chat template lists (the tool environment's)."""

    worker: int
    incarnation: int
    key: int
    tools: list[dict] | None = None


class EnvCalls:
    """The trainer's side of the environment: its episodes' calls, each run in the episode's
    worker process within `timeout_s`, results checked again here."""

    def __init__(self, fn: str, tools: Sequence[str] = (), *, timeout_s: float, vocab_size: int,
                 workers: int | None = None, start_timeout_s: float = 120.0):  # fmt: skip
        """`fn`: env.fn (`tools`, or module:name / file.py:name); `tools`: env.tools. Waits
        for the first worker to load them (within `start_timeout_s`): code that does not load
        is a UserError here."""
        self.timeout_s, self.vocab_size = timeout_s, vocab_size
        spec = {"fn": fn, "tools": list(tools), "vocab_size": vocab_size}
        self.pool = Pool(_HOST, spec, workers=workers or default_workers(), timeout_s=timeout_s,
                         limit="env.timeout_s", name="env", start_timeout_s=start_timeout_s,
                         start_limit="env.start_timeout_s")  # fmt: skip
        why = self.pool.start_error()  # (code that does not load fails now, not per episode)
        if why is not None:
            self.pool.close()
            what = f"environment {fn!r}" if fn != TOOLS else f"env.tools {list(tools)}"
            raise UserError(loading_failed(what, why, self.pool.raised_at_load))
        self._keys = itertools.count()
        self._live = [0] * self.pool.workers  # episodes living in each worker

    def close(self) -> None:
        self.pool.close()

    async def start(self, row) -> Episode:
        """A new episode, in the worker holding the fewest, of those not waiting out a failed
        start (bounded/pool.py: where every call would fail) unless all are."""
        usable = self.pool.usable() or range(len(self._live))
        worker = min(usable, key=self._live.__getitem__)
        key = next(self._keys)
        self._live[worker] += 1
        env_row = EnvRow(row.prompt, row.answer, dict(getattr(row, "extra", None) or {}))
        try:
            o = await self._call("starting the episode", "start", key, env_row, worker=worker)
        except EnvError:
            self._live[worker] -= 1
            raise
        tools = o.value.get("tools") if isinstance(o.value, dict) else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                      for t in tools)):  # fmt: skip
            self._live[worker] -= 1
            raise EnvError("the episode's `tools` could not be read; give function schemas")
        return Episode(o.worker, o.incarnation, key, tools)

    def end(self, episode: Episode) -> None:
        """Drop the episode's object in its worker (not waited for)."""
        self._live[episode.worker] -= 1
        self.pool.submit("end", episode.key, None, worker=episode.worker,
                         incarnation=episode.incarnation)  # fmt: skip

    async def prompt(self, episode: Episode) -> str | list[dict] | None:
        o = await self._call("prompt()", "prompt", episode.key, None, worker=episode.worker,
                             incarnation=episode.incarnation)  # fmt: skip
        return checked_prompt(o.value)

    async def step(self, episode: Episode, turn: Turn) -> Step:
        o = await self._call("step()", "step", episode.key, turn, worker=episode.worker,
                             incarnation=episode.incarnation)  # fmt: skip
        value: dict[str, Any] = o.value if isinstance(o.value, dict) else {}
        step = Step(value.get("observation"), value.get("done", False), value.get("reward"))
        return checked_step(step, self.vocab_size)

    async def _call(self, what: str, *args: Any, worker: int,
                    incarnation: int | None = None) -> Outcome:  # fmt: skip
        future = self.pool.submit(*args, worker=worker, incarnation=incarnation)
        o: Outcome = await asyncio.wrap_future(future)
        if o.ok:
            return o
        raise EnvError(self._phrase(what, o), o.detail)

    def _phrase(self, what: str, o: Outcome) -> str:
        if o.kind is Kind.RAISED:
            return f"{what} raised {o.message}"
        if o.kind is Kind.REFUSED:
            return f"{what} {o.message}" if o.message.startswith("returned") else o.message
        if o.kind is Kind.TIMEOUT:
            return f"{what} {o.message}; its worker was killed, and the episodes it held ended"
        if o.kind is Kind.DIED:
            return f"the worker process died during {what} ({o.message})"
        if o.kind is Kind.LOST:
            return f"the episode's worker was replaced before {what} (another episode's call " \
                   "in it failed)"  # fmt: skip
        return f"{what}: {o.message}"


def checked_prompt(value):
    """`value` if it is a first prompt (text, chat messages or None), else EnvError."""
    if value is None or isinstance(value, str) or _messages(value):
        return value
    raise EnvError(f"prompt() returned {_short(value)}; return text, chat messages (a list of "
                   f"dicts) or None{_as_list(value)}")  # fmt: skip


def checked_step(value, vocab_size: int) -> Step:
    """`value` as a Step, or EnvError saying what is wrong with it."""
    if not isinstance(value, Step):
        raise EnvError(f"step() returned {_short(value)}; return a Step")
    obs, reward = value.observation, value.reward
    if not isinstance(value.done, bool):
        raise EnvError(f"Step.done is {_short(value.done)}; it must be True or False")
    if reward is not None and not (
        isinstance(reward, numbers.Real) and not isinstance(reward, bool) and _finite(reward)
    ):
        raise EnvError(f"Step.reward is {_short(reward)}; give a finite number or None")
    if obs is None or isinstance(obs, str) or _messages(obs) or _ids(obs, vocab_size):
        return value
    raise EnvError(
        f"Step.observation is {_short(obs)}; give text (a str), chat messages (a list of dicts) "
        f"or token ids (a list of ints in [0, {vocab_size})){_as_list(obs)}"
    )


def _as_list(value) -> str:
    """How to turn `value` into a list, where it is a sequence of another type (the answer
    crosses to the trainer as JSON, where a tuple or an array is none of the above)."""
    if hasattr(value, "tolist"):  # a numpy array or a torch tensor
        return f"; convert the {type(value).__name__} with .tolist()"
    if isinstance(value, tuple):
        return "; convert the tuple with list(...)"
    if isinstance(value, list) and any(hasattr(v, "tolist") for v in value):
        return "; give Python ints, not numpy or torch scalars (.tolist() of the array gives them)"
    return ""


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except (OverflowError, ValueError, TypeError):  # (an int too large for a float)
        return False


def _ids(value, vocab_size: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value
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
    try:
        text = f"{type(value).__name__} {value!r}"
    except RecursionError:
        text = f"{type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."
