"""Type and range checks for what a client sends the built-in server.

Every request field passes one of these before it reaches the engine thread, so no value can fail
there (an int that overflows torch's int64, a NaN that turns into NaN log-probs): a bad one is a
`BadRequest`, answered HTTP 400 with SGLang's failure shape and a message that names the field.
The bounds are SGLang's where it has them (top_k <= 2^30, repetition_penalty in (0, 2]) and the
engine's types otherwise (int64 seeds, int32 lengths).
"""

from __future__ import annotations

import functools
import ipaddress
import math
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INT32_MAX = 2**31 - 1
SEED_END = 2**63  # torch generators and SGLang's seed tensors are int64
TOP_K_ALL = 2**30  # SGLang's "whole vocabulary"
MAX_JSON_DEPTH = 32  # the deepest body SGLang's API needs is 4 ({"input_ids": [[...]]})


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to change."""


@dataclass(frozen=True)
class Limits:
    """Per-request bounds the server sets by flag (--max-n, --max-batch-size)."""

    max_n: int = 256  # samples of one prompt (sampling_params.n)
    max_batch: int = 1024  # sequences one /generate makes: prompts x n


DEFAULT_LIMITS = Limits()


def integer(v: object, key: str, lo: int | None, hi: int | None) -> int:
    """An integer in [lo, hi] (None: no bound there); a float with an integral value (3.0) is
    accepted, as before."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be in [{lo}, {hi}], got {show(v)}")
    return v


def number(v: object, key: str, lo: float = -math.inf, hi: float = math.inf, open_lo=False):
    """A finite number in [lo, hi] ((lo, hi] with open_lo), as a float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(f"{key} must be a number, got {show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float
        f = math.inf
    if not math.isfinite(f):
        raise BadRequest(f"{key} must be a finite number, got {show(v)}")
    if (f <= lo if open_lo else f < lo) or f > hi:
        raise BadRequest(f"{key} must be {_range(lo, hi, open_lo)}, got {show(v)}")
    return f


def flag(v: object, key: str) -> bool:
    """true or false (0 and 1 are taken for them)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise BadRequest(f"{key} must be true or false, got {show(v)}")


def body_flag(body: dict, key: str, default: bool = False) -> bool:
    """`body[key]` as a flag (missing or null: `default`). A string such as "false" is refused
    rather than read as true: a flag that aborts requests must not fire by accident."""
    v = body.get(key)
    return default if v is None else flag(v, key)


def check_depth(obj: object, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON value nested deeper than `limit` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]  # obj: the parsed JSON value
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise BadRequest(f"the request body is nested deeper than {limit} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _range(lo: float, hi: float, open_lo: bool) -> str:
    if hi == math.inf:
        return f"{'>' if open_lo else '>='} {lo:g}"
    if lo == -math.inf:
        return f"<= {hi:g}"
    return f"in {'(' if open_lo else '['}{lo:g}, {hi:g}]"


def show(v: object) -> str:
    """A value for a message, cut short."""
    try:
        text = repr(v)
    except ValueError:  # an int too long to print
        return "a very large integer"
    return text if len(text) <= 40 else text[:37] + "..."


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a bind address or a peer's address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=256)
def is_local_address(host: str | None) -> bool:
    """Whether `host` (a peer's IP address) is one of this machine's own: a socket can be bound
    to it. A peer that connects from one is a process on this machine (a trainer rank on the
    server's node reaches it by the node's address, not only by loopback)."""
    if not host:
        return False
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except (ValueError, OSError):
        return False


def _guarded(path: Path, what: str) -> None:
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & stat.S_IWOTH:
        raise BadRequest(
            f"model_path {what} {str(path)!r} is owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}; this server loads weights only from directories "
            f"that its own user (uid {os.getuid()}) owns and others cannot write (chmod o-w)"
        )


def weight_dir(path: str, served: str) -> str:
    """`path` (a client's /update_weights_from_disk model_path), resolved, once it is a directory
    no other user could have put weights in: owned by the server's user and not world-writable,
    as is every file in it (group-writable is allowed: under a umask of 002 the user's own files
    are). A peer on a shared machine can reach a loopback port; it must not be able to make the
    server serve weights it wrote. The directory the server was started with (its operator's
    choice) is always allowed."""
    resolved = Path(path).resolve()
    if not resolved.is_dir():
        raise BadRequest(f"model_path {path!r} is not a checkpoint directory")
    if str(resolved) == served:
        return str(resolved)
    _guarded(resolved, "directory")
    for entry in resolved.iterdir():
        if entry.is_file():  # (a link is judged by what it points to)
            _guarded(entry, "file")
    return str(resolved)
