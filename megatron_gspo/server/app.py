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

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch
from aiohttp import web

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.server_config import API_KEY_ENV
from megatron_gspo.server import control, gate, kernels, weight_endpoints
from megatron_gspo.server.api import format_result, parse_generate
from megatron_gspo.server.engine import Engine, Request
from megatron_gspo.server.http_common import BODY_TIMEOUT, STATE, BodyTimeout, bad, read_json
from megatron_gspo.server.quantize import QUANTIZATIONS
from megatron_gspo.server.sampling import SamplingParams
from megatron_gspo.server.state import ServerState
from megatron_gspo.server.validate import SEED_END, BadRequest, is_loopback, show

log = logging.getLogger("megatron_gspo.server.app")
DECODE_KERNEL_ENV = "MEGATRON_GSPO_DECODE_KERNEL"
VERSION = "megatron-gspo-builtin-0.1 (sglang 0.5.23 API)"
HOSTS = web.AppKey("hosts", gate.Hosts)
DISCONNECT_POLL_S = 0.25  # how often a waiting /generate checks that its client is still there
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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="HF dir")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV})",
    )
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument(
        "--max-n", type=int, default=256, help="most samples of one prompt (sampling_params.n)"
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1024,
        help="most sequences one /generate makes (prompts x n); larger requests get a 400",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=60.0,
        help="seconds a connection may sit without a complete request, or a body take to arrive",
    )
    parser.add_argument(
        "--weight-group-timeout",
        type=float,
        default=300.0,
        help="seconds a /init_weights_update_group may take (it fails after), and the "
        "timeout of the group's broadcasts",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=15.0,
        help="seconds SIGTERM waits for a clean stop before the process exits anyway",
    )
    add_numerics_args(parser)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--log-level", default="warning")


def add_numerics_args(parser: argparse.ArgumentParser) -> None:
    """How the model computes: dtype, fp8 weights, threads, the decode kernel, batch
    invariance."""
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: the linear weights rounded to float8 e4m3 on every load, computed in --dtype",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument(
        "--decode-kernel",
        default=os.environ.get(DECODE_KERNEL_ENV, "auto"),
        choices=kernels.MODES,
        help=f"decode steps in compiled C, torch, or auto (default ${DECODE_KERNEL_ENV} or auto)",
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant numerics (SGLang's flag): a request's tokens and log-probs do not "
        "depend on what it is batched with, so seeded requests give the same answers at any "
        "load; the torch forward then runs in parts (decode steps by position, each prefill)",
    )


def check_host(host: str, api_key: str | None) -> None:
    if api_key or is_loopback(host):
        return
    raise UserError(
        f"refusing to serve on non-loopback host {host!r} without an API key; "
        f"pass --api-key (or set ${API_KEY_ENV}) or bind 127.0.0.1"
    )


def serve_main(args: argparse.Namespace) -> None:
    check_serve_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    check_host(args.host, args.api_key)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        state = ServerState(args)
    except kernels.KernelUnavailable as e:
        raise UserError(f"{e}; pass --decode-kernel auto or torch") from None
    gc.freeze()  # the model, torch and the libraries: never garbage, so never scanned again
    asyncio.run(_serve(state))


def check_serve_args(args: argparse.Namespace) -> None:
    """Range-check the flags before anything loads, so a typo is one line, not a traceback
    from deep inside the socket or torch calls that would take the value."""
    bounds: dict[str, tuple[int, int | None]] = {
        "port": (0, 65535),
        "threads": (0, 4096),
        "random_seed": (0, SEED_END - 1),
    }
    bounds |= dict.fromkeys(("max_running_requests", "max_n", "max_batch_size"), (1, None))
    for flag, (lo, hi) in bounds.items():
        value = getattr(args, flag)
        if value < lo or (hi is not None and value > hi):
            where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise UserError(f"--{flag.replace('_', '-')} must be {where}, got {show(value)}")
    for flag in ("read_timeout", "shutdown_timeout", "weight_group_timeout"):
        if not 0 < getattr(args, flag) <= 1e9:
            raise UserError(f"--{flag.replace('_', '-')} must be in (0, 1e9] seconds")
    if args.log_level.upper() not in logging.getLevelNamesMapping():
        raise UserError(f"--log-level {args.log_level!r} is not a level; use info or warning")


async def _serve(state: ServerState) -> None:
    stop = asyncio.Event()
    _on_stop_signals(asyncio.get_running_loop(), stop, state.args.shutdown_timeout)
    runner = web.AppRunner(
        build_app(state),
        keepalive_timeout=state.args.read_timeout,  # also bounds the wait for the first request
        shutdown_timeout=min(5.0, state.args.shutdown_timeout / 2),
    )
    await runner.setup()
    try:
        await _listen(runner, state.args.host, state.args.port)
    except UserError:
        await runner.cleanup()
        raise
    state.args.port = runner.addresses[0][1]
    state.engine.start()
    print(f"serving {state.model_path} on http://{state.args.host}:{state.args.port}", flush=True)
    started = time.monotonic()
    try:
        await stop.wait()
    finally:
        log.info("shutting down after %.0f s", time.monotonic() - started)
        state.engine.stop(timeout_s=state.args.shutdown_timeout / 3)
        state.weights.close()
        await runner.cleanup()


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    try:
        await web.TCPSite(runner, host, port).start()
    except socket.gaierror as e:
        raise UserError(
            f"--host {host!r} is not an address of this machine ({e.strerror}); "
            "pass an address or a name that resolves to one"
        ) from None
    except OSError as e:
        fix = "--port 0 picks a free one" if e.errno == errno.EADDRINUSE else "check --host"
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from None


def _on_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, grace_s: float):
    """SIGTERM/SIGINT: stop cleanly, and exit anyway after `grace_s` (a stuck engine thread, a
    hung transfer) or at a second signal. A plain signal handler, not the event loop's: it runs
    even while the loop is busy."""
    signalled: list[int] = []

    def handler(signum, frame) -> None:
        if signalled:
            os._exit(128 + signum)
        signalled.append(signum)
        watchdog = threading.Timer(grace_s, _exit_now, (grace_s,))
        watchdog.daemon = True
        watchdog.start()
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _exit_now(grace_s: float) -> None:
    print(f"shutdown took over {grace_s:g} s (a stuck request?); exiting", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_gspo.server")
    add_serve_args(parser)
    try:
        serve_main(parser.parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
