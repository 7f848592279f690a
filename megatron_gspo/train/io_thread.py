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
CANCEL_S = 5.0  # how long `close` waits for the loop's tasks to end once cancelled


class IoThread:
    """An event loop running forever on a daemon thread until `close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rollout-io", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro` run on the loop; waits for its result (from any other thread). Interrupted
        while waiting (a Ctrl-C), it cancels `coro`, which is not left pending on the loop."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # (done already: a no-op)
            raise

    def call(self, fn: Callable[[], object]) -> None:
        """`fn()` called on the loop's thread, soon; does not wait."""
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Stop the loop and its thread (the clients on it are closed first: ServerFleet)."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():  # (what is still running ends first: a Ctrl-C's)
            with contextlib.suppress(Exception):  # (a task that ignores it: dropped as before)
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(CANCEL_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _cancel_the_rest() -> None:
    """Cancel the loop's other tasks and wait for them to end (else each is "destroyed but
    pending" when the loop closes, a line on the console at the end of a stopped run)."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
