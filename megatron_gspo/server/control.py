"""Control endpoints of the built-in server, as SGLang 0.5.23 answers them: flush_cache,
pause/continue_generation, abort_request, update_weight_version, update_weights_from_disk.

Weight updates run on the engine thread between steps. Unless generation is paused they wait for
the running requests to finish and hold new ones back (SGLang's model-update lock); while paused
they apply at once and the paused requests continue on the new weights with their cached k/v.
"""

from __future__ import annotations

from aiohttp import web

from megatron_gspo.errors import UserError
from megatron_gspo.server.engine import Engine
from megatron_gspo.server.http_common import STATE, bad, read_json, run_on_engine
from megatron_gspo.server.sampling import BadRequest
from megatron_gspo.server.state import ServerState
from megatron_gspo.server.validate import body_flag, show, weight_dir


async def flush_cache(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    idle = await run_on_engine(st.engine, lambda e: e.num_requests == 0)
    if not idle:
        return bad("Cache not flushed because there are pending requests.")
    return web.json_response({"success": True, "message": "Cache flushed."})


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_json(request)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise BadRequest(f"mode must be abort, retract or in_place, not {mode!r}")
    request.app[STATE].engine.pause(mode)
    return web.json_response({"success": True, "message": "Generation paused."})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return web.json_response({"success": True, "message": "Generation continued."})


async def abort_request(request: web.Request) -> web.Response:
    body = await read_json(request)
    engine = request.app[STATE].engine
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {show(rid)}")
    if body_flag(body, "abort_all"):
        engine.abort(None)
    elif rid:
        engine.abort(rid)
    # neither: nothing to abort, and SGLang answers 200 too
    return web.json_response({"success": True})


async def update_weight_version(request: web.Request) -> web.Response:
    body = await read_json(request)
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        raise BadRequest("new_version must be a non-empty string")
    engine = request.app[STATE].engine
    if body_flag(body, "abort_all_requests"):
        engine.abort(None, "Abort by update_weight_version")
    await run_on_engine(engine, lambda e: setattr(e, "weight_version", version))
    return web.json_response({"success": True, "message": f"Weight version set to {version}."})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st: ServerState = request.app[STATE]
    body = await read_json(request)
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path must be a checkpoint directory")
    if version is not None and not isinstance(version, str):
        raise BadRequest("weight_version must be a string")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise BadRequest(f"load_format {body['load_format']!r} is not supported; use auto")
    abort_all = body_flag(body, "abort_all_requests")
    body_flag(body, "flush_cache")  # (checked only: this server keeps no prefix cache)
    path = weight_dir(path, st.served_path)
    if abort_all:
        st.engine.abort(None, "Abort by update_weights_from_disk")

    def load(engine: Engine) -> int:
        paused = len(engine.running) if engine.paused else 0
        engine.model.load_checkpoint(path)
        st.model_path = path
        if version is not None:
            engine.weight_version = version
        return paused

    try:
        paused = await run_on_engine(st.engine, load, needs_idle=True)
    except UserError as e:
        return bad(f"Failed to update weights: {e}")
    return web.json_response(
        {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": paused,
        }
    )


ROUTES = [
    ("/flush_cache", flush_cache),
    ("/pause_generation", pause_generation),
    ("/continue_generation", continue_generation),
    ("/abort_request", abort_request),
    ("/update_weight_version", update_weight_version),
    ("/update_weights_from_disk", update_weights_from_disk),
]
