"""The one place that calls the user's code: a pool of worker processes, each call bounded.

    pool = Pool("megatron_gspo.rewards.scoring:worker_reward", "my_rewards.py:judge",
                workers=8, timeout_s=60, limit="reward.timeout_s")
    outcome = pool.submit(prompt, response, answer).result()   # an Outcome, never an exception

Each worker is a fresh interpreter (`python -m megatron_gspo.bounded.worker`: not a fork of the
trainer, whose threads, CUDA context and sockets it must not inherit), in a process group of its
own (a Ctrl-C at the terminal reaches the trainer alone, which then stops the workers). It
imports the user's code once and lives across steps. A call that passes the time limit, or whose
worker dies under it (exit, signal, out of memory), gets that as its Outcome; the worker's whole
process group is killed and a new worker started for the next call. Only that call fails (and,
for calls pinned to a worker's state, the calls of that state: `Kind.LOST`).

Code that does not load at the start (it raises, or passes the start limit) fails every call at
once. Once a worker has loaded it, a start that fails (a file missing for a moment, a flaky
import) fails the call that waited for it alone; a later call starts that worker again, after a
backoff (RESTART_BACKOFF_S: 1 s, doubled after each failed start in a row, up to 60 s) in which
it takes no call another worker can run and fails at once those only it can run.

Calls go to whichever worker is free, or to one worker (`worker=`: state that lives there, an
environment's episode), and then only to the worker as it was started (`incarnation=`). Each
worker has a thread here that sends it one call at a time and waits for the answer with the
time limit; the time limit starts when the call is sent, not while it waits in the queue.
Arguments go to the worker pickled (the trainer's own data); answers come back as JSON
(worker.py), so nothing the user's code returns is unpickled here.

`close()` kills every worker and fails what is still queued; the threads are daemons and the
workers die with the trainer (worker.py), so nothing here keeps a process alive.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from megatron_gspo.bounded.outcome import Kind, Outcome, from_answer
from megatron_gspo.bounded.wire import MAX_FRAME, FrameError, read_frame, write_frame

WORKER = "megatron_gspo.bounded.worker"
_MIN_FRAME = 1 << 20  # bytes a worker may always answer with: a refusal, a traceback
RESTART_BACKOFF_S = (1.0, 60.0)  # a failed start's wait before the next (first, doubled up to)


def default_workers() -> int:
    """16, or one per core where there are more (at most 64): a call that waits (a remote
    judge, a sandbox) keeps 16 going even on a small machine (64 calls of 0.05 s then wait 0.2 s,
    not 3.2 s; a worker is ~15 MB), one that computes gets the machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(64, max(16, cores or 1))


@dataclass
class _Job:
    args: tuple
    future: Future
    worker: int | None = None  # pinned to this worker
    incarnation: int | None = None  # ... as it was started then (None: as it is)


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen | None = None
    req: int = -1  # the pipe the worker reads calls from
    resp: int = -1  # the pipe it answers on
    incarnation: int = 0  # how many times it has been started
    queue: deque = field(default_factory=deque)  # calls pinned to it
    thread: threading.Thread | None = None
    started: threading.Event = field(default_factory=threading.Event)  # its first start is over
    start_error: str | None = None  # why its first start failed
    failed_starts: int = 0  # its starts that failed in a row
    retry_at: float = 0.0  # no start before this (time.monotonic()): the last one failed
    last_failure: str = ""  # why the last start failed


