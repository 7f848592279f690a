"""Rank 0's asyncio event loop, on a thread of its own: the rollout clients live on it, so the
main thread (health, memory release, eval) and the thread that generates batches ahead of
training (ahead.py) share the same clients and connections."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


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
        """Stop the loop and its thread (the clients on it are closed first: ServerFleet)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
