"""Async client for a set of SGLang-compatible rollout servers (SGLang or the built-in server).

`generate` sends one /generate request per sample (G per prompt), each with its own rid, so
samples spread over servers and can be aborted one by one; `grouped=True` sends one batch
request per prompt (its G samples, each with its own rid and seed), which saves a server's
per-request overhead when answers are short. A prompt's samples go to one server (the least
loaded when the prompt is scheduled), so SGLang's radix cache shares the prompt. Each server
takes at most `max_concurrency` requests at a time. Connection errors, time-outs and 5xx answers
(of any size: a failed answer's body is read only for its message, answers.py) are retried on
another server with back-off, but not a healthy server's same 500 again and again (retries.py);
a 4xx is the caller's error, raised at once (`RolloutError`), as is a 3xx: no request follows
a redirect (`_ask`), nor sends its API key there. `abort()` aborts every outstanding request of
this client: those come back with their partial output and finish_reason "abort". With
`sampling_seed`, sample j of prompt i gets seed + i * n + j: the G samples of a prompt differ
and a rerun reproduces them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import aiohttp

from megatron_gspo.rollout.answers import (
    Retryable,
    RolloutError,
    bad_answer,
    decode_routed_experts,
    engine_busy_s,
    message,
    read_answer,
    read_failure,
    read_generate,
    read_json,
    redirect_line,
    refuse_redirect,
    routed_experts,
    snippet,
    topk_unsaid,
)
from megatron_gspo.rollout.partial import Hold
from megatron_gspo.rollout.retries import MAX_BACKOFF_S, SAME_500S, Tries
from megatron_gspo.rollout.sample import Sample

__all__ = ["RolloutClient", "RolloutError", "Sample", "decode_routed_experts"]

log = logging.getLogger(__name__)

_QUICK = aiohttp.ClientTimeout(total=5)  # a question about the servers' state


@dataclass
class _Server:
    url: str
    sem: asyncio.Semaphore
    load: int = 0  # requests assigned and not yet answered
    failures: int = 0  # consecutive failures: such servers are chosen last


class RolloutClient:
    def __init__(  # noqa: PLR0913 - the URLs, then keyword-only options
        self,
        urls: list[str] | str,
        *,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        topk: int | None = None,
        outage_s: float = 0.0,
        vocab_size: int | None = None,
        layers: int | None = None,
        server_logs: dict[str, str] | None = None,
    ):
        """`retries` quick retries on other servers (backoff_s, doubling); after those, a
        request waits up to `outage_s` for any server to answer /health again (its supervisor
        restarting it) and is sent there: a sample is retried, never lost or doubled.
        `vocab_size`: the model's; a token id outside it is an error (another model's server).
        `layers`, `topk`: the model's, which bound an answer's size (answers.py).
        `server_logs`: each server's log by URL, named where one fails a request for good."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_concurrency = max_concurrency
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.retries, self.backoff_s, self.outage_s = retries, backoff_s, outage_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.topk, self.vocab_size, self.layers = topk, vocab_size, layers
        self.server_logs = {u.rstrip("/"): p for u, p in (server_logs or {}).items()}
        self._servers: list[_Server] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._outstanding: dict[str, str] = {}  # rid -> server url
        self._epoch = 0  # bumped by abort(): requests of older epochs are not sent
        self._busy_unsaid = False  # no engine_busy_s in /get_server_info (SGLang's: ~20 ms a call)
        self._unknown_said: set[tuple[str, str]] = set()  # (server, finish reason) warned of
        self.hold = Hold(self)  # while it is on, no request is sent (partial.py)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _state(self) -> tuple[aiohttp.ClientSession, list[_Server]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=0)
            )
            self._servers = [_Server(u, asyncio.Semaphore(self.max_concurrency)) for u in self.urls]
        assert self._servers is not None  # set with the first session
        return self._session, self._servers

    def _ask(self, method: str, url: str, path: str, timeout: aiohttp.ClientTimeout, **kw):
        """The request of `path` on `url`, a 3xx not followed (aiohttp says so per request)."""
        session, _ = self._state()
        return session.request(method, url + path, timeout=timeout, allow_redirects=False, **kw)

    # ---- generation ----------------------------------------------------------------------

    async def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        grouped: bool = False,
    ) -> list[list[Sample]]:
        """n samples for each token-id prompt; result[i][j] is sample j of prompt i. `grouped`:
        one batch request per prompt (its n samples), else one request per sample."""
        _, servers = self._state()
        if return_routed_experts and self.topk is None:
            said = (await self.get(servers[0].url, "/model_info")).get("num_experts_per_tok")
            self.topk = said if type(said) is int and said > 0 else None
            if self.topk is None:
                raise topk_unsaid(servers[0].url, said)
        epoch = self._epoch
        tasks = []
        for i, prompt in enumerate(prompts):
            server = min(servers, key=lambda s: (s.failures > 0, s.load))
            server.load += n
            samples, params = [], []
            for j in range(n):
                sp = dict(sampling_params or {})
                if sp.get("sampling_seed") is not None:
                    sp["sampling_seed"] = int(sp["sampling_seed"]) + i * n + j
                samples.append(Sample(i, j, list(prompt), rid=f"{uuid.uuid4().hex}-{i}-{j}"))
                params.append(sp)
            flags = {"return_logprob": return_logprob,
                     "return_routed_experts": return_routed_experts}  # fmt: skip
            if grouped and n > 1:
                body = {"input_ids": [list(prompt)] * n, "sampling_params": params,
                        "rid": [s.rid for s in samples], **flags}  # fmt: skip
                tasks.append(self._send(samples, body, server, epoch))
                continue
            for sample, sp in zip(samples, params):
                body = {"input_ids": list(prompt), "sampling_params": sp, "rid": sample.rid,
                        **flags}  # fmt: skip
                tasks.append(self._send([sample], body, server, epoch))
        done = await asyncio.gather(*tasks)
        out: list[list[Sample]] = [[] for _ in prompts]
        for group in done:
            for s in group:
                out[s.prompt_index].append(s)
        return out

    async def _send(
        self, samples: list[Sample], body: dict, server: _Server, epoch: int
    ) -> list[Sample]:
        """One request for `samples` (one, or a prompt's group), retried whole (retries.py)."""
        _, servers = self._state()
        rids = [s.rid for s in samples]
        tries, first = Tries(rids[0]), server
        try:
            while True:
                if epoch != self._epoch:
                    return samples  # aborted before it was sent
                if tries.attempt:
                    server = await self._next_server(servers, tries)
                tries.urls.append(server.url)
                try:
                    result = await self._post_generate(server, rids, body, epoch)
                except Retryable as e:
                    server.failures += 1
                    tries.failed(e)
                    log.warning("rollout request %s failed on %s: %s", rids[0], server.url, e)
                    await self._refuse_a_server_bug(server, tries)
                    continue
                server.failures = 0
                if result is None:
                    return samples
                items, latency = result
                want = body["return_routed_experts"]
                return [self._fill(s, d, server.url, latency, want)
                        for s, d in zip(samples, items)]  # fmt: skip
        finally:
            first.load -= len(samples)

    async def _next_server(self, servers: list[_Server], tries: Tries) -> _Server:
        """Where the next try of a failed request goes, after its back-off: another server for
        the quick retries; then the first to answer /health within `outage_s` of the first wait
        (a RolloutError when none does)."""
        if tries.attempt <= self.retries:
            await asyncio.sleep(tries.backoff_s(self.backoff_s))
            return self._pick_other(servers, tries.urls)
        until = tries.wait_until(self.outage_s)
        await asyncio.sleep(tries.backoff_s(self.backoff_s, MAX_BACKOFF_S))  # (retries.py)
        healthy = await self._healthy_server(servers, until) if time.monotonic() < until else None
        if healthy is None:
            raise tries.gave_up(self.outage_s)
        return healthy

    async def _refuse_a_server_bug(self, server: _Server, tries: Tries) -> None:
        """Stop a request that had the same HTTP 500 SAME_500S times from an up `server`."""
        if tries.same_500s >= SAME_500S and (await self._health(server.url, 5.0))[0] == 200:
            raise tries.server_bug(server.url, self.server_logs.get(server.url))

    async def _healthy_server(self, servers: list[_Server], until: float) -> _Server | None:
        """The first server (fewest failures first) to answer /health 200 before `until`."""
        while True:
            for server in sorted(servers, key=lambda s: (s.failures, s.load)):
                if (await self._health(server.url, total_s=5.0))[0] == 200:
                    return server
            if time.monotonic() >= until:
                return None
            await asyncio.sleep(0.5)

    def _pick_other(self, servers: list[_Server], tried: list[str]) -> _Server:
        fresh = [s for s in servers if s.url not in tried] or servers
        return min(fresh, key=lambda s: (s.failures, s.load))

    async def _post_generate(
        self, server: _Server, rids: list[str], body: dict, epoch: int
    ) -> tuple[list[dict], float] | None:
        """(the results, one per rid; the latency), or None when aborted before it was sent."""
        async with server.sem:
            if epoch != self._epoch or self.hold.on:
                return None  # aborted (or held) while it waited for a slot
            for rid in rids:
                self._outstanding[rid] = server.url
            t0 = time.perf_counter()
            try:
                async with self._ask(
                    "POST", server.url, "/generate", self.timeout, json=body
                ) as resp:
                    if resp.status != 200:  # (a 5xx Retryable; a 3xx or a 4xx RolloutError)
                        raise await read_failure(resp, server.url)
                    data = await read_generate(resp, server.url, body, self.layers, self.topk)
            except TimeoutError:
                await asyncio.gather(*(self._abort_rid(server.url, rid) for rid in rids))
                raise Retryable("timed out") from None
            except aiohttp.ClientError as e:
                raise Retryable(f"{type(e).__name__}: {e}") from None
            finally:
                for rid in rids:
                    self._outstanding.pop(rid, None)
            if not isinstance(body["rid"], list):
                return [data], time.perf_counter() - t0
            batch = data.get("data")
            if not isinstance(batch, list) or len(batch) != len(rids):
                raise bad_answer(server.url, f"{snippet(data)}, not a list of {len(rids)} results")
            return batch, time.perf_counter() - t0

    def _fill(self, sample: Sample, data: object, url: str, latency: float, want_routed: bool):
        answer = read_answer(data, url, self.vocab_size, self._unknown_said)
        sample.tokens, sample.finish_reason = answer.tokens, answer.finish_reason
        sample.weight_version, sample.server, sample.latency_s = answer.weight_version, url, latency
        if answer.logprobs is not None:
            sample.logprobs = list(answer.logprobs)
        if answer.routed_experts is not None:
            rows = len(sample.prompt_ids) + len(sample.tokens) - 1
            sample.routed_experts = routed_experts(answer.routed_experts, rows, self.topk, url)
        elif want_routed and not (sample.aborted or sample.ended_unknown):  # (not trained on)
            raise RolloutError(
                f"{url} returned no routed_experts for {sample.rid}; start the server with "
                "--enable-return-routed-experts (SGLang drops the field silently without it)"
            )
        return sample

    # ---- control -------------------------------------------------------------------------

    async def abort(self) -> None:
        """Abort every outstanding request of this client; unsent ones are not sent."""
        self._epoch += 1
        await asyncio.gather(
            *(self._abort_rid(url, rid) for rid, url in list(self._outstanding.items()))
        )

    def outstanding(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._outstanding)

    async def _abort_rid(self, url: str, rid: str) -> None:
        try:
            await self.post(url, "/abort_request", {"rid": rid})
        except (RolloutError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("could not abort %s on %s: %s", rid, url, e)

    async def get(self, url: str, path: str, timeout: aiohttp.ClientTimeout | None = None) -> dict:
        async with self._ask("GET", url, path, timeout or self.timeout) as resp:
            refuse_redirect(resp, url, path)
            data = await read_json(resp, url)
            if resp.status != 200:
                raise RolloutError(f"GET {url}{path}: HTTP {resp.status}: {message(data)}")
            return data

    async def post(self, url: str, path: str, body: dict | None = None) -> dict:
        async with self._ask("POST", url, path, self.timeout, json=body or {}) as resp:
            refuse_redirect(resp, url, path)
            data = await read_json(resp, url)
            if resp.status != 200:
                raise RolloutError(f"POST {url}{path}: HTTP {resp.status}: {message(data)}")
            return data

    async def busy_seconds(self) -> float | None:
        """The seconds the servers' engines have worked, summed (the built-in's `engine_busy_s`);
        None when one does not answer in 5 s, or does not say (SGLang: then never asked again)."""
        if self._busy_unsaid:
            return None
        try:
            asks = (self.get(u, "/get_server_info", _QUICK) for u in self.urls)
            infos = await asyncio.gather(*asks)
            return sum(engine_busy_s(info) for info in infos)
        except (LookupError, TypeError, ValueError, RolloutError):
            self._busy_unsaid = True
        except (TimeoutError, aiohttp.ClientError):
            pass
        return None

    async def broadcast(self, path: str, body: dict | None = None) -> list[dict]:
        """POST the same body to every server; raises if any refuses."""
        return list(await asyncio.gather(*(self.post(u, path, body) for u in self.urls)))

    async def _health(self, url: str, total_s: float) -> tuple[int | None, str]:
        """(HTTP status of `url`/health, or None when no answer came; what went wrong)."""
        probe = aiohttp.ClientTimeout(total=total_s, sock_connect=self.timeout.sock_connect)
        try:
            async with self._ask("GET", url, "/health", probe) as resp:
                return resp.status, redirect_line(resp, "/health") or f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            return None, f"{type(e).__name__}: {e}".rstrip(": ")

    async def wait_healthy(self, timeout_s: float = 120.0, refused_s: float | None = None) -> None:
        """Wait until every server answers /health with 200, at most `timeout_s` in all. A server
        that answers (healthy or not yet) is waited for; with `refused_s`, one that no request
        reaches for that long (nothing listening, no such host) is an error at once. On an error
        the session is closed, so a caller that stops there leaves no connection open."""
        deadline = time.monotonic() + timeout_s
        try:
            for url in self.urls:
                await self._wait_one(url, deadline, timeout_s, refused_s)
        except BaseException:
            await self.close()
            raise

    async def _wait_one(
        self, url: str, deadline: float, timeout_s: float, refused_s: float | None
    ) -> None:
        since, answered = time.monotonic(), False
        while True:
            status, error = await self._health(url, total_s=10.0)
            if status == 200:
                return
            answered = answered or status is not None
            now = time.monotonic()
            if refused_s is not None and not answered and now - since > refused_s:
                raise RolloutError(
                    f"nothing answers at {url} ({error}) after {refused_s:.0f} s; "
                    "is a rollout server running there?"
                )
            if now > deadline:
                raise RolloutError(
                    f"{url} did not become healthy in {timeout_s:.0f} s (last: {error})"
                )
            await asyncio.sleep(0.2)

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        body = {"model_path": model_path, "weight_version": weight_version}
        await self.broadcast("/update_weights_from_disk", body)

    async def update_weight_version(self, version: str) -> None:
        await self.broadcast("/update_weight_version", {"new_version": version})

    async def pause(self, mode: str = "in_place") -> None:
        await self.broadcast("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.broadcast("/continue_generation", {})
