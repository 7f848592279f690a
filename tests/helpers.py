"""Helpers the tests import (fixtures stay in conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def running_requests(client, url: str) -> int:
    return (await client.get(url, "/server_info"))["internal_states"][0]["num_running_reqs"]


async def hold_running(
    client, url: str, start: Callable[[], Awaitable], n: int = 1, attempts: int = 20
) -> asyncio.Task:
    """`start()`'s requests, running on the server at `url` and held there by an in-place pause:
    a state that stays until the caller resumes, aborts or updates (the task it returns ends
    then). A request of the tiny model can end between two looks (the built-in server's C
    kernel writes thousands of tokens a second), so it is started again, at most `attempts`
    times, until `n` requests are seen running and are still running once the pause is in."""
    for _ in range(attempts):
        task = asyncio.create_task(start())
        while not task.done():
            if await running_requests(client, url) >= n:
                await client.pause("in_place")
                await asyncio.sleep(0.05)  # the engine reads the pause before its next step
                if not task.done() and await running_requests(client, url) >= n:
                    return task
                await client.resume()
                break
            await asyncio.sleep(0.002)
        await task
    raise AssertionError(f"{n} request(s) were never seen running in {attempts} tries")
