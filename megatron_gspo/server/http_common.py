"""What the built-in server's handlers share: the state key, the error answer, JSON bodies (read
within a time limit, nesting bounded), and running a function on the engine thread."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from megatron_gspo.server.api import error_body
from megatron_gspo.server.engine import Engine
from megatron_gspo.server.state import ServerState
from megatron_gspo.server.validate import BadRequest, check_depth

STATE = web.AppKey("state", ServerState)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


class BodyTimeout(BadRequest):
    """The client did not send its body in time (HTTP 408)."""


def bad(message: str, status: int = 400) -> web.Response:
    return web.json_response(error_body(message), status=status)


async def read_json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    timeout = request.app.get(BODY_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s") from None
    except (RequestPayloadError, HttpProcessingError) as e:  # e.g. "gzip" that is not gzip
        why = " ".join(str(e).split())[:200]
        raise BadRequest(f"the request body cannot be read ({why})") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer too long to read
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_depth(body)
    return body


async def run_on_engine(engine: Engine, fn, needs_idle: bool = False):
    return await asyncio.wrap_future(engine.call(fn, needs_idle))
