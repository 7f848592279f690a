"""The check every command makes of a new output path before it does any work, the guard that
lets a build interrupted by SIGTERM remove its half-written output, the temporary file or
directory beside an output that becomes it only when complete, and the guards that keep a
signal what it is inside code that would lose it (`signals_held`, `interrupts_kept`).

A command that would fail to create its output only at the end (after converting or scoring
everything) wastes the run and, as an OSError, prints a traceback. So the path is checked first:
it must not exist (nothing the user had is overwritten), and the nearest directory that does
exist must take a new entry. That is tried, not read from the permission bits (root passes
every access check, yet cannot write in /proc or /sys), by making and removing a temporary
directory there, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_gspo.errors import UserError


def check_new_output(path: str | os.PathLike, flag: str) -> Path:
    """`path` (given by `flag`, e.g. "--out") can be created; missing parents may be made."""
    out = Path(path)
    if out.exists() or out.is_symlink():
        raise UserError(f"output path {out} exists; remove it or choose another {flag}")
    base = out.absolute().parent
    while not base.exists() and not base.is_symlink():
        base = base.parent
    if not base.is_dir():
        raise UserError(
            f"cannot create output path {out}: {base} is a file, not a directory; "
            f"choose another {flag}"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=base))
    except OSError as e:
        raise UserError(
            f"cannot create output path {out}: {base} takes no new files ({e.strerror}); "
            f"choose another {flag}"
        ) from None
    return out


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside the block SIGTERM raises SystemExit(128 + SIGTERM), as SIGINT raises
    KeyboardInterrupt, so the block's `finally` runs and removes what it had half-written (by
    default SIGTERM ends the process there and then). The previous handlers are restored after.
    Either signal is also noted, so that one whose exception a finalizer swallowed still stops
    the block (`stop_if_terminated`), and Python's "Exception ignored" report of it is not
    printed (`_noted`). Off the main thread, where Python sets no handler, the block runs as it
    is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    handlers = {signal.SIGTERM: raise_exit}
    interrupt = signal.getsignal(signal.SIGINT)  # (Python's, or one that wraps it: noted too)
    if callable(interrupt):
        handlers[signal.SIGINT] = interrupt
    _TERMINATED.append(got)
    try:
        with _noted(handlers, got):
            yield
    finally:  # (by identity: an inner block's list may equal this one's)
        _TERMINATED[:] = [g for g in _TERMINATED if g is not got]
    stop_if_terminated(got)  # (the block ended as if nothing came: its exception was swallowed)


def raise_exit(signum: int, frame: object) -> None:
    """A handler: the signal ends the process by SystemExit(128 + signum), an exception."""
    raise SystemExit(128 + signum)


# The signals each `terminate_raises` block now open has had. A handler's exception is raised in
# whatever Python code runs then, and one that lands in a finalizer (a `__del__` run by the
# garbage collector, say during an import) is dropped (`_noted`: its report is not printed): the
# block would go on to make its output as if no SIGTERM had come.
_TERMINATED: list[list[int]] = []


def stop_if_terminated(got: list[int] | None = None) -> None:
    """The exception of a SIGTERM (SystemExit(128 + SIGTERM)) or SIGINT (KeyboardInterrupt) that
    came in an open `terminate_raises` block (or is in `got`) and was swallowed: called before an
    output is made final."""
    for signals in [got] if got is not None else _TERMINATED:
        if signals and signals[-1] == signal.SIGINT:
            raise KeyboardInterrupt
        if signals:
            raise SystemExit(128 + signals[-1])


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside the block take effect when it ends (raised again
    then), so a temporary output made inside is named before a signal can stop the process.
    (A handler, not a signal mask: the kernel gives a signal to any thread that does not block
    it, and Python then runs the handler in the main thread all the same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():  # (None: a handler set outside Python)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """SIGINT and SIGTERM inside the block act at once, as outside it, and the block ends with
    their own exception (KeyboardInterrupt; SystemExit(143) under `terminate_raises`) even where
    the code inside turned it into another error or dropped it: torch's checkpoint writer, whose
    C++ zip writer a KeyboardInterrupt leaves mid-record, raises "RuntimeError: unexpected pos",
    which DCP wraps in a CheckpointException. A signal Python does not handle (ignored, or
    SIGTERM's default) is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _noted({s: h for s, h in previous.items() if callable(h)}, got):
            yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        if not got:
            raise
    for s in dict.fromkeys(got):  # (the error that replaced it is dropped: the signal says why)
        signal.raise_signal(s)


@contextlib.contextmanager
def _noted(handlers: dict[int, Callable], got: list[int]) -> Iterator[None]:
    """Each of `handlers` set for its signal for the block, the signal noted in `got` before the
    handler runs; the handlers before are restored after. The exception a handler raises is
    raised in whatever Python code runs then; where that is a finalizer (a `__del__` run by the
    garbage collector), Python drops it and prints "Exception ignored in ... SystemExit: 143",
    a traceback before the command's own line. The caller acts on the noted signal, so that
    report is not printed: a hook passes every other unraisable exception on to the hook before
    it."""
    raised: list[BaseException] = []

    def note(signum: int, frame: object) -> None:
        got.append(signum)
        try:
            handlers[signum](signum, frame)
        except BaseException as e:
            raised.append(e)
            raise

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if any(e is unraisable.exc_value for e in raised):  # (dropped: its frames freed)
            raised[:] = [e for e in raised if e is not unraisable.exc_value]
        else:
            previous_hook(unraisable)

    previous = {s: signal.signal(s, note) for s in handlers}
    previous_hook, sys.unraisablehook = sys.unraisablehook, hook
    try:
        yield
    finally:
        for s, handler in previous.items():  # (None: a handler set outside Python)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if sys.unraisablehook is hook:  # (else one set inside the block is left to its owner)
            sys.unraisablehook = previous_hook


FILE_MODE, DIR_MODE = 0o644, 0o755  # an output's, as `convert` leaves its files: any user reads


def make_readable(path: Path) -> None:
    """`path` and, for a directory, everything in it: files FILE_MODE, directories DIR_MODE,
    whatever made them (safetensors' model file comes 0600, mkdtemp's directory 0700) and
    whatever the umask: a container running as another uid reads them."""
    if path.is_dir():
        for f in path.rglob("*"):
            if not f.is_symlink():
                f.chmod(DIR_MODE if f.is_dir() else FILE_MODE)
    path.chmod(DIR_MODE if path.is_dir() else FILE_MODE)


@contextlib.contextmanager
def temp_file_for(out: Path) -> Iterator[Path]:
    """A temporary file beside `out` for the block to write: renamed to `out` (mode 644) when
    the block ends, removed on an error, SIGINT or SIGTERM (nothing half-written is left beside
    `out`)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with terminate_raises():
        try:
            yield tmp
            stop_if_terminated()
            make_readable(tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def temp_dir_for(out: Path) -> Iterator[Path]:
    """A new temporary directory beside `out` (missing parents made) for the block to fill:
    renamed to `out` when the block ends (directories in it mode 755, files 644, as `convert`
    leaves them), removed on an error, SIGINT or SIGTERM."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    with terminate_raises():
        try:
            with signals_held():
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            yield tmp
            stop_if_terminated()
            make_readable(tmp)
            os.replace(tmp, out)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
