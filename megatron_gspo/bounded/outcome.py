"""What a bounded call comes back as: every way it can end is a value of `Outcome`, never an
exception in the trainer."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

MAX_LINE = 400  # characters of one error message


class Kind(enum.Enum):
    VALUE = "value"  # the handler's result, in `value`
    RAISED = "raised"  # the user's code raised (any BaseException); `message`: "Type: text"
    REFUSED = "refused"  # the handler refused the result; `message` says what and why
    TIMEOUT = "timeout"  # it ran past the time limit: its worker was killed and is replaced
    DIED = "died"  # its worker process ended under it; `message`: how (exit code, signal)
    LOST = "lost"  # the worker holding its state was replaced before it ran
    START = "start"  # no worker could be started for it; `message` says why
    CLOSED = "closed"  # the pool was closed (the run is ending) before it ran


@dataclass
class Outcome:
    kind: Kind
    value: Any = None
    message: str = ""
    detail: str = ""  # the traceback, where the user's code raised
    worker: int = -1  # the worker (slot) that ran it
    incarnation: int = -1  # which start of that worker: its state lives as long as this

    @property
    def ok(self) -> bool:
        return self.kind is Kind.VALUE


class Refused(Exception):
    """Raised by a handler in the worker: the user's code returned something it may not (the
    message says what, and what it must return); the call fails with that message alone."""


def one_line(text: str, limit: int = MAX_LINE) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_answer(frame: bytes) -> Outcome | None:
    """A worker's answer (worker.py) as an Outcome; None if it is not one."""
    try:
        answer = json.loads(frame)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict):
        return None
    if "value" in answer:
        return Outcome(Kind.VALUE, value=answer["value"])
    if isinstance(answer.get("refused"), str):
        return Outcome(Kind.REFUSED, message=answer["refused"])
    if isinstance(answer.get("raised"), str):
        return Outcome(Kind.RAISED, message=answer["raised"], detail=str(answer.get("traceback")))
    return None
