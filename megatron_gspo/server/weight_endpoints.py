"""Weight-transfer and memory endpoints of the built-in server, as SGLang 0.5.23 answers them:
/begin_weight_update, /end_weight_update, /update_weights_from_tensor, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /release_memory_occupation,
/resume_memory_occupation.

As in SGLang 0.5.23, tensor and distributed updates must run inside a begin/end_weight_update
session (one at a time); /update_weights_from_disk needs none. Tensor payloads are decoded by
`safe_unpickle` (tensors only, never arbitrary pickle); shared-memory ones only by a server with
an API key (without one any local process could name another's objects; safe_unpickle's doc).
Every update is checked before it is written: names, shapes and values (`check_values`: NaN,
inf and weights past the server's dtype or 1e18 are a 400 naming the tensor). A distributed
update carries at most the model's elements, so its receive buffer is bounded by the model's
size; the buffer of a failed update is freed, not kept. Group inits run on threads of their own
and fail after --weight-group-timeout (`WeightUpdates.open_group`). The server
is one TP rank: it reads `serialized_named_tensors[0]` and joins a distributed group as rank
`rank_offset`. Received tensors load on the engine thread between steps, with the same rule as
/update_weights_from_disk: wait for running requests unless generation is paused. Distributed
receives run on a worker thread, so generation goes on while the trainer broadcasts.

Transfers copy each byte once on this side: a flattened bucket is loaded straight from its
shared-memory views (tensor) or from the receive buffer the broadcast wrote into (distributed).
Two things are kept between requests so that a sync does not fault in fresh pages per bucket
(on this CPU that costs as much as the copy itself): two distributed receive buffers (a bucket
is received while the one before it loads), and the read-only mappings of the shared-memory
buffers of flattened buckets, as long as the sender reuses them (safe_unpickle: one is let go
once the sender frees its object).

On CPU, releasing memory drops the KV cache (it is rebuilt on resume, or on demand) and the
transfer buffers above; the weights stay, as on a GPU without --enable-memory-saver.
"""

from __future__ import annotations

import asyncio

import torch
import torch.distributed as dist
from aiohttp import web

from megatron_gspo.errors import UserError
from megatron_gspo.rollout import weight_payload
from megatron_gspo.server import safe_unpickle
from megatron_gspo.server.api import error_body
from megatron_gspo.server.engine import Engine
from megatron_gspo.server.http_common import STATE, bad, read_json, run_on_engine
from megatron_gspo.server.sampling import BadRequest
from megatron_gspo.server.state import (
    MAX_PENDING_INITS,
    ServerState,
    TooManyInits,
    WeightUpdates,
)
from megatron_gspo.server.validate import body_flag, is_local_address

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def _ok(message: str, **extra) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def _updates(request: web.Request) -> WeightUpdates:
    return request.app[STATE].weights


async def begin_weight_update(request: web.Request) -> web.Response:
    updates = _updates(request)
    body = await read_json(request)
    selector = body.get("selector", "all")
    if selector not in ("target", "draft", "all"):
        raise BadRequest(f"selector must be target, draft or all, not {selector!r}")
    senders = _senders(body.get(weight_payload.SENDERS, []))
    if updates.session is not None:
        raise BadRequest("a weight-update session is already open; call end_weight_update() first")
    updates.session, updates.senders = selector, senders
    return _ok("Success")


def _senders(value: object) -> frozenset[int]:
    """The process ids whose shared memory this session may load (torch names each object
    /torch_<pid>_...; weight_payload.begin_body)."""
    top = safe_unpickle.MAX_PID
    if not (
        isinstance(value, list)
        and len(value) <= 4096
        and all(type(p) is int and 0 < p <= top for p in value)
    ):
        raise BadRequest(
            f"{weight_payload.SENDERS} must be a list of at most 4096 process ids (1..{top})"
        )
    return frozenset(value)


async def end_weight_update(request: web.Request) -> web.Response:
    updates = _updates(request)
    await read_json(request)
    if updates.session is None:
        raise BadRequest("no weight-update session is open; call begin_weight_update() first")
    updates.end_session()
    return _ok("Success")


def _require_session(updates: WeightUpdates, endpoint: str) -> None:
    if updates.session is None:
        raise BadRequest(
            f"{endpoint} must run between begin_weight_update() and end_weight_update()"
        )


# ---- loading received tensors --------------------------------------------------------------


def _options(body: dict) -> tuple[str | None, bool]:
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, str) or not version):
        raise BadRequest("weight_version must be a non-empty string")
    body_flag(body, "flush_cache")  # (checked only: this server keeps no prefix cache)
    return version, body_flag(body, "abort_all_requests")


