"""A rollout server that did not come up or died: the error with the end of its log, and the one
line that says why (its last exception)."""

from __future__ import annotations

import re
from pathlib import Path


class ServerFailed(RuntimeError):
    """A server that did not come up (the message holds the end of its log)."""

    def __init__(self, what: str, log_path: Path | None = None, tail: str = ""):
        super().__init__(f"{what}; {log_path} ends with:\n{tail}" if log_path else what)
        self.what, self.log_path, self.tail = what, log_path, tail

    def summary(self) -> str:
        """One line: what happened, the cause the log gives, and where the whole log is."""
        cause = failure_cause(self.tail)
        where = f" (whole log: {self.log_path})" if self.log_path else ""
        return f"{self.what}: {cause}{where}" if cause else f"{self.what}{where}"


# an exception line of a Python traceback ("RuntimeError: ...", "torch.OutOfMemoryError: ...")
_EXCEPTION = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt))\b:?")


_NO_LIBRARY = "error while loading shared libraries"  # (the dynamic loader's own words)
_NOISE = ("Traceback", "File ", "^", "~", "During handling", "The above exception")


def failure_cause(tail: str) -> str:
    """The line of a failed server's log that says why: a program that could not load a shared
    library (the cause wherever it appears: SGLang's scheduler exits on it, and its parent then
    raises about the scheduler's exit code), else the last exception line of the last traceback,
    else the last line that mentions an error, else the last line (300 characters)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for pick in (
        lambda ln: _NO_LIBRARY in ln,
        lambda ln: bool(_EXCEPTION.match(ln)),
        lambda ln: "error" in ln.lower() and not ln.startswith(_NOISE),
        lambda ln: not ln.startswith(_NOISE),
    ):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1][:300]
    return ""
