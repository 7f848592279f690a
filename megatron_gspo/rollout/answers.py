"""What a rollout server answers, as the client reads it: failures (`RolloutError`), JSON bodies
(SGLang's error shape included) and the routed experts of R3."""

from __future__ import annotations

import base64

import aiohttp
import numpy as np


class RolloutError(RuntimeError):
    """A request that failed for good: refused (4xx) or out of retries."""


def decode_routed_experts(b64: str, num_tokens: int, topk: int | None) -> np.ndarray:
    """SGLang's base64 int32 payload as [num_tokens, layers, topk]."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    if not topk or num_tokens <= 0 or flat.size % (num_tokens * topk):
        raise RolloutError(
            f"routed_experts holds {flat.size} ids, not a multiple of {num_tokens} tokens x top-{topk}"
        )
    return flat.reshape(num_tokens, -1, topk).copy()


async def read_json(resp: aiohttp.ClientResponse) -> dict:
    """The JSON object of an answer; a body that is not one, as {"message": text} or
    {"data": value}."""
    try:
        data = await resp.json(content_type=None)
    except ValueError:
        data = None
    if isinstance(data, dict):
        return data
    return {"message": (await resp.text())[:500]} if data is None else {"data": data}


def message(data: dict) -> str:
    """The error message of an answer, wherever the server put it."""
    err = data.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    return str(data.get("message") or err or data)