async def _load(
    st: ServerState, named: list, version: str | None, how: str, extra: dict | None = None
) -> web.Response:
    """Load `named` on the engine; SGLang's answer, with `extra` fields in it either way."""
    extra = extra or {}

    def load(engine: Engine) -> int:
        try:
            engine.model.load_weights(named)
        except BaseException:
            # let go of the tensors (and a receive buffer under them) now: the exception's
            # traceback holds this frame in a cycle that only the garbage collector breaks
            named.clear()
            raise
        if version is not None:
            engine.weight_version = version
        return len(engine.running) if engine.paused else 0

    try:
        paused = await run_on_engine(st.engine, load, needs_idle=True)
    except UserError as e:
        failed = error_body(f"Failed to update weights from {how}: {e}")
        return web.json_response({**failed, **extra}, status=400)
    message = f"Succeeded to update model weights from {how}."
    if version is not None:
        message += f" Weight version updated to {version}."
    return _ok(message, num_paused_requests=paused, **extra)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    body = await read_json(request)
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
        raise BadRequest(
            "serialized_named_tensors must be a list of base64 strings, one per TP rank"
        )
    load_format = body.get("load_format")
    if load_format not in (None, "direct", "flattened_bucket"):
        raise BadRequest(f"load_format must be null, direct or flattened_bucket: {load_format!r}")
    version, abort_all = _options(body)
    _require_session(st.weights, "update_weights_from_tensor")
    # shared memory: only for the API key's holder, from a peer on this machine, made by a
    # sender the session named (safe_unpickle's module doc)
    senders: frozenset[int] | None = st.weights.senders
    refusal = safe_unpickle.FROM_ANOTHER_MACHINE
    if not st.args.api_key:
        senders, refusal = None, safe_unpickle.WITHOUT_API_KEY
    elif not is_local_address(request.remote):
        senders = None
    named = await asyncio.to_thread(
        safe_unpickle.decode_named_tensors, payloads[0], load_format, senders, refusal
    )
    if abort_all:
        st.engine.abort(None, "Abort by update_weights_from_tensor")
    # torch's receiver gives back the reference the sender's pickle took on its shared memory;
    # this server maps it read-only and never touches the count, so it says so, and the
    # sender gives the reference back itself (weight_sync/transports/tensor.py)
    return await _load(st, named, version, "tensor", extra={weight_payload.RELEASED: False})


# ---- distributed groups --------------------------------------------------------------------


def _field(body: dict, key: str, kind: type, what: str):
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, kind) or (kind is str and not v):
        raise BadRequest(f"{key} must be {what}")
    return v


async def init_weights_update_group(request: web.Request) -> web.Response:
    updates = _updates(request)
    body = await read_json(request)
    address = _field(body, "master_address", str, "a host name or address")
    port = _field(body, "master_port", int, "a port number")
    offset = _field(body, "rank_offset", int, "this server's first rank (>= 1)")
    world = _field(body, "world_size", int, "the group's size")
    name = _field(body, "group_name", str, "a non-empty string")
    backend = body.get("backend", "nccl")
    if not 0 < port < 65536 or not 1 <= offset < world:
        raise BadRequest("need 0 < master_port < 65536 and 1 <= rank_offset < world_size")
    if backend != "gloo":
        raise BadRequest(f"backend {backend!r} is not available on this CPU server; use gloo")
    if name in updates.groups or name in updates.pending:
        raise BadRequest(f"a weights update group named {name!r} already exists")
    try:
        group = await updates.open_group(address, port, world, offset, name, backend)
    except TooManyInits:
        return bad(
            f"{MAX_PENDING_INITS} weights update group inits are waiting already; retry once "
            "they end (each ends within the group timeout)", status=429,
        )  # fmt: skip
    except TimeoutError:
        return bad(
            f"Failed to init process group {name!r}: no group formed with the master at "
            f"{address}:{port} within {updates.group_timeout_s:g} s"
        )
    except Exception as e:  # noqa: BLE001 - a failed rendezvous is reported, not raised
        return bad(f"Failed to init process group {name!r}: {type(e).__name__}: {e}")
    updates.groups[name] = group
    return _ok(f"Initialized weights update group {name!r} as rank {offset} of {world}.")


