"""What a rollout server answers, as the client reads it: failures (`RolloutError`), JSON bodies
(SGLang's error shape included), one /generate result (`read_answer`) and the routed experts of
R3.

rollout.urls may name a proxy, a server of another SGLang version or one serving another model,
so a result is checked before a sample is made of it: a body that is not SGLang's shape, token
ids outside the model's vocabulary, log-probs that are not one number <= 0 per token (NaN, text,
above 0; -inf is left to the non-finite guard, train/guard.py), or a finish reason that is no
name stop the run with one line naming the server, rather than a traceback or a step trained on
them. A finish reason named but not one the client knows (a newer SGLang's) ends that sample
only: it is not trained on (`Sample.ended_unknown`), and a warning names the server and the
reason once. An answer is read only up to a size its request bounds (`answer_limit`): a
server sending more (400 MB once made the trainer take 1.6 GB) stops the run the same way before
the rest is read. A failed answer (not 200) is read only for its message, up to FAILURE_LIMIT
bytes: a 5xx is `Retryable` on another server whatever its size, a 4xx refuses the request. A
redirect (3xx) is not followed (the API key would go with it, and the answer would come from
wherever it pointed): it refuses the request, as a 4xx does (`refuse_redirect`)."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from dataclasses import dataclass
from typing import NoReturn

import aiohttp
import numpy as np

from megatron_gspo.errors import UserError
from megatron_gspo.no_redirect import is_redirect, refusal_line
from megatron_gspo.rollout.sample import FINISH_REASONS

log = logging.getLogger(__name__)

# The most bytes a /generate answer may take, from its request (`answer_limit`): per new token
# its id and its share of the text (a token's text, JSON-escaped, rarely passes 16 bytes); per
# token with a log-prob, input or output, SGLang's [logprob, id, text] entry; per result the rest
# of meta_info; R3's ids are int32 in base64. A real answer stays well under all of it times
# ANSWER_MARGIN; one past it is not an answer to this request, and is not read further.
_ID_BYTES, _TEXT_BYTES, _LOGPROB_BYTES, _RESULT_BYTES = 12, 64, 128, 64 << 10
ANSWER_MARGIN, ANSWER_SLACK = 4, 1 << 20
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, for a request that gives none
MAX_LAYERS = 128  # R3 where the client is not told the model's layers (more than any MoE has)
# The most bytes of a failed (non-200) answer read: only its message is wanted, and a proxy's
# error page or a traceback dump may be of any size (a 5xx longer than its request's answer_limit
# used to stop the run, where a server that failed is to be retried on another).
FAILURE_LIMIT = 64 << 10
# The most bytes of an answer to a control request (read_json): they are a few lines of JSON.
CONTROL_LIMIT = 16 << 20
# A log-prob is <= 0, but a server's low-precision log-softmax may put a sure token above 0 (bf16
# logits of magnitude 64-128 are 0.5 apart): only a value past this is no log-prob. A harmless
# rounding must not stop a run; NaN, text and +inf do.
LOGPROB_SLACK = 1.0


class RolloutError(UserError):
    """A request that failed for good: refused (4xx), out of retries, or answered with what no
    SGLang-compatible server sends. One line that names the server (the CLI prints it, exit 2)."""


class Retryable(Exception):
    """A failure another try (on another server) may get past: a 5xx, a time-out, a connection
    lost. `status`: the HTTP status of a 5xx answer (None for the others)."""

    def __init__(self, text: str, status: int | None = None):
        super().__init__(text)
        self.status = status


@dataclass
class Answer:
    """One /generate result, checked."""

    tokens: list[int]
    logprobs: list[float] | None  # None: not asked for
    finish_reason: str  # one of FINISH_REASONS, or one a newer server added
    weight_version: str
    routed_experts: str | None  # base64, as sent


def read_answer(data: object, url: str, vocab_size: int | None,
                said: set[tuple[str, str]] | None = None) -> Answer:  # fmt: skip
    """`data` (one result of `url`'s /generate) as an Answer; RolloutError on anything else.
    `said`: the (server, finish reason) pairs already warned of as reasons the client does not
    know (a warning each, once)."""
    if not (isinstance(data, dict) and isinstance(data.get("meta_info"), dict)
            and isinstance(data.get("output_ids"), list)):  # fmt: skip
        _bad(url, f"{snippet(data)}, not SGLang's {{output_ids, meta_info}}")
    meta = data["meta_info"]
    tokens = data["output_ids"]
    top = vocab_size or 2**63
    wrong = [i for i, t in enumerate(tokens) if type(t) is not int or not 0 <= t < top]
    if wrong:
        span = f" [0, {vocab_size})" if vocab_size else ""
        _bad(url, f"token id {snippet(tokens[wrong[0]])}, not one of the model's vocabulary{span}")
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if not (isinstance(kind, str) and kind):
        _bad(url, f"finish_reason {snippet(reason)}, not a name ({', '.join(FINISH_REASONS)}...)")
    said = set() if said is None else said
    if kind not in FINISH_REASONS and (url, kind) not in said:
        said.add((url, kind))
        log.warning(unknown_finish(url, kind))
    routed = meta.get("routed_experts")
    if routed is not None and not isinstance(routed, str):
        _bad(url, f"routed_experts {snippet(routed)}, not a base64 string")
    lps = meta.get("output_token_logprobs")
    return Answer(list(tokens), None if lps is None else _logprobs(lps, tokens, url), str(kind),
                  str(meta.get("weight_version", "")), routed)  # fmt: skip


def unknown_finish(url: str, kind: str) -> str:
    """The warning for a finish reason `kind` of `url`'s that the client does not know."""
    return (f"{url}/generate answered finish_reason {snippet(kind)}, not one this trainer knows "
            f"({', '.join(FINISH_REASONS)}; a newer SGLang's?): each such sample ends there and "
            "its group is not trained on (said once for this server and reason)")  # fmt: skip


def _logprobs(entries: object, tokens: list[int], url: str) -> list[float]:
    """SGLang's [[logprob, token_id, text], ...]: one per output token, each a log-prob <= 0."""
    if not isinstance(entries, list) or len(entries) != len(tokens):
        n = len(entries) if isinstance(entries, list) else snippet(entries)
        _bad(url, f"{n} output_token_logprobs for {len(tokens)} output_ids")
    out = []
    for i, (e, token) in enumerate(zip(entries, tokens)):
        ok = isinstance(e, list | tuple) and len(e) >= 1 and type(e[0]) in (int, float)
        if not ok or math.isnan(e[0]) or e[0] > LOGPROB_SLACK:
            _bad(url, f"output_token_logprobs[{i}] = {snippet(e)}; a log-prob is a number <= 0")
        if len(e) >= 2 and type(e[1]) is int and e[1] != token:
            _bad(
                url, f"output_token_logprobs[{i}] for token {e[1]}, but output_ids[{i}] is {token}"
            )
        out.append(float(e[0]))
    return out


def _bad(url: str, what: str) -> NoReturn:
    raise bad_answer(url, what)


def bad_answer(url: str, what: str) -> RolloutError:
    """The error for a /generate answer that is not what `what` says it should be."""
    return RolloutError(
        f"{url}/generate answered {what}; check that rollout.urls points at an SGLang-compatible "
        "server (not a proxy's page) serving the model being trained"
    )


def snippet(value: object, limit: int = 120) -> str:
    """`value` as short one-line text."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def topk_unsaid(url: str, said: object) -> RolloutError:
    """The error for a server whose /model_info gives no top-k (`said`) where R3 needs one."""
    return RolloutError(f"{url}/model_info did not say its top-k (its num_experts_per_tok: "
                        f"{snippet(said)}); pass RolloutClient(topk=K)")  # fmt: skip


def engine_busy_s(info: object) -> float:
    """The built-in server's working seconds in its /get_server_info; LookupError, TypeError or
    ValueError where it does not say them (SGLang), or says no count (NaN, which would read as
    an idle time of 0, or a negative one)."""
    busy = float(info["internal_states"][0]["engine_busy_s"])  # type: ignore[index]
    if not (math.isfinite(busy) and busy >= 0):
        raise ValueError(f"engine_busy_s {busy} is no count of seconds")
    return busy


def decode_routed_experts(b64: str, num_tokens: int, topk: int | None) -> np.ndarray:
    """SGLang's base64 int32 payload as [num_tokens, layers, topk]."""
    try:
        flat = np.frombuffer(base64.b64decode(b64, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError):
        raise RolloutError(
            f"routed_experts is not base64 of int32 ids ({snippet(b64, 40)})"
        ) from None
    if not topk or num_tokens <= 0 or flat.size % (num_tokens * topk):
        raise RolloutError(
            f"routed_experts holds {flat.size} ids, not a multiple of {num_tokens} tokens x top-{topk}"
        )
    return flat.reshape(num_tokens, -1, topk).copy()


def routed_experts(b64: str, num_tokens: int, topk: int | None, url: str) -> np.ndarray:
    """decode_routed_experts of `url`'s answer; what is wrong with them, as its bad_answer."""
    try:
        return decode_routed_experts(b64, num_tokens, topk)
    except RolloutError as e:
        raise bad_answer(url, str(e)) from None


async def read_json(resp: aiohttp.ClientResponse, url: str) -> dict:
    """The JSON object of `url`'s answer to a control request (/model_info, /abort_request, a
    weight update; a few lines of JSON) read up to CONTROL_LIMIT bytes (a RolloutError past it,
    the rest not read); a body that is not one, as {"message": text} or {"data": value}."""
    raw, more = await _read_upto(resp, CONTROL_LIMIT)
    if more:
        raise RolloutError(
            f"{control_too_long(url + resp.url.path)}; check that rollout.urls points at an "
            "SGLang-compatible server (not a proxy's page)"
        )
    return json_object(raw)


def control_too_long(where: str) -> str:
    """One line for an answer to the control request `where` (a server's URL and the path) that
    had more than CONTROL_LIMIT bytes."""
    return (f"{where} answered a body of more than {_mb(CONTROL_LIMIT)}, where its answer is a "
            "few lines of JSON (not read past that)")  # fmt: skip


def redirect_line(resp: aiohttp.ClientResponse, path: str) -> str | None:
    """One line for an answer to `path` that is a 3xx (asked with allow_redirects=False), naming
    where it pointed; None for any other answer."""
    if not is_redirect(resp.status):
        return None
    key = "Authorization" in resp.request_info.headers
    return refusal_line(path, resp.status, resp.headers.get("Location"), key)


def refuse_redirect(resp: aiohttp.ClientResponse, url: str, path: str) -> None:
    """A RolloutError where `url`'s answer to `path` is a 3xx, its redirect_line: the request is
    not followed there, nor sent to another server (a server or proxy that redirects is
    misconfigured, as one that answers 4xx is)."""
    if (line := redirect_line(resp, path)) is not None:
        raise RolloutError(f"{url}: {line}; point rollout.urls at the server itself")


def control_object(raw: bytes) -> dict | str:
    """The whole answer `raw` to a control request as a JSON object ({} where it is empty:
    SGLang's), else what it is in words (a proxy's page, a list): its snippet and why."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{snippet(raw[:2000].decode('utf-8', 'replace'))}, not JSON"
    return data if isinstance(data, dict) else f"{snippet(data)}, not a JSON object"


def control_failure(path: str, status: int, raw: bytes) -> str:
    """One line for a failed answer (not 2xx, not a redirect) to the control request `path`,
    its body `raw` (the first FAILURE_LIMIT bytes at most) read for its message."""
    what = message(json_object(raw)) if raw.strip() else "(no body)"
    return f"{path} answered HTTP {status}: {what}"


def json_object(raw: bytes) -> dict:
    """`raw` as read_json reads an answer's body."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        return data
    if data is None:
        return {"message": raw[:2000].decode("utf-8", "replace")[:500]}
    return {"data": data}


def answer_limit(body: dict, layers: int | None, topk: int | None) -> int:
    """The most bytes a /generate answer to `body` (one request, or a batch of them) may take:
    ANSWER_MARGIN times what its results can hold, plus ANSWER_SLACK. `layers`, `topk`: the
    model's (R3's routed experts are tokens x layers x top-k ids)."""
    batch = isinstance(body.get("rid"), list)
    prompts = body["input_ids"] if batch else [body["input_ids"]]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    total = ANSWER_SLACK
    for prompt, sp in zip(prompts, params):
        new = int(sp.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
        tokens = len(prompt) + new
        size = _RESULT_BYTES + new * (_ID_BYTES + _TEXT_BYTES)
        if body.get("return_logprob"):
            size += tokens * _LOGPROB_BYTES
        if body.get("return_routed_experts"):
            size += (tokens * (layers or MAX_LAYERS) * (topk or 1) * 4 + 2) // 3 * 4
        total += ANSWER_MARGIN * size
    return total


async def read_generate(resp: aiohttp.ClientResponse, url: str, body: dict, layers: int | None,
                        topk: int | None) -> dict:  # fmt: skip
    """`url`'s 200 answer to /generate `body` read as read_json does, if it is at most its
    `answer_limit`; a longer one is a RolloutError once that many bytes came (or at once, where
    its Content-Length says so), the rest never read and its connection closed."""
    limit = answer_limit(body, layers, topk)
    declared = resp.content_length
    if declared is not None and declared > limit:
        resp.close()
        what = f"a body of {_mb(declared)} (its Content-Length), more than"
        raise _too_big(url, what, limit, "not read")
    raw, more = await _read_upto(resp, limit)
    if more:
        raise _too_big(url, "a body of more than", limit, "not read past that")
    return json_object(raw)


async def read_failure(resp: aiohttp.ClientResponse, url: str) -> Retryable | RolloutError:
    """`url`'s failed (non-200) answer to /generate as its error: a 5xx (a server that failed)
    Retryable, any other a RolloutError (the request refused; a 3xx's is raised here, by
    refuse_redirect, its body not read). Its message comes from the first FAILURE_LIMIT bytes of
    its body at most (said so where there was more), the rest not read."""
    refuse_redirect(resp, url, "/generate")
    raw, more = await _read_upto(resp, FAILURE_LIMIT)
    what = message(json_object(raw))
    if more:
        what += f" (its body cut at {FAILURE_LIMIT >> 10} KiB, the rest not read)"
    if resp.status >= 500:
        return Retryable(f"HTTP {resp.status}: {what}", resp.status)
    return RolloutError(f"{url} refused the request: {what}")


async def _read_upto(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of `resp`'s body and whether it had more; then the rest is not
    read and its connection is closed."""
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            resp.close()
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


def _too_big(url: str, body: str, limit: int, read: str) -> RolloutError:
    return bad_answer(url, f"{body} the {_mb(limit)} its request can need ({read})")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def message(data: dict) -> str:
    """The error message of an answer, wherever the server put it, on one line (an HTML error
    page's included)."""
    err = data.get("error")
    if isinstance(err, dict) and err.get("message"):
        text = str(err["message"])
    else:
        text = str(data.get("message") or err or data)
    return " ".join(text.split())[:300]
