"""Start, supervise and stop rollout servers: real SGLang or the built-in server.

    cfg = ServerConfig(model_path=HF_DIR)                    # built-in; kind="sglang" for SGLang
    with ServerGroup([cfg, cfg], log_dir=RUN / "servers") as servers:
        client = RolloutClient(servers.urls)
        ...
        servers.set_current_weights(model_path=NEW_HF_DIR, weight_version="7")

Each server is its own process group (start_new_session), tracked by PID, with its output in
`log_dir/server-{i}.log`. `start` waits for /health. A monitor thread restarts a server that died
(same port, so clients retrying after back-off find it again), waits for health, and brings it to
the current weights: /update_weights_from_disk of the last HF dir given to `set_current_weights`,
or the `on_restart(url)` callback (e.g. a tensor or distributed weight push). `stop` sends SIGTERM
to each server's process group (its PID), then SIGKILL after a grace period; it runs on leaving
the `with`, at interpreter exit (atexit) and on SIGTERM/SIGINT (not on a signal the process
ignores, as a background job of a script ignores SIGINT: the run goes on, so must its servers).
Nothing is ever killed by name.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.comm import free_port
from megatron_gspo.errors import UserError
from megatron_gspo.no_redirect import OPENER, is_redirect, redirect_refusal
from megatron_gspo.rollout.answers import (
    CONTROL_LIMIT,
    FAILURE_LIMIT,
    control_failure,
    control_object,
    control_too_long,
)
from megatron_gspo.rollout.failures import ServerFailed, failure_cause
from megatron_gspo.rollout.server_config import ServerConfig, copy_redacted, redacted

__all__ = ["ServerConfig", "ServerFailed", "ServerGroup", "failure_cause", "free_port", "stop_all"]

log = logging.getLogger(__name__)


@dataclass
class ManagedServer:
    index: int
    config: ServerConfig
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False  # healthy, and brought to the current weights, since its last start
    restarting: bool = False  # the monitor is starting it again
    copier: threading.Thread | None = None  # its output into the log, the API key left out
    log_from: int = 0  # where in its log the output of its latest start begins

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        if self.copier is not None and not self.alive():
            self.copier.join(timeout=5)  # (the last lines of a process that exited)
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start_log(self) -> str:
        """What its latest start has written to its log so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


PORT_TRIES = 3  # starts on a new free port when the one picked was taken before the bind
_PORT_TAKEN = re.compile(r"already in use|port \d+ is already used", re.I)


def port_taken(log_tail: str) -> bool:
    """Whether a server's log says it could not bind its port (Errno 98, or SGLang's check)."""
    return _PORT_TAKEN.search(log_tail) is not None


_LIVE: set[ServerGroup] = set()  # groups to stop at exit or on a signal


