"""The check every command makes of a new output path before it does any work, and the guard
that lets a build interrupted by SIGTERM remove its half-written output.

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
import signal
import tempfile
import threading
from collections.abc import Iterator
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
    default SIGTERM ends the process there and then). The previous handler is restored after.
    Off the main thread, where Python sets no handler, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