class Pool:
    """Worker processes that run `loader(spec)`'s handler, one call at a time each."""

    def __init__(  # noqa: PLR0913 - the loader and its spec, then keyword-only options
        self, loader: str, spec: Any, *, workers: int, timeout_s: float, limit: str,
        start_timeout_s: float = 120.0, start_limit: str = "start_timeout_s",
        name: str = "bounded", max_answer: int = MAX_FRAME,
        restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S,
    ):  # fmt: skip
        """`loader`: "module:function" returning the handler (worker.py); `limit`: the config
        key of `timeout_s`, named in the outcome of a call that passes it; `start_timeout_s`:
        how long a worker may take to start (its imports: a judge model loaded there may take
        minutes), not counted in any call's limit, its config key `start_limit`; `max_answer`:
        the most bytes of one answer (a longer one is refused by its worker);
        `restart_backoff_s`: (first, most) seconds a worker whose start failed waits before the
        next (backoff_s)."""
        self.loader, self.spec, self.limit, self.max_answer = loader, spec, limit, max_answer
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.start_limit, self.restart_backoff_s = start_limit, restart_backoff_s
        # the user's code failed to load (it raised, or took longer than start_timeout_s)
        # before any worker had loaded it: every call fails so, at once, rather than wait for
        # a start of its own
        self.broken: str | None = None
        self.raised_at_load = False  # ... because it raised (`broken` is load_plugin's line)
        self.loaded_once = False  # a worker has loaded the user's code
        self._cv = threading.Condition()
        self._shared: deque[_Job] = deque()
        self._closed = False
        self._slots = [_Slot(i) for i in range(max(1, workers))]
        weakref.finalize(self, _kill_all, self._slots)  # (also at exit, without close())
        for slot in self._slots:
            slot.thread = threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                           name=f"{name}-{slot.index}")  # fmt: skip
            slot.thread.start()

    @property
    def workers(self) -> int:
        return len(self._slots)

    def pids(self) -> list[int]:
        """The worker processes alive now."""
        return [p.pid for s in self._slots if (p := s.proc) is not None and p.poll() is None]

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every worker has made its first start (whether it succeeded or not)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for slot in self._slots:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not slot.started.wait(left):
                return False
        return True

    def usable(self) -> list[int]:
        """The workers that may run a call now: all but those waiting out a failed start."""
        now = time.monotonic()
        with self._cv:
            return [s.index for s in self._slots if s.retry_at <= now]

    def start_error(self) -> str | None:
        """Why the first worker could not start (the user's code did not load: it raised,
        exited, hung past start_timeout_s), None once it has; waits for that start. The check at
        start that the user's code loads, made in a worker: nothing it does when imported reaches
        the trainer."""
        slot = self._slots[0]
        slot.started.wait()
        return self.broken or slot.start_error

    def submit(self, *args: Any, worker: int | None = None,
               incarnation: int | None = None) -> Future:  # fmt: skip
        """Future of the Outcome of handler(*args) (it never raises)."""
        future: Future = Future()
        with self._cv:
            if self._closed or self.broken:
                kind = Kind.CLOSED if self._closed else Kind.START
                future.set_result(Outcome(kind, message=self.broken or "the pool is closed"))
                return future
            job = _Job(args, future, worker, incarnation)
            (self._shared if worker is None else self._slots[worker].queue).append(job)
            self._cv.notify_all()
        return future

    def close(self) -> None:
        """Kill every worker; calls still queued or running end as CLOSED."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._shared) + [j for s in self._slots for j in s.queue]
            self._shared.clear()
            for s in self._slots:
                s.queue.clear()
            self._cv.notify_all()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(Outcome(Kind.CLOSED, message="the pool is closed"))
        _kill_all(self._slots)
        for s in self._slots:
            if s.thread is not None and s.thread is not threading.current_thread():
                s.thread.join(timeout=5)

    # ---- a worker's thread -------------------------------------------------------------------

    def _serve(self, slot: _Slot) -> None:
        try:
            why = self._guarded(self._start, slot)  # ready before the first call (else retried)
            slot.start_error = why.message if isinstance(why, Outcome) else why
            slot.started.set()
            while (job := self._take(slot)) is not None:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_result(self._guarded(self._run, slot, job))
        finally:
            slot.started.set()
            self._stop(slot)

    def _guarded(self, fn, slot: _Slot, *args) -> Any:
        """fn(slot, *args), or an Outcome saying what failed here (out of file descriptors,
        processes): this thread must go on, and every call get its outcome."""
        try:
            return fn(slot, *args)
        except Exception as e:
            self._stop(slot)
            return Outcome(Kind.START, message=f"no worker could run it ({type(e).__name__}: {e})")

    def _take(self, slot: _Slot) -> _Job | None:
        """The slot's next call: one pinned to it, else a shared one, but not while it waits
        out a failed start and another worker may run it (failing each at once, it would take
        most of them)."""
        with self._cv:
            while not self._closed:
                if slot.queue:
                    return slot.queue.popleft()
                now = time.monotonic()
                if self._shared and (slot.retry_at <= now or
                                     all(s.retry_at > now for s in self._slots)):  # fmt: skip
                    return self._shared.popleft()
                self._cv.wait(slot.retry_at - now if slot.retry_at > now else None)
            return None

    def _run(self, slot: _Slot, job: _Job) -> Outcome:
        alive = slot.proc is not None and slot.proc.poll() is None
        if self.broken:
            return Outcome(Kind.START, message=self.broken)
        if job.incarnation is not None and (job.incarnation != slot.incarnation or not alive):
            return self._mark(Outcome(Kind.LOST, message="its worker was replaced"), slot)
        if not alive:
            self._stop(slot)
            why = self._restart(slot)
            if why is not None:
                return Outcome(Kind.START, message=why)
        try:
            request = pickle.dumps(job.args)
        except Exception as e:  # (the trainer's own data: a field that does not pickle)
            return Outcome(Kind.RAISED, message=f"its arguments could not be sent: {e}")
        return self._mark(self._exchange(slot, request), slot)

    def _exchange(self, slot: _Slot, request: bytes) -> Outcome:
        """Send one call and wait for its answer, within the time limit."""
        try:
            write_frame(slot.req, request)
            deadline = time.monotonic() + self.timeout_s
            frame = read_frame(slot.resp, deadline, max(self.max_answer, _MIN_FRAME))
        except TimeoutError:
            self._stop(slot)
            return Outcome(Kind.TIMEOUT, message=f"ran past {self.limit} ({self.timeout_s:g} s)")
        except (OSError, FrameError):
            frame = None
        if frame is None:
            code = self._stop(slot, grace_s=1.0)
            if self._closed:
                return Outcome(Kind.CLOSED, message="the pool is closed")
            return Outcome(Kind.DIED, message=_how(code))
        outcome = from_answer(frame)
        if outcome is None:  # not our worker's answer: the pipe cannot be trusted any more
            self._stop(slot)
            return Outcome(Kind.REFUSED, message="its worker answered something unreadable")
        return outcome

    def _mark(self, outcome: Outcome, slot: _Slot) -> Outcome:
        outcome.worker, outcome.incarnation = slot.index, slot.incarnation
        return outcome

    def _restart(self, slot: _Slot) -> str | None:
        """A new worker for the slot (_start), unless its last start failed less than its
        backoff ago: then why not, at once."""
        left = slot.retry_at - time.monotonic()
        if left > 0:
            return f"{slot.last_failure} (its next start is in {left:.1f} s)"
        return self._start(slot)

    def _start(self, slot: _Slot) -> str | None:
        """Start the slot's worker (_launch); why not, else None. A failed start holds the next
        one back (backoff_s; none after a start that succeeded)."""
        why = self._launch(slot)
        with self._cv:
            slot.failed_starts = 0 if why is None else slot.failed_starts + 1
            wait = backoff_s(slot.failed_starts, *self.restart_backoff_s)
            slot.retry_at, slot.last_failure = time.monotonic() + wait, why or ""
            self._cv.notify_all()  # (the other slots: is every worker waiting now?)
        return why

    def _launch(self, slot: _Slot) -> str | None:
        """Start the slot's worker and wait until it has loaded the user's code; why not, else
        None. A load that fails (it raises, or passes start_timeout_s) before any worker has
        loaded the code breaks the pool: every call fails so; after, it fails its call only."""
        r_req, w_req = os.pipe()
        r_resp, w_resp = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER, str(r_req), str(w_resp), str(os.getpid())],
                pass_fds=(r_req, w_resp), stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            os.close(w_req)
            os.close(r_resp)
            return f"could not start a worker process ({e})"
        finally:
            os.close(r_req)
            os.close(w_resp)
        slot.proc, slot.req, slot.resp = proc, w_req, r_resp
        slot.incarnation += 1
        init = {"loader": self.loader, "spec": self.spec, "sys_path": list(sys.path),
                "max_answer": self.max_answer}  # fmt: skip
        try:
            write_frame(w_req, pickle.dumps(init))
            frame = read_frame(r_resp, time.monotonic() + self.start_timeout_s)
        except TimeoutError:
            self._stop(slot)
            why = (f"a worker did not start within {self.start_limit} ({self.start_timeout_s:g} "
                   "s); raise it if the code takes longer to load")  # fmt: skip
            if not self.loaded_once:
                self.broken = why
            return why
        except (OSError, FrameError):
            frame = None
        return self._ready(slot, frame)

    def _ready(self, slot: _Slot, frame: bytes | None) -> str | None:
        if frame is None:
            return f"a worker process ended while starting ({_how(self._stop(slot, 1.0))})"
        try:
            answer = json.loads(frame)
        except (ValueError, RecursionError):
            answer = None
        if isinstance(answer, dict) and answer.get("ready") is True:
            self.loaded_once = True
            return None
        self._stop(slot)
        why = answer.get("failed") if isinstance(answer, dict) else None
        if not isinstance(why, str):
            return "a worker answered something unreadable while starting"
        if self.loaded_once:  # (a restart, or another worker's first start)
            return f"a new worker could not load the code: {why}"
        self.broken, self.raised_at_load = why, True
        return why

    def _stop(self, slot: _Slot, grace_s: float = 0.0) -> int | None:
        """Kill the slot's worker and its process group; its exit code if it had ended by
        itself (within `grace_s`), None if it was killed here."""
        proc, slot.proc = slot.proc, None
        for fd in (slot.req, slot.resp):
            if fd >= 0:
                os.close(fd)
        slot.req = slot.resp = -1
        if proc is None:
            return None
        try:
            code = proc.wait(timeout=grace_s) if grace_s else proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        _kill_group(proc)
        proc.wait()
        return code


def backoff_s(failures: int, first: float, most: float) -> float:
    """Seconds before a worker is started again after `failures` failed starts in a row: none
    after none, then `first`, doubled after each, at most `most`."""
    return 0.0 if failures <= 0 else min(most, first * 2.0 ** min(failures - 1, 64))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker, and what the user's code started
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(slots: list[_Slot]) -> None:
    for slot in slots:
        proc = slot.proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)


def _how(code: int | None) -> str:
    if code is None:
        return "it stopped answering and was killed"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code}"
