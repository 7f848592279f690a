"""SGLang 0.5.23's /generate JSON: parse a request into engine `Request`s, format the answer.

A request holds one prompt (`input_ids` as a list of ints, or `text`) or a batch (a list of lists,
or a list of strings). With `sampling_params.n` > 1 each prompt becomes n requests, prompt-major,
with ids `{rid}_{j}`; the answer is a list whenever the request was a batch or n > 1.
Log-prob entries are `[logprob, token_id, null]`; the first prompt token's is `[null, id, null]`.
`routed_experts` is base64 of int32 [prompt + output - 1 - routed_experts_start_len, L, k] with
L = every decoder layer, as SGLang encodes it: the rows of dense (non-MoE) layers are zeros.
"""

from __future__ import annotations

import base64
import difflib
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron_gspo.rollout.config import longest_prompt, longest_sequence
from megatron_gspo.server.engine import Engine, Request
from megatron_gspo.server.sampling import SamplingParams, parse_sampling_params
from megatron_gspo.server.validate import (
    DEFAULT_LIMITS,
    INT32_MAX,
    BadRequest,
    Limits,
    body_flag,
    flag,
    integer,
    show,
)


def error_body(message: str) -> dict:
    """The failure shape of both SGLang families: weight endpoints read {success, message},
    /generate clients read {error: {message}}; one body satisfies both."""
    return {"success": False, "message": message, "error": {"message": message}}


