"""Frames between the trainer and a worker process: a 4-byte big-endian length, then the bytes.

Both sides use the same two functions on the pipe file descriptors they were given. A read has
an optional deadline (the trainer's time limit per call); a frame longer than `MAX_FRAME` is an
error, so a worker cannot make the trainer allocate what it likes.
"""

from __future__ import annotations

import os
import select
import struct
import time

HEADER = struct.Struct("!I")
MAX_FRAME = 256 << 20  # bytes: far above a reward or an observation, far below a machine's memory
_MAX_WAIT_MS = 3_600_000  # one poll() waits at most this long (a huge limit waits in turns)


class FrameError(Exception):
    """The other side sent something that is not a frame (too long), or the deadline passed."""


def write_frame(fd: int, data: bytes) -> None:
    """Write one frame (blocking). OSError (BrokenPipeError) when the reader is gone."""
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_frame(fd: int, deadline: float | None = None, limit: int = MAX_FRAME) -> bytes | None:
    """One frame's bytes; None at end of file (the writer closed or died) before a frame began.
    `deadline` (time.monotonic()): TimeoutError once it passes; None waits for ever. A frame
    longer than `limit` bytes is a FrameError."""
    header = _read_exactly(fd, HEADER.size, deadline, eof_ok=True)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > limit:
        raise FrameError(f"a frame of {size} bytes (the limit is {limit})")
    return _read_exactly(fd, size, deadline, eof_ok=False) or b""


def _read_exactly(fd: int, n: int, deadline: float | None, eof_ok: bool) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        _wait_readable(fd, deadline)
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            if eof_ok and not got:
                return None
            raise FrameError(f"the frame ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _wait_readable(fd: int, deadline: float | None) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        if deadline is None:
            wait_ms = _MAX_WAIT_MS
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            wait_ms = min(_MAX_WAIT_MS, max(1, int(left * 1000) + 1))
        if poller.poll(wait_ms):
            return
