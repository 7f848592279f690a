"""Blocking JSON requests to many rollout servers at once, each failure naming its server.

The sync runs in the trainer's (synchronous) step, partly on a sender thread, so requests are
plain urllib calls on a thread pool rather than an event loop: a distributed update's request
must be in flight while the same thread's caller broadcasts.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_gspo.no_redirect import OPENER, is_redirect, redirect_refusal
from megatron_gspo.weight_sync.config import ServerRef

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
# The largest answer read from a server: the sync's endpoints answer a few lines of JSON (the
# verification probe's /generate, a few hundred tokens with their log-probs, is the longest).
MAX_ANSWER_BYTES = 16 << 20


class ServerError(RuntimeError):
    """One server refused or could not be reached; the message starts with its URL."""

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url = url


class Servers:
    def __init__(self, refs: Iterable[str | ServerRef], timeout_s: float = 600.0):
        self.refs = [ServerRef.of(r) for r in refs]
        if not self.refs:
            raise ValueError("the weight sync needs at least one rollout server")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.refs)))
        # servers that map shared memory read-only and leave its references to the sender
        self.keeps_shared_refs: set[str] = set()

    def __len__(self) -> int:
        return len(self.refs)

    def url(self, i: int) -> str:
        return self.refs[i].url

    def post(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST JSON to server i; a non-2xx answer, `success: false` or no answer raise."""
        return self._request(i, path, json.dumps(body).encode(), timeout_s)

    def get(self, i: int, path: str, timeout_s: float | None = None) -> dict:
        return self._request(i, path, None, timeout_s)

    def _request(self, i: int, path: str, data: bytes | None, timeout_s: float | None) -> dict:
        ref = self.refs[i]
        headers = {"Content-Type": "application/json"}
        if ref.api_key:
            headers["Authorization"] = f"Bearer {ref.api_key}"
        req = urllib.request.Request(ref.url + path, data, headers)
        try:
            with OPENER.open(req, timeout=timeout_s or self.timeout_s) as r:
                data = _json(_read_capped(r, ref.url, path))
        except urllib.error.HTTPError as e:
            raise ServerError(ref.url, _refusal(path, e)) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(ref.url, f"{path} failed: unreachable ({reason})") from None
        except http.client.HTTPException as e:  # (a proxy's or another program's bytes)
            what = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise ServerError(
                ref.url, f"{path} answered something other than HTTP ({what})"
            ) from None
        if isinstance(data, dict) and data.get("success") is False:
            raise ServerError(ref.url, f"{path} refused: {data.get('message')}")
        return data if isinstance(data, dict) else {"data": data}

    def submit(self, i: int, path: str, body: dict, timeout_s: float | None = None) -> Future:
        return self._pool.submit(self.post, i, path, body, timeout_s)

    def post_many(
        self, indices: Iterable[int], path: str, body: dict | Callable[[int], dict]
    ) -> tuple[dict[int, dict], dict[int, str]]:
        """POST to several servers in parallel: (answers, errors) by server index."""
        futures = {i: self.submit(i, path, body(i) if callable(body) else body) for i in indices}
        return collect(futures)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def collect(futures: dict[int, Future]) -> tuple[dict[int, dict], dict[int, str]]:
    answers, errors = {}, {}
    for i, f in futures.items():
        try:
            answers[i] = f.result()
        except ServerError as e:
            errors[i] = str(e)
        except Exception as e:  # noqa: BLE001 - any failure of one server is reported for it
            errors[i] = f"{type(e).__name__}: {e}"
    return answers, errors


def _read_capped(r, url: str, path: str) -> bytes:
    raw = r.read(MAX_ANSWER_BYTES + 1)
    if len(raw) > MAX_ANSWER_BYTES:
        raise ServerError(
            url, f"{path} answered more than {MAX_ANSWER_BYTES >> 20} MiB, not an answer of "
            "this endpoint: is rollout.urls the rollout server's address?"
        )  # fmt: skip
    if r.length:  # (a read of n bytes returns what came before the peer hung up, unsaid)
        raise http.client.IncompleteRead(raw, r.length)
    return raw


def _refusal(path: str, e: urllib.error.HTTPError) -> str:
    if is_redirect(e):  # (refused by OPENER: the API key would go wherever it points)
        return f"{redirect_refusal(path, e)}: give the server's own address in rollout.urls"
    return f"{path} answered HTTP {e.code}: {_message(e.read(MAX_ANSWER_BYTES))}"


def _json(raw: bytes):
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return {"message": raw[:300].decode(errors="replace")}


def _message(raw: bytes) -> str:
    data = _json(raw)
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        return str(data.get("message") or err or data)
    return str(data)
