"""The log of the user's code's failures (RUN_DIR/logs/reward.log, env.log): a line and a
traceback per failed call, up to a byte budget per file (and one line past it).

User code that fails on every sample writes a traceback per sample, step after step: unbounded,
that fills the run's disk over a long run. Past the budget the file gets one line saying so, and
further failures are only counted (here, and in the step's metrics, which count every one). An
entry longer than the whole budget, which would never fit, is cut to the room left instead, with
a line saying how many bytes of it were left out.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

LOG_BYTES = 64 << 20  # a failure log's budget: 64 MiB


class FailureLog:
    """Appends failure entries to `path` (None: nowhere) until it holds `budget` bytes;
    `metric`: where the failures past it are still counted, named in the line that says so."""

    def __init__(self, path: Path | None, metric: str, budget: int = LOG_BYTES):
        self.path, self.metric, self.budget = path, metric, budget
        self.unwritten = 0  # failures past the budget, not written
        self._size: int | None = None  # the file's size (read at the first write: a resumed run)
        self._lock = threading.Lock()

    def write(self, entry: str) -> None:
        """Append `entry` (its lines end with a newline), cut if longer than the whole budget,
        or count it once the budget is used (it, and every one after the first that did not
        fit: the line saying so is the file's last)."""
        if self.path is None:
            return
        whole = entry.encode("utf-8", "replace")
        with self._lock:
            if self._size is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._size = self.path.stat().st_size if self.path.exists() else 0
            data: bytes | None = whole
            if len(whole) > self.budget:
                data = self._cut(whole, self.budget - self._size, self.path.name)
            if self.unwritten or data is None or self._size + len(data) > self.budget:
                self.unwritten += 1
                if self.unwritten > 1:
                    return
                data = self._full_line(self.path.name).encode()
            with open(self.path, "ab") as f:
                f.write(data)
            self._size += len(data)

    def _cut(self, data: bytes, room: int, name: str) -> bytes | None:
        """`data`'s start and a line saying how many bytes of it were left out, in `room` bytes
        at most; None where that leaves none of it."""
        marker = (f"[... {{}} more bytes of this entry left out: it is longer than {name}'s "
                  f"whole budget, {self._size_text()}]\n")  # fmt: skip
        keep = room - len(marker.format(len(data)).encode()) - 1  # (- 1: a newline before it)
        if keep <= 0:
            return None
        head = data[:keep].decode("utf-8", "ignore").encode()  # (no character cut in two)
        newline = b"" if head.endswith(b"\n") else b"\n"
        return head + newline + marker.format(len(data) - len(head)).encode()

    def _size_text(self) -> str:
        mib, rest = divmod(self.budget, 1 << 20)
        return f"{mib} MiB" if mib and not rest else f"{self.budget} bytes"

    def _full_line(self, name: str) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return (f"{stamp} {name} reached {self._size_text()}: further failures are not written "
                f"here, only counted ({self.metric} in metrics.jsonl)\n")  # fmt: skip
