"""The exceptions the CLI turns into one line: bad user input (exit 2) and a Ctrl-C (exit 130)
or, for `train`, a SIGTERM (exit 143)."""

from __future__ import annotations

import signal
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class UserError(Exception):
    """Bad input (config, checkpoint, dataset, request). The message names the fix."""


class Interrupted(Exception):
    """A command stopped by a Ctrl-C (SIGINT), or a SIGTERM (`signum`). The CLI prints
    "interrupted: " and the message (what was kept, how to go on) on one line and exits
    128 + `signum`, the shell's code for the signal (130 for a Ctrl-C, 143 for a SIGTERM)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


def first_line(e: BaseException) -> str:
    """`e`'s message's first line (its type's name where it has none): for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def in_context(e: BaseException, kind: type[E]) -> E | None:
    """The first exception of `kind` that `e` was raised during (its `__context__` chain, `e`
    itself left out); None where there is none."""
    seen: set[int] = set()
    cause = e.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, kind):
            return cause
        seen.add(id(cause))
        cause = cause.__context__
    return None
