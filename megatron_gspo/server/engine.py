"""The scheduler of the built-in rollout server: continuous batching over a `RolloutModel`.

One engine thread owns the model, the KV cache and every running request. Other threads talk to
it only through `submit`, `abort`, `pause`, `resume` and `call`, which post messages to an inbox;
so no lock guards the request state. Each loop iteration: read the inbox, finish aborted requests,
run commands (weight updates) that are due, admit waiting requests into free cache slots, and run
one forward over every running request (prefills and decode steps in one batch). Requests that
prefill the same prompt in one step (the n samples of a prompt) share one prefill, whose cached
k/v rows and logits are copied to the others, as SGLang's prefix cache shares them.

A command marked `needs_idle` (a weight update while generation is not paused) waits until the
running requests finish and holds new ones back meanwhile, so no request sees two weight versions,
as SGLang's model-update lock does. While paused (`/pause_generation`) commands run at once.

Failures stay with the request that caused them: one that cannot be admitted or sampled (or whose
log-prob comes out NaN) finishes with `error` set and the thread keeps serving. Should the thread
still end (a bug, a BaseException), `alive` turns False (the server's /health answers 503) and
every pending and later request and command fails at once instead of waiting forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import torch

from megatron_gspo.server import kernels
from megatron_gspo.server.engine_sampling import SamplingSteps
from megatron_gspo.server.model import Chunk, RolloutModel
from megatron_gspo.server.request import Request

log = logging.getLogger(__name__)


@dataclass
class _Command:
    fn: Callable[[Engine], object]
    future: Future
    needs_idle: bool


class Engine(SamplingSteps):
    def __init__(
        self,
        model: RolloutModel,
        eos_ids: set[int],
        decode: Callable[[list[int]], str] | None = None,
        max_running: int = 64,
        max_prefill_tokens: int = 8192,
        record_routing: bool = False,
        seed: int = 0,
        weight_version: str = "default",
        decode_kernel: str = "auto",
    ):
        self.model = model
        kernels.attach(model, decode_kernel)  # builds the C decode step once per machine
        self.eos_ids = set(eos_ids)
        self.decode = decode
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.record_routing = record_routing
        self.weight_version = weight_version
        self.context_len = model.spec.max_position_embeddings
        self.cache = model.new_cache(min(max_running, 8), 64)
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.commands: deque[_Command] = deque()
        self.paused = False
        self.free_slots = list(range(max_running - 1, -1, -1))
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._dead: str | None = None  # why the engine thread ended, once it has
        self.busy_s = 0.0  # CPU seconds the engine thread has worked (it sleeps while idle)
        self._thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)

    # ---- API for other threads -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort every request and end the thread; a stuck thread is left behind (daemon)."""
        self._post(("stop",))
        self._thread.join(timeout=timeout_s)

    def submit(self, *reqs: Request) -> None:
        """Queue `reqs` together. When one of their ids (rid or group) is one that a queued or
        running request holds, all of them are refused (`req.refused` says why): an abort by
        that id would reach both. Checked on the engine thread, in order with the aborts: a
        client that aborts a rid and sends it again is not refused."""
        self._post(("submit", reqs))

    def abort(self, rid: str | None = None, message: str = "Abort request") -> None:
        """Abort one request by rid, or all (rid None); they finish with partial output."""
        self._post(("abort", rid, message))

    def pause(self, mode: str = "abort") -> None:
        self._post(("pause", mode))

    def resume(self) -> None:
        self._post(("resume",))

    def call(self, fn: Callable[[Engine], object], needs_idle: bool = False) -> Future:
        """Run fn(engine) on the engine thread between steps; the Future holds its result."""
        fut: Future = Future()
        self._post(("call", _Command(fn, fut, needs_idle)))
        return fut

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def alive(self) -> bool:
        """Whether the engine thread is serving (False before start and after it ended)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def death(self) -> str | None:
        """Why the engine thread ended, once it has."""
        return self._dead

    def _post(self, msg: tuple) -> None:
        with self._wake:
            if self._dead is None:
                self._inbox.append(msg)
                self._wake.notify()
                return
        self._refuse(msg)

    def _refuse(self, msg: tuple) -> None:
        """Answer a message the engine thread will never read: fail it at once."""
        why = f"the generation engine is not running ({self._dead})"
        if msg[0] == "submit":
            for req in msg[1]:
                req.error = why
                self._finish(req, {"type": "abort", "message": why})
        elif msg[0] == "call":
            msg[1].future.set_exception(RuntimeError(why))

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        why = "stopped"
        try:
            self._loop()
        except BaseException as e:
            why = f"failed: {type(e).__name__}: {e}"
            log.critical("the engine thread ended: %s", why, exc_info=True)
        finally:
            with self._wake:
                self._dead = why
                inbox, self._inbox = self._inbox, deque()
            for req in [*self.running, *self.waiting]:
                self._fail(req, f"the generation engine {why}")
            while self.commands:
                self._refuse(("call", self.commands.popleft()))
            for msg in inbox:
                self._refuse(msg)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not self._inbox and not self._has_work():
                    self._wake.wait()
                inbox, self._inbox = self._inbox, deque()
            t0 = time.thread_time()  # (CPU time: a pass the OS preempts does not work meanwhile)
            try:
                if self._iterate(inbox):
                    return
            except Exception as e:  # a bug: fail what was running, keep serving the rest
                log.exception("engine step failed")
                with self._wake:  # messages not read yet are read next time
                    self._inbox.extendleft(reversed(inbox))
                for req in list(self.running):
                    self._fail(req, f"engine step failed: {type(e).__name__}: {e}")
            finally:
                self.busy_s += time.thread_time() - t0

    def _iterate(self, inbox: deque) -> bool:
        """One pass of the loop; True when told to stop."""
        while inbox:
            msg = inbox.popleft()
            if msg[0] == "stop":
                self._abort_all("Server shutting down")
                return True
            self._handle(msg)
        self._run_commands()
        if self.paused:
            return False
        self._admit()
        if self.running:
            self._step()
        return False

    def _has_work(self) -> bool:
        if self.commands and (self.paused or not self.commands[0].needs_idle or not self.running):
            return True
        return not self.paused and bool(self.running or (self.waiting and not self._holding()))

    def _holding(self) -> bool:
        return any(c.needs_idle for c in self.commands) and not self.paused

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            self._queue(msg[1])
        elif kind == "abort":
            self._abort(msg[1], msg[2])
        elif kind == "pause":
            self.paused = True
            if msg[1] == "abort":
                self._abort_all("Abort by pause_generation")
        elif kind == "resume":
            self.paused = False
        elif kind == "call":
            self.commands.append(msg[1])

    def _queue(self, reqs: tuple[Request, ...]) -> None:
        held = {i for r in [*self.running, *self.waiting] for i in (r.rid, r.group)}
        taken = sorted(held.intersection(i for r in reqs for i in (r.rid, r.group)) - {""})
        if not taken:
            self.waiting.extend(reqs)
            return
        why = f"rid {', '.join(map(repr, taken[:5]))} is in use by a request not finished yet"
        for req in reqs:
            req.refused = why
            self._finish(req, {"type": "abort", "message": why})

    def _abort(self, rid: str | None, message: str) -> None:
        for req in [*self.running, *self.waiting]:
            if rid is None or rid in (req.rid, req.group):
                self._finish(req, {"type": "abort", "message": message})

    def _abort_all(self, message: str) -> None:
        self._abort(None, message)

    def _run_commands(self) -> None:
        while self.commands:
            cmd = self.commands[0]
            if cmd.needs_idle and self.running and not self.paused:
                return
            self.commands.popleft()
            try:
                cmd.future.set_result(cmd.fn(self))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)

    def _admit(self) -> None:
        if self._holding():
            return
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if budget < len(req.input_ids) and budget != self.max_prefill_tokens:
                break
            self.waiting.popleft()
            try:
                self._prepare(req)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(req, f"could not start the request: {type(e).__name__}: {e}")
                continue
            budget -= len(req.input_ids)
            req.slot = self.free_slots.pop()
            self.running.append(req)

    def _prepare(self, req: Request) -> None:
        sp = req.params
        if sp.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(sp.sampling_seed)
        req.stop_ids = frozenset(sp.stop_token_ids) | (
            frozenset() if sp.ignore_eos else frozenset(self.eos_ids)
        )
        req.limit = min(sp.max_new_tokens, self.context_len - len(req.input_ids))
        req.adjusted = sp.penalised or bool(sp.logit_bias)

    def _chunk(self, req: Request) -> Chunk:
        assert req.slot is not None  # a running request holds a slot
        if req.fed == 0:
            first = -1
            if req.return_logprob and 0 <= req.logprob_start_len < len(req.input_ids):
                first = max(req.logprob_start_len - 1, 0)
            return Chunk(req.slot, 0, list(req.input_ids), logits_from=first)
        return Chunk(req.slot, req.fed, [req.output_ids[-1]])

    def _step(self) -> None:
        # cache rows in order: a view (running requests hold a slot)
        batch = sorted(self.running, key=lambda r: cast(int, r.slot))
        chunks = [self._chunk(r) for r in batch]
        src = _shared_prefills(chunks)
        run = [i for i, j in enumerate(src) if i == j]
        try:
            out = self.model.forward(
                [chunks[i] for i in run], self.cache, record_routing=self.record_routing
            )
            if len(run) < len(chunks):
                self._copy_shared(chunks, src)
        except Exception as e:  # a bug or an out-of-memory: fail these requests, keep serving
            log.exception("forward failed")
            for req in batch:
                req.error = f"forward failed: {type(e).__name__}: {e}"
                self._finish(req, {"type": "abort", "message": req.error})
            return
        at = {i: k for k, i in enumerate(run)}  # batch index -> index in the forward's output
        for i, (req, chunk) in enumerate(zip(batch, chunks)):
            req.fed += len(chunk.tokens)
            k = at[src[i]]
            if out.routed is not None and req.return_routed:
                req.routed.append(out.routed[k])
            if chunk.start == 0 and chunk.logits_from >= 0:
                try:
                    self._input_logprobs(req, out.logits[k])
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._fail(req, f"prompt log-probs failed: {type(e).__name__}: {e}")
        last_BV = out.last_BV
        if len(run) < len(chunks):
            last_BV = last_BV[[at[j] for j in src]]
        keep = [i for i, req in enumerate(batch) if req.error is None]
        if len(keep) < len(batch):
            batch, last_BV = [batch[i] for i in keep], last_BV[keep]
        self._sample(batch, last_BV)

    def _copy_shared(self, chunks: list[Chunk], src: list[int]) -> None:
        """Give each request that shared another's prefill that request's cached k/v rows."""
        copies: dict[int, list[int]] = {}
        for i, j in enumerate(src):
            if i != j:
                copies.setdefault(j, []).append(i)
        for j, dups in copies.items():
            self.cache.copy_prefix(
                chunks[j].slot, [chunks[i].slot for i in dups], len(chunks[j].tokens)
            )

    def _input_logprobs(self, req: Request, logits_NV: torch.Tensor) -> None:
        start, first = req.logprob_start_len, max(req.logprob_start_len - 1, 0)
        sp = req.params
        scale = 1.0 if sp.greedy else sp.temperature
        logp = torch.log_softmax(logits_NV[:-1] / scale, -1)
        ids = req.input_ids
        targets = torch.tensor(ids[first + 1 :], dtype=torch.long)
        vals = logp.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        req.input_logprobs = ([None] if start == 0 else []) + vals

    def _fail(self, req: Request, message: str) -> None:
        """Finish a request the engine could not serve (the server answers 500)."""
        log.warning("request %s failed: %s", req.rid, message)
        req.error = message
        self._finish(req, {"type": "abort", "message": message})

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.finished = time.perf_counter()
        req.weight_version = self.weight_version
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None
        if req.on_done is not None:
            try:
                req.on_done(req)
            except Exception:  # noqa: BLE001 - a closed event loop must not stop the engine
                log.exception("on_done callback failed for %s", req.rid)

    def routed_experts(self, req: Request, start: int = 0) -> torch.Tensor | None:
        """[prompt + output - 1 - start, L, k] int32 for a finished request (None if not kept)."""
        if not req.routed:
            return None
        fed = len(req.input_ids) + len(req.output_ids) - 1
        return torch.cat(req.routed)[:fed][start:]


def _shared_prefills(chunks: list[Chunk]) -> list[int]:
    """For each chunk, the index of the chunk whose forward serves it: itself, or the first
    chunk prefilling the same prompt (the n samples of one prompt, as SGLang's prefix cache
    shares them), whose k/v rows and logits it then copies."""
    first: dict[tuple | int, int] = {}
    src = []
    for i, c in enumerate(chunks):
        key = (tuple(c.tokens), c.logits_from) if c.start == 0 and len(c.tokens) > 1 else i
        src.append(first.setdefault(key, i))
    return src
