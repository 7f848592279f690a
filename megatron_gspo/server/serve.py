"""`megatron-gspo serve` (and `python -m megatron_gspo.server`: __main__.py): the process's start
and stop: check the flags (args.py), listen, run the engine thread, stop cleanly on SIGTERM/SIGINT
within --shutdown-timeout. The HTTP API is app.py's."""

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
from pathlib import Path

import torch
from aiohttp import web

from megatron_gspo.errors import UserError
from megatron_gspo.hf.tokenizer_files import check_tokenizer
from megatron_gspo.server import kernels
from megatron_gspo.server.app import build_app
from megatron_gspo.server.args import check_host, check_serve_args
from megatron_gspo.server.state import ServerState

log = logging.getLogger("megatron_gspo.server.serve")


def serve_main(args: argparse.Namespace) -> None:
    check_serve_args(args)
    if not Path(args.model).exists():  # (else named by its absolute path, as "no config.json")
        raise UserError(f"--model {args.model} does not exist; point it at an HF checkpoint")
    check_tokenizer(args.model, "--model")  # (a text request needs it; SGLang's start does too)
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
