"""Rank 0's asyncio event loop, on a thread of its own: the rollout clients live on it, so the
main thread (health, memory release, eval) and the thread that generates batches ahead of
training (ahead.py) share the same clients and connections."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CANCEL_WAIT_S = 10.0  # how long `close` waits for the cancelled tasks to end


class IoThread:
    """An event loop running forever on a daemon thread until `close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rollout-io", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro` run on the loop; waits for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def call(self, fn: Callable[[], object]) -> None:
        """`fn()` called on the loop's thread, soon; does not wait."""
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Stop the loop and its thread (the clients on it are closed first: ServerFleet). What
        still runs on it (a rollout whose caller a Ctrl-C stopped) is cancelled and ends first:
        a task dropped pending was logged at exit ("Task was destroyed but it is pending!", the
        task's repr) after the run's last line."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop)
            with contextlib.suppress(Exception):  # (a task that ignores it: dropped as before)
                done.result(timeout=CANCEL_WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_the_rest() -> None:
    """Cancel every other task on this loop and wait for them to end."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
