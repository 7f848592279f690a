"""Training's rewards, scored in bounded worker processes (megatron_gspo/bounded): one sample at a
time per worker, `reward.workers` of them, each call within `reward.timeout_s`.

    scorer = RewardScorer("my_rewards.py:judge", workers=8, timeout_s=60, log_path=...)
    outcome = scorer.submit(prompt, response, answer, where="step 3").result()

A call is submitted as soon as its sample's generation ends (train/generate.py), so scoring
overlaps generation and the calls run side by side. A call that raises (anything: SystemExit and
KeyboardInterrupt raised by the reward included), returns no finite number, passes the time
limit or whose process dies fails that sample alone: its outcome says why in one line, and
`log_path` (RUN_DIR/logs/reward.log) gets that line with the traceback, up to `log_bytes`
(64 MiB; past it failures are only counted: bounded/failure_log.py).

The plugin is never imported in the trainer: when the scorer is made, it waits for its first
worker to import it, so a plugin that does not load (it raises, has the wrong signature, exits,
hangs or kills its process when imported) fails at start with a UserError saying why, and the
trainer is left as it was. Each worker imports it once for its whole life (state the plugin
keeps, a loaded judge model, a cache, lives once per worker).
`exact` is scored in the trainer: it is bounded by itself (linear in the response's length).
`math` goes through the workers: math-verify bounds its parsing with SIGALRM, which works only on
a process's main thread and cannot stop a long computation in C; a worker's time limit can.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from megatron_gspo.bounded import (
    LOG_BYTES,
    FailureLog,
    Kind,
    Outcome,
    Pool,
    Refused,
    default_workers,
)
from megatron_gspo.errors import UserError
from megatron_gspo.rewards import load_reward
from megatron_gspo.rewards.plugin import loading_failed

IN_PROCESS = frozenset({"exact"})  # built-in rewards bounded by themselves

_LOADER = "megatron_gspo.rewards.scoring:worker_reward"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checked_reward(value: object) -> float:
    """`value` as a float, or Refused saying it is not a finite number."""
    ok = isinstance(value, numbers.Real)
    try:
        number = float(value) if ok else math.nan  # type: ignore[arg-type]
    except (OverflowError, ValueError, TypeError):
        number = math.nan
    if not math.isfinite(number):
        raise Refused(f"returned {_short(repr(value))} ({type(value).__name__}); it must return "
                      "a finite number")  # fmt: skip
    return number


async def _awaited(value: Any) -> Any:
    return await value


def worker_reward(spec: str) -> Callable[[str, str, str], float]:
    """In a worker (bounded/worker.py): the reward function named by `spec`, result checked. An
    `async def` one (a remote judge) is run to its end on the worker's own event loop, kept for
    the worker's life (a client session it made stays bound to it)."""
    fn = load_reward(spec)
    loop = asyncio.new_event_loop()

    def call(prompt: str, response: str, answer: str) -> float:
        value = fn(prompt, response, answer)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(_awaited(value))
        return checked_reward(value)

    return call


class RewardScorer:
    """`reward.fn` on one sample at a time, in the trainer (`exact`) or in worker processes."""

    def __init__(self, spec: str, workers: int | None = None, timeout_s: float = 60.0,
                 log_path: Path | None = None, start_timeout_s: float = 120.0,
                 log_bytes: int = LOG_BYTES):  # fmt: skip
        self.spec = spec
        self.log = FailureLog(log_path, "reward/failed_samples", log_bytes)
        self.pool: Pool | None = None
        if spec in IN_PROCESS:
            self.fn = load_reward(spec)
            return
        self.pool = Pool(_LOADER, spec, workers=workers or default_workers(),
                         timeout_s=timeout_s, limit="reward.timeout_s", name="reward",
                         start_timeout_s=start_timeout_s,
                         start_limit="reward.start_timeout_s")  # fmt: skip
        why = self.pool.start_error()  # (a plugin that does not load fails now, not per sample)
        if why is not None:
            self.pool.close()
            raise UserError(
                loading_failed(f"reward plugin {spec!r}", why, self.pool.raised_at_load)
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []

    def submit(self, prompt: str, response: str, answer: str, where: str = "") -> Future:
        """Future of the sample's Outcome: `value` the reward (a float), or `message` why it has
        none, in one line (`where`: the step or eval, for the log)."""
        out: Future = Future()
        if self.pool is None:
            out.set_result(self._in_process(prompt, response, answer, where))
            return out

        def done(f: Future) -> None:
            try:
                result = self._phrase(f.result(), prompt, where)
            except Exception as e:  # (never leave `out` unset)
                result = Outcome(Kind.RAISED, message=f"reward {self.spec!r}: {e}")
            if out.set_running_or_notify_cancel():  # (not if its waiter was cancelled)
                out.set_result(result)

        self.pool.submit(prompt, response, answer).add_done_callback(done)
        return out

    def _in_process(self, prompt: str, response: str, answer: str, where: str) -> Outcome:
        try:
            return Outcome(Kind.VALUE, value=checked_reward(self.fn(prompt, response, answer)))
        except Refused as e:
            return self._phrase(Outcome(Kind.REFUSED, message=str(e)), prompt, where)
        except Exception as e:
            raised = Outcome(Kind.RAISED, message=f"{type(e).__name__}: {e}")
            return self._phrase(raised, prompt, where)

    def _phrase(self, o: Outcome, prompt: str, where: str) -> Outcome:
        """A worker's outcome as the sample's: the value checked again here (it crossed a
        process boundary), or one line naming the reward, what went wrong and the prompt."""
        if o.kind is Kind.VALUE:
            try:
                return Outcome(Kind.VALUE, value=checked_reward(o.value))
            except Refused as e:
                o = Outcome(Kind.REFUSED, message=str(e))
        name, on = f"reward {self.spec!r}", f"(prompt {_short(prompt)!r})"
        line = {
            Kind.RAISED: f"{name} raised {o.message} {on}; fix the reward function",
            Kind.REFUSED: f"{name} {o.message} {on}",
            Kind.TIMEOUT: f"{name} {o.message} {on}; its worker was killed and replaced",
            Kind.DIED: f"{name}: its worker process died, {o.message} {on}",
        }.get(o.kind, f"{name}: not scored, {o.message}")
        self._log(where, line, o.detail)
        return Outcome(o.kind, message=line, detail=o.detail)

    def _log(self, where: str, line: str, detail: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.log.write(f"{stamp} {where}: {line}\n" + (detail.rstrip() + "\n" if detail else ""))
