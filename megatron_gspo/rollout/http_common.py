"""What the built-in server's handlers share: the state key, the error answer, JSON bodies, and
running a function on the engine thread."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from megatron_gspo.rollout.api import error_body
from megatron_gspo.rollout.engine import Engine
from megatron_gspo.rollout.sampling import BadRequest

STATE = web.AppKey("state", object)


def bad(message: str, status: int = 400) -> web.Response:
    return web.json_response(error_body(message), status=status)


async def read_json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def run_on_engine(engine: Engine, fn, needs_idle: bool = False):
    return await asyncio.wrap_future(engine.call(fn, needs_idle))