def _distributed_spec(
    body: dict, model_numel: int
) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """The request's names, dtypes and shapes, checked before any byte is received: floating
    dtypes, and no more elements than the model holds (what a receive buffer may take)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (
        isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
    ) or not (len(names) == len(dtypes) == len(shapes)):
        raise BadRequest("names, dtypes and shapes must be lists of the same length")
    torch_dtypes = []
    for d in dtypes:
        t = getattr(torch, d, None) if isinstance(d, str) else None
        if not isinstance(t, torch.dtype) or not t.is_floating_point:
            raise BadRequest(f"dtype {str(d)[:40]!r} is not a floating-point torch dtype name")
        torch_dtypes.append(t)
    total = 0
    for n, s in zip(names, shapes):
        if not isinstance(n, str) or not isinstance(s, list):
            raise BadRequest("names must be strings and shapes lists of sizes")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise BadRequest(f"shape of {n[:100]!r} must be a list of non-negative ints")
        numel = 1
        for x in s[:64]:  # (capped as it grows: no huge product of a hostile shape)
            numel = min(numel * x, model_numel + 1)
        total += numel
        if total > model_numel or len(s) > 64:
            raise BadRequest(
                f"the update holds more elements than the model's {model_numel} (at "
                f"{n[:100]!r}, shape {str(s)[:80]}); send the model's own weights"
            )
    return names, torch_dtypes, shapes


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    updates = st.weights
    body = await read_json(request)
    name = body.get("group_name")
    if name not in updates.groups:
        raise BadRequest(f"no weights update group named {name!r}; call /init_weights_update_group")
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"load_format must be null or flattened_bucket: {load_format!r}")
    _require_session(updates, "update_weights_from_distributed")
    names, dtypes, shapes = _distributed_spec(body, updates.model_numel)
    version, abort_all = _options(body)
    # The lock covers the receive only: the next bucket is received (into another buffer)
    # while this one loads. The load keeps the buffer until it has copied the bytes; a buffer
    # goes back to the pool only after an update that succeeded (a failed one's is freed).
    buffer = None
    async with updates.lock:
        if load_format == "flattened_bucket":
            buffer = updates.take_buffer(weight_payload.bucket_layout(names, dtypes, shapes)[1])
        try:
            named = await asyncio.to_thread(
                weight_payload.receive_named,
                updates.groups[name], names, dtypes, shapes, load_format, buffer,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a failed broadcast is reported, not raised
            return bad(f"Failed to receive weights over {name!r}: {type(e).__name__}: {e}")
    if abort_all:
        st.engine.abort(None, "Abort by update_weights_from_distributed")
    answer = await _load(st, named, version, "distributed")
    if buffer is not None and answer.status == 200:
        updates.give_buffer(buffer)
    elif buffer is not None:  # freed now: gloo keeps its last op's tensor until its next op
        del named
        buffer.untyped_storage().resize_(0)
    return answer


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    updates = _updates(request)
    body = await read_json(request)
    name = body.get("group_name")
    if name not in updates.groups:
        raise BadRequest(f"no weights update group named {name!r}")
    async with updates.lock:  # off the event loop: generation requests go on meanwhile
        await asyncio.to_thread(dist.destroy_process_group, updates.groups.pop(name))
    return _ok(f"Destroyed weights update group {name!r}.")


# ---- memory --------------------------------------------------------------------------------


def _tags(body: dict) -> list[str]:
    """The memory a request names, each tag once (a repeated one is the same memory). No tags,
    absent, null or [], means all of them, as in SGLang (an empty list released nothing)."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags must be a list of {', '.join(MEMORY_TAGS)}: {tags!r}")
    return list(dict.fromkeys(tags))


async def release_memory_occupation(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    tags = _tags(await read_json(request))

    def release(engine: Engine) -> bool:
        if engine.num_requests:
            return False
        if "kv_cache" in tags:
            engine.cache = engine.model.new_cache(0, 0)
        st.weights.drop_buffers()
        st.weights.released.update(tags)
        return True

    if not await run_on_engine(st.engine, release):
        return bad("Cannot release memory while requests are running; pause or abort them first.")
    return _ok(f"Released memory: {', '.join(tags)}.")


async def resume_memory_occupation(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    tags = _tags(await read_json(request))

    missing = [t for t in tags if t not in st.weights.released]
    if missing:
        raise BadRequest(f"cannot resume {', '.join(missing)}: not released")

    def resume(engine: Engine) -> None:
        if "kv_cache" in tags:
            engine.cache = engine.model.new_cache(min(engine.max_running, 8), 256)
        st.weights.released.difference_update(tags)

    await run_on_engine(st.engine, resume)
    return _ok(f"Resumed memory: {', '.join(tags)}.")


ROUTES = [
    ("/begin_weight_update", begin_weight_update),
    ("/end_weight_update", end_weight_update),
    ("/update_weights_from_tensor", update_weights_from_tensor),
    ("/init_weights_update_group", init_weights_update_group),
    ("/update_weights_from_distributed", update_weights_from_distributed),
    ("/destroy_weights_update_group", destroy_weights_update_group),
    ("/release_memory_occupation", release_memory_occupation),
    ("/resume_memory_occupation", resume_memory_occupation),
]