class ServerGroup:
    def __init__(
        self,
        configs: list[ServerConfig],
        log_dir: str | os.PathLike,
        *,
        health_timeout_s: float = 300.0,
        stop_timeout_s: float = 15.0,
        poll_s: float = 0.5,
        max_restarts: int = 5,
        on_restart: Callable[[str], None] | None = None,
        monitor: bool = True,
    ):
        if not configs:
            raise ValueError("ServerGroup needs at least one ServerConfig")
        self.log_dir = Path(log_dir)
        self.health_timeout_s, self.stop_timeout_s = health_timeout_s, stop_timeout_s
        self.poll_s, self.max_restarts = poll_s, max_restarts
        self.on_restart = on_restart
        self.current: dict | None = None  # {model_path, weight_version} for restarted servers
        self.servers = [
            ManagedServer(i, c, c.port or free_port(), self.log_dir / f"server-{i}.log")
            for i, c in enumerate(configs)
        ]
        self._monitor = monitor
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ServerGroup:
        """Start every server, wait until all answer /health, then start the monitor. Once:
        a second start would leave the first servers running unsupervised."""
        if any(s.proc is not None for s in self.servers):
            raise RuntimeError("this ServerGroup was started already (`with` starts it)")
        for s in self.servers:  # before any server starts: none is left half-started
            _check_log(s.log_path)
        _LIVE.add(self)
        _install_exit_handlers()
        try:
            for s in self.servers:
                self._spawn(s)
            for s in self.servers:
                self._wait_healthy_on_a_free_port(s)
                s.ready = True
        except BaseException:
            self.stop()
            raise
        if self._monitor:
            self._thread = threading.Thread(target=self._watch, name="rollout-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop every server by its PID (its process group): SIGTERM, then SIGKILL."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.health_timeout_s)
        with self._lock:
            procs = [s.proc for s in self.servers if s.proc is not None]
            for p in procs:
                _signal_group(p, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for p in procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    log.warning("server pid %d ignored SIGTERM; sending SIGKILL", p.pid)
                    _signal_group(p, signal.SIGKILL)
                    p.wait(timeout=10)
                _signal_group(p, signal.SIGKILL)  # children it left behind in its group
        _LIVE.discard(self)

    def set_current_weights(
        self, model_path: str | None = None, weight_version: str | None = None
    ) -> None:
        """What a restarted server is brought to (the trainer calls this after each sync)."""
        self.current = {"model_path": model_path, "weight_version": weight_version}

    # ---- processes -----------------------------------------------------------------------

    def _spawn(self, s: ManagedServer) -> None:
        s.ready = False
        cmd = s.config.command(s.port)
        secret = s.config.api_key  # (its output is piped through a copy that leaves it out)
        with open(s.log_path, "ab") as f:
            s.log_from = f.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            f.write(
                f"\n==== {stamp} start #{s.restarts}: {' '.join(redacted(cmd, secret))}\n".encode()
            )
            f.flush()
            s.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE if secret else f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=s.config.environment(), start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        s.copier = None
        if secret:
            copy = (s.proc.stdout, s.log_path, secret)
            s.copier = threading.Thread(target=copy_redacted, args=copy, daemon=True)
            s.copier.start()
        log.info("started %s server %d (pid %d) on %s", s.config.kind, s.index, s.pid, s.url)

    def _wait_healthy(self, s: ManagedServer) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if not s.alive():
                assert s.proc is not None  # _spawn ran before
                raise ServerFailed(
                    f"server {s.index} ({s.config.kind}, pid {s.pid}) exited with code "
                    f"{s.proc.returncode} while starting", s.log_path, s.log_tail(60)
                )  # fmt: skip
            if port_taken(s.start_log()):
                # it could not bind its port and may not exit (SGLang's warmup then polls the
                # port's holder for minutes before it gives up): end it now
                assert s.proc is not None
                _signal_group(s.proc, signal.SIGKILL)
                s.proc.wait()
                fix = "; free it or name another port" if s.config.port else ""
                raise ServerFailed(
                    f"server {s.index} ({s.config.kind}) could not bind port {s.port}: another "
                    f"process holds it{fix}", s.log_path, s.log_tail(60)
                )  # fmt: skip
            if self._stopping.is_set():
                return
            if _health(s, refuse_redirect=True) == 200:
                return
            time.sleep(0.2)
        raise ServerFailed(
            f"server {s.index} ({s.config.kind}, pid {s.pid}) was not healthy after "
            f"{self.health_timeout_s:.0f} s", s.log_path, s.log_tail(60)
        )  # fmt: skip

    def _wait_healthy_on_a_free_port(self, s: ManagedServer) -> None:
        """Wait for health; a server whose port was picked here (not `ServerConfig.port`) and
        was taken before it bound (another process got the same free port) starts again on
        another, at most `PORT_TRIES` times."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                return self._wait_healthy(s)
            except ServerFailed:
                if s.config.port or attempt == PORT_TRIES or not port_taken(s.start_log()):
                    raise
                taken, s.port = s.port, free_port()
                log.warning("server %d: port %d was taken; starting on %d", s.index, taken, s.port)
                self._spawn(s)

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for s in self.servers:
                if self._stopping.is_set():
                    continue
                if s.alive() and s.ready and _engine_dead(s):
                    # the process is up but says its engine is gone (/health 503): end it, so
                    # it is restarted like a server that died
                    log.warning("server %d (pid %s): its engine died; killing it", s.index, s.pid)
                    assert s.proc is not None  # alive()
                    _signal_group(s.proc, signal.SIGKILL)
                    s.proc.wait()
                if s.alive():
                    continue
                try:
                    self.restart(s)
                except ServerFailed as e:  # (one line: what failed, the cause its log gives)
                    log.error("could not restart server %d: %s", s.index, e.summary())
                except Exception:  # noqa: BLE001 - keep watching the others
                    log.exception("could not restart server %d", s.index)

    def restart(self, s: ManagedServer) -> None:
        """Start a dead server again on its port and bring it to the current weights."""
        with self._lock:
            if self._stopping.is_set() or s.alive():
                return
            if s.restarts >= self.max_restarts:
                return  # given up on: logged once below
            code = s.proc.returncode if s.proc else None
            log.warning("server %d (pid %s) exited with %s; restarting", s.index, s.pid, code)
            if s.proc is not None:
                _signal_group(s.proc, signal.SIGKILL)  # what it left behind
            s.restarts += 1
            if s.restarts == self.max_restarts:
                log.error("server %d restarted %d times; this is the last", s.index, s.restarts)
            s.restarting = True
            self._spawn(s)
        try:
            self._wait_healthy(s)
            self._bring_to_current(s)
            s.ready = True
        except BaseException:
            assert s.proc is not None  # _spawn ran above
            _signal_group(s.proc, signal.SIGKILL)  # dead again: the monitor tries once more
            raise
        finally:
            s.restarting = False

    def ready(self) -> list[int]:
        """Indices of the servers that are up and on the current weights (not restarting)."""
        return [s.index for s in self.servers if s.ready and s.alive() and not s.restarting]

    def wait_restarts(self, timeout_s: float | None = None) -> list[int]:
        """Wait, at most `timeout_s` (default: the health timeout), until no server is being
        restarted by the monitor: each is up and ready, or given up on. Returns the indices of
        those that are not ready."""
        timeout_s = self.health_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s

        while self._thread is not None and not self._stopping.is_set():
            if not self.restarting() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        up = set(self.ready())
        return [s.index for s in self.servers if s.index not in up]

    def restarting(self) -> list[int]:
        """Indices of the servers the monitor is restarting, or will (dead, restarts left)."""
        if self._thread is None or self._stopping.is_set():
            return []
        return [
            s.index for s in self.servers
            if s.restarting or (not s.alive() and s.restarts < self.max_restarts)
        ]  # fmt: skip

    def recovering(
        self, indices: list[int], since: list[int] | None = None, settle_s: float = 15.0
    ) -> bool:
        """Whether each of `indices` is being restarted, or was since `since` (restart counts
        then): servers that failed a request because they died. A process still exiting (its
        sockets closed, its threads and memory not yet torn down: SGLang takes a while) is
        waited for, up to `settle_s`; one that is up and answers /health is not dying."""
        deadline = time.monotonic() + settle_s
        pending = set(indices)
        while True:
            coming = set(self.restarting())
            pending = {
                i for i in pending
                if i not in coming and not (since is not None and self.servers[i].restarts > since[i])
            }  # fmt: skip
            if not pending:
                return True
            if time.monotonic() > deadline:
                return False
            if any(self.servers[i].alive() and _health(self.servers[i]) == 200 for i in pending):
                return False
            time.sleep(0.2)

    def _bring_to_current(self, s: ManagedServer) -> None:
        cur = self.current or {}
        if cur.get("model_path"):
            body = {"model_path": cur["model_path"], "weight_version": cur.get("weight_version")}
            _post(s, "/update_weights_from_disk", body)
        elif cur.get("weight_version"):
            _post(s, "/update_weight_version", {"new_version": cur["weight_version"]})
        if self.on_restart is not None:
            self.on_restart(s.url)


def _engine_dead(s: ManagedServer) -> bool:
    """True when the server answers /health with 503: alive, but its engine thread is gone
    (the built-in server says so). A slow or refused answer is not taken as death."""
    return _health(s) == 503


def _health(s: ManagedServer, refuse_redirect: bool = False) -> int | None:
    """The HTTP status of the server's /health, or None when it does not answer in 5 s. A
    redirect is not followed (it would take the API key elsewhere): with `refuse_redirect` it
    raises ServerFailed naming where it pointed, else its status is one more that is not 200."""
    headers = {"Authorization": f"Bearer {s.config.api_key}"} if s.config.api_key else {}
    try:
        req = urllib.request.Request(s.url + "/health", headers=headers)
        with OPENER.open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        if refuse_redirect and is_redirect(e):
            raise _failed(s, redirect_refusal("/health", e)) from None
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _post(s: ManagedServer, path: str, body: dict) -> dict:
    """`path`'s JSON object, read up to CONTROL_LIMIT bytes; a ServerFailed in one line past
    it, for an answer that is not one, or for a failure (its message)."""
    headers = {"Content-Type": "application/json"}
    if s.config.api_key:
        headers["Authorization"] = f"Bearer {s.config.api_key}"
    req = urllib.request.Request(s.url + path, json.dumps(body).encode(), headers)
    try:
        with OPENER.open(req, timeout=600) as r:
            raw = r.read(CONTROL_LIMIT + 1)
    except urllib.error.HTTPError as e:
        if is_redirect(e):
            raise _failed(s, redirect_refusal(path, e)) from None
        raise _failed(s, control_failure(path, e.code, e.read(FAILURE_LIMIT))) from None
    if len(raw) > CONTROL_LIMIT:
        raise _failed(s, control_too_long(path))
    answer = control_object(raw)
    if isinstance(answer, str):  # (a proxy's page: its start, in one line)
        raise _failed(s, f"{path} answered {answer}")
    return answer


def _failed(s: ManagedServer, what: str) -> ServerFailed:
    """A request to `s` that failed as `what` says (one line, naming it and the path)."""
    return ServerFailed(f"server {s.index} ({s.config.kind}, pid {s.pid}) at {s.url}: {what}")


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the trainer dies, so a trainer
    killed with SIGKILL (no atexit, no handler) leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _check_log(path: Path) -> None:
    """That the server's log can be appended to (made, where it is not there): one line naming
    it where it cannot (a read-only logs/, a log of another user)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise UserError(
            f"cannot write the server log {path} ({e.strerror}); make it and {path.parent} "
            "writable and start again"
        ) from None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group led by proc (started with start_new_session: pgid == pid)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- exit handlers -------------------------------------------------------------------------

_installed = False


def stop_all() -> None:
    for group in list(_LIVE):
        group.stop()


def _install_exit_handlers() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if previous == signal.SIG_IGN:  # (a background job's SIGINT): the run goes on, so do they
            continue
        signal.signal(sig, _make_handler(sig, previous))


def _make_handler(sig: int, previous):
    def handler(signum, frame):
        stop_all()
        if callable(previous):
            previous(signum, frame)  # e.g. KeyboardInterrupt for SIGINT
        else:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    return handler
