"""The built-in rollout server with one injected fault, for tests/e2e/test_server_hardening.py and
test_rollout_launcher.py (the only test double there: the fault; the server and its HTTP are the
real ones).

    python -m tests.e2e.faulty_server die|stuck|linger|nan|old_version --model DIR --port 0 ...

die:    the engine thread ends at the first request it admits (as a bug escaping its loop would).
stuck:  the engine thread blocks forever in its first step (as a hung kernel would).
linger: a failed bind of its port leaves the process running (as SGLang's does: its warmup
        thread polls the port's holder for minutes before it ends the server).
nan:    /generate answers with NaN log-probs (as a server with a numerics bug, or a proxy, would).
old_version: /generate's answers name the base weights, whatever it holds (as a server that
        does not take weight updates, or a cache in front of one, would).
"""

from __future__ import annotations

import json
import sys
import threading
import traceback

from aiohttp import web

from megatron_gspo.server import app, engine
from megatron_gspo.server.__main__ import main as serve_main


def _die(self) -> None:
    if self.waiting:
        raise SystemExit("injected fault")


def _stuck(self) -> None:
    threading.Event().wait()


def _answers(change) -> None:
    """/generate's answers, each result's meta_info passed through `change`."""
    real = app.generate

    async def generate(request: web.Request) -> web.Response:
        resp = await real(request)
        if resp.status != 200:
            return resp
        data = json.loads(resp.body)
        for item in data if isinstance(data, list) else [data]:
            change(item["meta_info"])
        return web.Response(text=json.dumps(data), content_type="application/json")

    app.generate = generate


def _nan(meta: dict) -> None:
    meta["output_token_logprobs"] = [
        [float("nan"), *e[1:]] for e in meta.get("output_token_logprobs") or []
    ]


def _base_version(meta: dict) -> None:
    meta["weight_version"] = "default"


def main() -> None:
    fault, argv = sys.argv[1], sys.argv[2:]
    if fault == "die":
        engine.Engine._admit = _die
    elif fault == "stuck":
        engine.Engine._step = _stuck
    elif fault in ("nan", "old_version"):
        _answers(_nan if fault == "nan" else _base_version)
    elif fault != "linger":
        raise SystemExit(f"unknown fault {fault!r}; use die, stuck, linger, nan or old_version")
    try:
        serve_main(argv)
    except OSError:
        if fault != "linger":
            raise
        traceback.print_exc()
        sys.stderr.flush()
        threading.Event().wait()


if __name__ == "__main__":
    main()
