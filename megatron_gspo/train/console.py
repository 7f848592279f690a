"""The console progress line of a training run (one of the metrics sinks, train/metrics.py):
'step 12/40 | reward 0.41 | eval 0.50 | 2.1 s/step | ETA 1m20s' on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO, cast

Row = dict[str, float | int | str | bool]  # one step's metrics (train/metrics.py `clean_metrics`)


def format_duration(seconds: float) -> str:
    """45s, 1m20s, 2h03m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_text(
    step: int,
    total_steps: int,
    reward: float | None,
    eval_reward: float | None,
    sec_per_step: float | None,
) -> str:
    """'step 12/40 | reward 0.41 | eval 0.50 | 2.1 s/step | ETA 1m20s'; unknown parts left out."""
    parts = [f"step {step}/{total_steps}"]
    if reward is not None:
        parts.append(f"reward {reward:.2f}")
    if eval_reward is not None:
        parts.append(f"eval {eval_reward:.2f}")
    if sec_per_step is not None:
        parts.append(f"{sec_per_step:.1f} s/step")
        parts.append("ETA " + format_duration(sec_per_step * max(0, total_steps - step)))
    return " | ".join(parts)


class ConsoleProgress:
    """The progress line on stderr: redrawn in place on a TTY, one plain line per step otherwise.

    Seconds per step are wall-clock time between log() calls; once two steps are in, the time
    before the first one (start-up) is left out of the average. Step 0 (before any training step)
    restarts the clock and shows no rate. The eval value shown is the newest logged, from
    `eval_reward` (a resumed run's, from before its checkpoint) until a row brings one.
    """

    def __init__(self, total_steps: int, clock=time.monotonic, eval_reward: float | None = None):
        self.total_steps, self._clock = total_steps, clock
        self._t0 = clock()
        self._times: list[float] = []
        self._eval = eval_reward
        self._width = 0

    def sec_per_step(self) -> float | None:
        t = self._times
        if len(t) >= 2:
            return (t[-1] - t[0]) / (len(t) - 1)
        return t[0] - self._t0 if t else None

    def text(self, row: Row) -> str:
        if row["step"] == 0:
            self._t0 = self._clock()
        else:
            self._times.append(self._clock())
        if isinstance(row.get("eval/reward"), int | float):
            self._eval = float(row["eval/reward"])
        reward = row.get("reward/mean")
        reward = float(reward) if isinstance(reward, int | float) else None
        step = cast(int, row["step"])
        return progress_text(step, self.total_steps, reward, self._eval, self.sec_per_step())

    def log(self, row: Row) -> None:
        line, stream = self.text(row), sys.stderr
        if _is_tty(stream):
            stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            stream.write(line + "\n")
        stream.flush()

    def close(self) -> None:
        if self._width and _is_tty(sys.stderr):
            sys.stderr.write("\n")
            sys.stderr.flush()


def _is_tty(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()
