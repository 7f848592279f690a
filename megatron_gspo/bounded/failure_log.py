"""The log of the user's code's failures (RUN_DIR/logs/reward.log, env.log): a line and a
traceback per failed call, up to a byte budget per file (and one line past it).

User code that fails on every sample writes a traceback per sample, step after step: unbounded,
that fills the run's disk over a long run. Past the budget the file gets one line saying so, and
further failures are only counted (here, and in the step's metrics, which count every one).
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
        """Append `entry` (its lines end with a newline), or count it once the budget is used."""
        if self.path is None:
            return
        data = entry.encode("utf-8", "replace")
        with self._lock:
            if self._size is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._size = self.path.stat().st_size if self.path.exists() else 0
            if self._size + len(data) > self.budget:
                self.unwritten += 1
                if self.unwritten > 1:
                    return
                data = self._full_line(self.path.name).encode()
            with open(self.path, "ab") as f:
                f.write(data)
            self._size += len(data)

    def _full_line(self, name: str) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        mib, rest = divmod(self.budget, 1 << 20)
        size = f"{mib} MiB" if mib and not rest else f"{self.budget} bytes"
        return (f"{stamp} {name} reached {size}: further failures are not written here, only "
                f"counted ({self.metric} in metrics.jsonl)\n")  # fmt: skip