def parse_generate(
    body: object,
    vocab_size: int,
    encode: Callable[[str], list[int]] | None,
    context_len: int,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[list[Request], bool, dict]:
    """Requests for a /generate body, whether the answer is a list, and response options.
    Every field is checked here (type and range), so the engine only sees valid requests."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_fields(body)
    if body_flag(body, "stream"):
        raise BadRequest("stream=true is not supported by the built-in server")
    prompts, batched = _prompts(body, encode, limits)
    for ids in prompts:
        _check_ids(ids, vocab_size)
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    if len(sps) != len(prompts):
        raise BadRequest("sampling_params is a list of another length than the batch")
    params = [parse_sampling_params(sp, vocab_size, limits) for sp in sps]
    for ids, raw, sp in zip(prompts, sps, params):
        given = isinstance(raw, dict) and "max_new_tokens" in raw
        fit_context(sp, len(ids), given, context_len)
    total = sum(sp.n for sp in params)
    if total > limits.max_batch:
        raise BadRequest(
            f"the request asks for {total} sequences (prompts x sampling_params.n); this server "
            f"takes at most {limits.max_batch} in one request (--max-batch-size): split it"
        )
    rids = _rids(body.get("rid"), len(prompts))
    return_logprob = _per_item(body, "return_logprob", False, len(prompts))
    return_logprob = [flag(v, "return_logprob") for v in return_logprob]
    start_len = _per_item(body, "logprob_start_len", -1, len(prompts))
    start_len = [integer(v, "logprob_start_len", -1, INT32_MAX) for v in start_len]
    routed = body_flag(body, "return_routed_experts")
    requests: list[Request] = []
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        group = rids[i] if rids[i] is not None else uuid.uuid4().hex
        for j in range(sp.n):
            requests.append(
                Request(
                    input_ids=ids,
                    params=sp,
                    rid=group if sp.n == 1 else f"{group}_{j}",
                    group=group,
                    return_logprob=return_logprob[i],
                    logprob_start_len=start_len[i],
                    return_routed=routed,
                )
            )
    _check_distinct(requests)
    start = body.get("routed_experts_start_len") or 0
    options = {
        "routed_start": integer(start, "routed_experts_start_len", 0, INT32_MAX),
        "unknown": unknown_fields(body),
    }
    return requests, batched or params[0].n > 1, options


def check_context(prompt: int, max_new_tokens: int | None, context_len: int) -> int:
    """The most tokens SGLang 0.5.23 generates after a prompt of `prompt` tokens with
    `max_new_tokens` asked for (None: the default, not given) in the model's context, or the 400
    it answers (without --allow-auto-truncate; the rule is rollout/config.py's). Its
    TokenizerManager refuses a prompt that leaves no room for a token and an explicit
    max_new_tokens that runs past the context; its scheduler then refuses a prompt of
    context - 6 tokens or more, and cuts max_new_tokens without a word to what leaves the prompt
    and its answer at context - 2 tokens (finish_reason length)."""
    top, room = longest_prompt(context_len), longest_sequence(context_len) - prompt
    if prompt >= context_len:
        raise BadRequest(
            f"the prompt has {prompt} tokens, which leaves no room for a new token in the "
            f"model's context length of {context_len} tokens; shorten it to at most {top} tokens"
        )
    if max_new_tokens is not None and prompt + max_new_tokens > context_len:
        fix = (
            f"lower max_new_tokens to at most {room} (all this server and SGLang generate after "
            "this prompt) or shorten the prompt"
            if prompt <= top
            else f"shorten the prompt to at most {top} tokens"
        )
        raise BadRequest(
            f"the prompt's {prompt} tokens + sampling_params.max_new_tokens {max_new_tokens} = "
            f"{prompt + max_new_tokens} tokens exceed the model's maximum context length of "
            f"{context_len} tokens; {fix}"
        )
    if prompt > top:
        raise BadRequest(
            f"the prompt has {prompt} tokens; in the model's context length of {context_len} "
            f"tokens a prompt has at most {top} (as in SGLang, whose scheduler refuses a prompt "
            "of context - 6 tokens or more); shorten it"
        )
    return room


def fit_context(sp: SamplingParams, prompt: int, given: bool, context_len: int) -> None:
    """Check a prompt of `prompt` tokens against the context (`check_context`; `given`: the
    request set max_new_tokens) and cut `sp.max_new_tokens` to what SGLang generates after it,
    with min_new_tokens at most that (as SGLang's scheduler does)."""
    room = check_context(prompt, sp.max_new_tokens if given else None, context_len)
    sp.max_new_tokens = min(sp.max_new_tokens, room)
    sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)


# SGLang's GenerateReqInput fields: those this server serves, those that only steer scheduling,
# logging or routing among many servers (no effect on one built-in server's answers), and those
# that would change the answer and are not implemented here. A field SGLang does not know is
# ignored, as SGLang ignores it (sglang-router adds `model`), and named once in the server's log
# (a misspelt `return_logprobs` would otherwise come back without log-probs and no word why).
SERVED = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
          "return_routed_experts", "routed_experts_start_len", "stream"}  # fmt: skip
NO_EFFECT = {"log_metrics", "no_logs", "custom_labels", "conversation_id", "session_id",
             "priority", "routing_key", "extra_key", "data_parallel_rank", "routed_dp_rank",
             "received_time", "external_trace_header"}  # fmt: skip
NOT_SERVED = {"input_embeds", "image_data", "video_data", "audio_data", "modalities",
              "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
              "return_hidden_states", "return_entropy", "return_bytes", "return_sampling_mask",
              "return_prompt_token_ids", "session_params", "lora_path", "lora_id",
              "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
              "bootstrap_pair_key", "background", "require_reasoning"}  # fmt: skip


KNOWN = SERVED | NO_EFFECT | NOT_SERVED


def unknown_fields(body: dict) -> list[str]:
    """The top-level fields of `body` that SGLang does not know (ignored), sorted."""
    return sorted(k for k in body if k not in KNOWN)


def ignored_field_notice(name: str) -> str:
    """The log line for an ignored field, naming the known field it is close to, if any (a
    name far longer than any field's is no misspelling, and is not compared)."""
    close = difflib.get_close_matches(name, sorted(KNOWN), n=1) if len(name) <= 64 else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"/generate: ignored the unknown field {show(name)}{hint}, as SGLang ignores it"


def check_fields(body: dict) -> None:
    """Refuse a field this server does not implement unless its value asks for nothing (null,
    false, 0, []): the client would get an answer without what it asked for."""
    for key in sorted(NOT_SERVED & set(body)):
        if not _asks_nothing(body[key]):
            raise BadRequest(
                f"{key} is not supported by the built-in server; leave it out (got "
                f"{show(body[key])})"
            )


def _asks_nothing(v: object) -> bool:
    if isinstance(v, list):
        return all(_asks_nothing(x) for x in v)
    return v is None or v is False or (type(v) is int and v == 0)


def _prompts(body: dict, encode, limits: Limits) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("give exactly one of input_ids or text")
    nested = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    batch = text if text is not None else ids if nested else None
    if isinstance(batch, list) and len(batch) > limits.max_batch:  # refused before encoding
        raise BadRequest(
            f"the batch holds {len(batch)} prompts; this server takes at most "
            f"{limits.max_batch} in one request (--max-batch-size): split it"
        )
    if text is not None:
        if encode is None:
            raise BadRequest("this checkpoint has no tokenizer.json; send input_ids")
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise BadRequest("text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return ids, True
    if isinstance(ids, list):
        return [ids], False
    raise BadRequest("input_ids must be a list of token ids or a list of such lists")


def _rids(rids: object, n: int) -> list:
    if isinstance(rids, list):
        if len(rids) != n or not all(_is_rid(r) for r in rids):
            raise BadRequest("rid must be a list of distinct strings, one per prompt")
        if len(set(map(str, rids))) != n:
            raise BadRequest("rid must be a list of distinct strings, one per prompt")
        return rids
    if rids is not None and not _is_rid(rids):
        raise BadRequest(f"rid must be a string, got {show(rids)}")
    if rids is not None and n > 1:
        raise BadRequest("a batch needs a list of rids, one per prompt")
    return [rids] * n


def _is_rid(r: object) -> bool:
    return isinstance(r, str)  # (SGLang's rid: a string, or a list of them for a batch)


def _check_distinct(requests: list[Request]) -> None:
    """The ids a batch creates ({rid}_{j} for n > 1) must differ: a client tells its answers
    apart by them, and an abort by one would reach the other."""
    twice = sorted(rid for rid, count in Counter(r.rid for r in requests).items() if count > 1)
    if twice:
        raise BadRequest(
            f"the request's rids give colliding ids {', '.join(map(repr, twice[:5]))} "
            "(prompt i with n > 1 makes {rid[i]}_0 .. {rid[i]}_{n-1}): choose distinct rids"
        )


def _check_ids(ids: list, vocab_size: int) -> None:
    if not ids:
        raise BadRequest("the prompt is empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise BadRequest(f"input_ids holds {show(t)}, not a token id in [0, {vocab_size})")


def _per_item(body: dict, key: str, default, n: int) -> list:
    v = body.get(key, default)
    v = default if v is None else v
    if isinstance(v, list):
        if len(v) != n:
            raise BadRequest(f"{key} is a list of another length than the batch")
        return [default if x is None else x for x in v]
    return [v] * n


def format_result(
    req: Request,
    engine: Engine,
    decode: Callable[[list[int], bool], str] | None,
    routed_start: int,
) -> dict:
    sp = req.params
    out_ids = req.output_ids
    text_ids = out_ids
    matched = (req.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not sp.no_stop_trim and out_ids and out_ids[-1] == matched:
        text_ids = out_ids[:-1]
    text = decode(text_ids, sp.skip_special_tokens) if decode else ""
    if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(out_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version,
        "e2e_latency": req.finished - req.created,
    }
    if req.return_logprob:
        ids = req.input_ids[max(req.logprob_start_len, 0) :] if req.input_logprobs else []
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.input_logprobs, ids)]
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(req.output_logprobs, out_ids)
        ]
    if req.return_routed and engine.record_routing:
        routed = engine.routed_experts(req, routed_start)
        if routed is not None:
            spec = engine.model.spec
            all_layers = np.zeros((routed.shape[0], spec.num_layers, routed.shape[2]), np.int32)
            all_layers[:, spec.moe_layer_ids] = routed.numpy()
            raw = all_layers.tobytes()
            meta["routed_experts"] = base64.b64encode(raw).decode("ascii")
    return {"text": text, "output_ids": list(out_ids), "meta_info": meta}
