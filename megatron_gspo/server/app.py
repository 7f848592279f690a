"""The built-in rollout server: SGLang 0.5.23's HTTP API (the subset an RL trainer uses) over the
plain-torch `RolloutModel`, for CPU runs and tests. A product component, not a test double:
everything above it talks to it exactly as to SGLang.

    megatron-gspo serve --model HF_DIR [--host 127.0.0.1 --port 30000 --api-key KEY
                                        --enable-return-routed-experts]
    python -m megatron_gspo.server --model HF_DIR --port 0   # prints the bound URL

Security: it binds 127.0.0.1 by default and refuses a non-loopback --host without an API key;
with a key every endpoint but GET /health requires `Authorization: Bearer KEY` (the trainer gives
the servers it starts a random one). Only a Host naming its own address or a loopback name is
served (DNS rebinding), and a POST must carry JSON (or no body and no Content-Type) and no
foreign Origin, so a web page in a browser on the same machine cannot drive it (gate.py). Weight
payloads are accepted only as tensors (see safe_unpickle), shared-memory ones only with the API
key; every update's shapes and values are checked before it is written (weights.py);
distributed weight updates use gloo, their group inits bounded by --weight-group-timeout.

Robustness: every request field is checked by type and range before the engine sees it (a bad one
is a 400 naming it; `validate.py`), with per-request bounds set by --max-n and --max-batch-size;
a body that cannot be decoded is a 400 too, and no request of any shape gets a 5xx.
A connection that sends no complete request within --read-timeout of connecting (or of its last
answer), or a body slower than that, is closed (408 for the body). /health answers 503 once the
engine thread has ended, so a supervisor restarts the server. SIGTERM/SIGINT stop it within
--shutdown-timeout even when the engine thread is stuck; a second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from megatron_gspo.server import control, gate, weight_endpoints
from megatron_gspo.server.api import format_result, ignored_field_notice, parse_generate
from megatron_gspo.server.engine import Engine, Request
from megatron_gspo.server.http_common import BODY_TIMEOUT, STATE, BodyTimeout, bad, read_json
from megatron_gspo.server.sampling import SamplingParams
from megatron_gspo.server.state import ServerState
from megatron_gspo.server.validate import BadRequest

log = logging.getLogger("megatron_gspo.server.app")
VERSION = "megatron-gspo-builtin-0.1 (sglang 0.5.23 API)"
HOSTS = web.AppKey("hosts", gate.Hosts)
DISCONNECT_POLL_S = 0.25  # how often a waiting /generate checks that its client is still there
MAX_IGNORED_LOGGED = 100  # distinct ignored /generate fields named in the log
CLIENT_CLOSED = 499  # (nginx's status for it; the answer goes nowhere, aiohttp drops it)


class ClientGone(Exception):
    """The client of a /generate closed its connection before the answer."""


# ---- generation ----------------------------------------------------------------------------


async def generate(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    body = await read_json(request)
    encode = st.encode if st.tokenizer else None
    vocab, context = st.spec.vocab_size, st.engine.context_len
    reqs, as_list, opts = parse_generate(body, vocab, encode, context, st.limits)
    _log_ignored(st, opts["unknown"])
    if not st.engine.alive:
        return _engine_down(st.engine)
    try:
        done = await _submit_and_wait(st.engine, reqs, lambda: _client_gone(request))
    except ClientGone:
        return bad("the client disconnected; its requests were aborted", CLIENT_CLOSED)
    refused = [r.refused for r in done if r.refused]
    if refused:
        return bad(refused[0])
    failed = [r.error for r in done if r.error]
    if failed:
        return bad(failed[0], status=500)
    decode = st.decode if st.tokenizer else None
    out = [format_result(r, st.engine, decode, opts["routed_start"]) for r in done]
    return web.json_response(out if as_list else out[0])


def _log_ignored(st: ServerState, names: list[str]) -> None:
    """Name each ignored field once per server: a router adds its own to every request, and a
    line per request would bury the rest of the log. Past MAX_IGNORED_LOGGED distinct names
    (clients that make names up) no more are logged, so the set stays small."""
    for name in names:
        if name not in st.ignored_fields and len(st.ignored_fields) < MAX_IGNORED_LOGGED:
            st.ignored_fields.add(name)
            log.warning("%s", ignored_field_notice(name))


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _submit_and_wait(
    engine: Engine, reqs: list[Request], client_gone: Callable[[], bool] = lambda: False
) -> list[Request]:
    """Submit `reqs` and wait for them all; abort them once `client_gone()` says nobody waits
    for the answer. aiohttp does not cancel a handler whose client disconnected (its
    handler_cancellation is off, and turning it on would cancel weight updates half-way too),
    so the wait looks at the connection itself every DISCONNECT_POLL_S."""
    loop = asyncio.get_running_loop()
    futures = []
    for req in reqs:
        fut = loop.create_future()
        req.on_done = lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r)
        futures.append(fut)
    engine.submit(*reqs)
    results = asyncio.gather(*futures)
    try:
        while not (await asyncio.wait([results], timeout=DISCONNECT_POLL_S))[0]:
            if client_gone():
                raise ClientGone
        return list(results.result())
    except (asyncio.CancelledError, ClientGone):  # stop spending compute on it
        for req in reqs:
            engine.abort(req.rid, "client disconnected")
        raise


def _resolve(fut: asyncio.Future, req: Request) -> None:
    if not fut.done():
        fut.set_result(req)


async def health(request: web.Request) -> web.Response:
    """200 while the engine thread serves; 503 once it has ended (restart the server)."""
    engine = request.app[STATE].engine
    return web.Response(status=200) if engine.alive else _engine_down(engine)


def _engine_down(engine: Engine) -> web.Response:
    why = engine.death or "not started"
    return bad(f"the generation engine is not running ({why}); restart the server", status=503)


async def health_generate(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    req = Request(input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        [done] = await asyncio.wait_for(_submit_and_wait(st.engine, [req]), timeout=60)
    except TimeoutError:
        return bad("health generation timed out", status=503)
    if done.error:
        return bad(done.error, status=503)
    return web.Response(status=200)


# ---- information ---------------------------------------------------------------------------


async def model_info(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    return web.json_response(
        {
            "model_path": st.model_path,
            "tokenizer_path": st.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": st.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": st.hf_config.get("model_type"),
            "architectures": st.hf_config.get("architectures"),
            "num_moe_layers": len(st.spec.moe_layer_ids),
            "num_experts_per_tok": st.spec.topk if st.spec.is_moe else 0,
            "vocab_size": st.spec.vocab_size,  # (not SGLang's: the trainer checks it)
        }
    )


async def server_info(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    a, e = st.args, st.engine
    return web.json_response(
        {
            "version": VERSION,
            "model_path": st.model_path,
            "host": a.host,
            "port": a.port,
            "device": "cpu",  # as SGLang's server args say it; the weight sync reads it
            "dtype": str(e.model.dtype).removeprefix("torch."),
            "quantization": e.model.quantization,
            "enable_return_routed_experts": e.record_routing,
            "decode_kernel": "torch" if e.model.decode_kernel is None else "c",
            "enable_deterministic_inference": e.model.batch_invariant,
            "max_running_requests": e.max_running,
            "context_length": e.context_len,
            "random_seed": a.random_seed,
            "weight_version": e.weight_version,
            "internal_states": [
                {
                    "num_running_reqs": len(e.running),
                    "num_waiting_reqs": len(e.waiting),
                    "engine_busy_s": e.busy_s,  # (not SGLang's: its servers' idle time)
                }
            ],
        }
    )


# ---- control -------------------------------------------------------------------------------


# ---- the app -------------------------------------------------------------------------------


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    refused = gate.refused(request, request.app[HOSTS], request.app[STATE].args.api_key)
    if refused is not None and refused[0] == 401:
        return web.json_response({"error": "Unauthorized"}, status=401)  # (SGLang's answer)
    if refused is not None:
        return bad(refused[1], status=refused[0])
    try:
        return await handler(request)
    except BodyTimeout as e:
        return bad(str(e), status=408)
    except BadRequest as e:
        return bad(str(e))
    except web.HTTPException as e:
        if e.status >= 400:
            return bad(f"{e.reason}: {request.method} {request.path}", status=e.status)
        raise
    except Exception as e:  # a bug: SGLang's failure shape all the same, and the server goes on
        log.exception("%s %s failed", request.method, request.path)
        return bad(f"internal error: {type(e).__name__}: {e}", status=500)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[errors_and_auth], client_max_size=256 * 2**20)
    app[STATE] = state
    app[HOSTS] = gate.Hosts(state.args.host)
    app[BODY_TIMEOUT] = float(state.args.read_timeout)
    r = app.router
    r.add_post("/generate", generate)
    for path, fn in (
        ("/health", health),
        ("/health_generate", health_generate),
        ("/model_info", model_info),
        ("/get_model_info", model_info),
        ("/server_info", server_info),
        ("/get_server_info", server_info),
        ("/flush_cache", control.flush_cache),
    ):
        r.add_get(path, fn)
    for path, fn in control.ROUTES + weight_endpoints.ROUTES:
        r.add_post(path, fn)
    return app
