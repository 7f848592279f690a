"""Per-step metrics: `RUN_DIR/metrics.jsonl`, TensorBoard, W&B, and a console progress line.

The RL loop calls `MetricsLogger.log(step, metrics)` once per step on rank 0. Training steps count
from 1 and the run ends at `total_steps`; a fresh run may also log step 0 (e.g. the eval reward of
the starting checkpoint). `start_step` is the last completed step: the checkpoint's step on
resume, 0 for a fresh run.

`metrics.jsonl` is the record of a run: one strict-JSON object per step, `{"step": N, ...}` with
exactly the keys the loop logged (a key that does not apply to a run is absent; `None` values are
dropped). Nothing else is added (no wall-clock stamp), so a resumed run writes the same lines as an
uninterrupted one. Each line is flushed and fsync'ed: a kill -9 loses at most the line being
written, and opening the logger again (or `truncate_metrics`) drops that torn line and says so in
one line: which step's line it was, and whether that step is trained again (after the resumed
checkpoint: its line is written anew) or its metrics are lost (the checkpoint is past it).

Non-finite floats are written as the JSON strings "NaN", "Infinity" and "-Infinity" (the file
stays strict JSON, readable by jq or any JSON parser); `read_metrics` turns them back into floats.
To keep that round trip exact, `log` refuses a string metric equal to one of those three words.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from pathlib import Path

from megatron_gspo.disk_full import full_line
from megatron_gspo.errors import UserError
from megatron_gspo.train.console import ConsoleProgress
from megatron_gspo.train.files import fsync_dir

METRICS_FILE = "metrics.jsonl"
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
Scalar = float | int | str | bool


# ---- metrics.jsonl --------------------------------------------------------------------------


def _encode(value: Scalar) -> Scalar:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _decode(value):
    return NON_FINITE.get(value, value) if isinstance(value, str) else value


def _scalar(key: str, value) -> Scalar:
    """A plain Python scalar from a float/int/str/bool or a one-element tensor/array."""
    if hasattr(value, "item") and not isinstance(value, Scalar):
        value = value.item()
    if not isinstance(value, Scalar):
        raise TypeError(f"metric {key!r}: {type(value).__name__} is not a number or a string")
    if isinstance(value, str) and value in NON_FINITE:
        raise ValueError(f"metric {key!r}: the string {value!r} would read back as a float")
    return value


def clean_metrics(step: int, metrics: dict) -> dict[str, Scalar]:
    """`{"step": step, **metrics}` as plain scalars, `None` values dropped."""
    if metrics.get("step", step) != step:
        raise ValueError(f"metrics['step'] = {metrics['step']} but log() was called for {step}")
    out: dict[str, Scalar] = {"step": int(step)}
    for key, value in metrics.items():
        if value is not None and key != "step":
            out[str(key)] = _scalar(key, value)
    return out


def encode_line(row: dict[str, Scalar]) -> str:
    return json.dumps({k: _encode(v) for k, v in row.items()}, allow_nan=False) + "\n"


def _parse(path: Path, raw: bytes, lineno: int) -> tuple[str, dict]:
    """(text, row) of line `lineno`; bytes that are not UTF-8 or not a row are the same error."""
    try:
        text = raw.decode("utf-8").removesuffix("\r")
        row = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        text, row = "", None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        raise UserError(f"{path}:{lineno} is not a metrics line; delete it or restore the file")
    return text, {k: _decode(v) for k, v in row.items()}


def _complete_rows(path: Path) -> list[tuple[str, dict]]:
    """(line, row) for every complete line; a torn last line (cut JSON) is skipped."""
    return _rows_and_cut(path)[0]


def _rows_and_cut(path: Path) -> tuple[list[tuple[str, dict]], bytes | None]:
    """(line, row) for every complete line, and the torn last line's bytes (None: none). The
    file is read as bytes and each line decoded alone: a write cut inside a character tears
    only the last line, and stray bytes are named by their line. A last line without its
    newline that is a whole row is kept (the write was cut after its JSON)."""
    lines = path.read_bytes().split(b"\n")
    if not lines[-1].strip():  # (bytes after the last newline: none unless a write was cut)
        lines.pop()
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(_parse(path, line, i))
        except UserError:
            if i < len(lines) or not _could_be_cut(line):
                raise
            return rows, line
    return rows, None


def cut_line_note(path: Path, cut: bytes, last_step: int) -> str:
    """The line that says a torn last line of `path` was dropped: its step (where its start
    shows it) and whether that step is trained again after checkpoint step `last_step`."""
    m = re.match(rb'\{"step": (\d+)[,}]', cut)
    if m is None:
        return f"{path}: its last line was cut short (its step unreadable) and is dropped"
    step = int(m.group(1))
    head = (
        f"{path}: the line of step {step} was cut short (its write was interrupted) and is dropped"
    )
    if step > last_step:
        return f"{head}; step {step} is trained again from step {last_step}, its line written anew"
    return (f"{head}; its metrics are lost: the run resumes after step {last_step}, so step "
            f"{step} is not trained again")  # fmt: skip


def _could_be_cut(raw: bytes) -> bool:
    """A write cut short leaves UTF-8, at most its last character cut; bytes that are not UTF-8
    before that (a stray \\xff) are not a torn line but a file that is not metrics."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return True


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, non-finite floats restored; a torn last line skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} has no {METRICS_FILE}; pass a run directory of megatron-gspo")
    return [row for _, row in _complete_rows(path)]


def last_eval(run_dir: Path) -> float | None:
    """The newest `eval/reward` in RUN_DIR/metrics.jsonl (None: none, or no file): what a resumed
    run's progress line shows until its own first eval, as the interrupted run's did."""
    path = Path(run_dir) / METRICS_FILE
    rows = _complete_rows(path) if path.is_file() else []
    found = [row["eval/reward"] for _, row in rows
             if isinstance(row.get("eval/reward"), int | float)]  # fmt: skip
    return float(found[-1]) if found else None


def truncate_metrics(run_dir: Path, last_step: int) -> str | None:
    """Keep only the lines with step <= last_step (atomic rewrite); drops a torn last line too,
    and returns the line that says so (`cut_line_note`; None: there was none)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return None
    rows, cut = _rows_and_cut(path)
    kept = "".join(line + "\n" for line, row in rows if row["step"] <= last_step)
    tmp = path.with_name(f".{METRICS_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return None if cut is None else cut_line_note(path, cut, last_step)


class JsonlSink:
    """Appends one line per step; flush + fsync so a kill -9 loses at most the line in flight."""

    def __init__(self, run_dir: Path, start_step: int):
        note = truncate_metrics(run_dir, start_step)
        if note is not None:
            print(note, flush=True)
        self._file = open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8")

    def log(self, row: dict[str, Scalar]) -> None:
        self._file.write(encode_line(row))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


# ---- TensorBoard and W&B --------------------------------------------------------------------


def _numbers(row: dict[str, Scalar]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and not isinstance(v, str)}


class TensorBoardSink:
    """Scalars to RUN_DIR/tensorboard/, flushed every step.

    On resume a SessionLog.START event at start_step + 1 tells TensorBoard's loader to drop the
    events of steps after the checkpoint that the interrupted run had written (its older event
    file stays). The loader reads event files in name order, which starts with the creation
    second, so a resumed writer sorts after the interrupted one."""

    def __init__(self, log_dir: Path, start_step: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._dir = event_pb2, Path(log_dir)
        self._writer = EventFileWriter(str(log_dir))
        if start_step > 0:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._add(event_pb2.Event(step=start_step + 1, session_log=start))

    def _add(self, event) -> None:
        # The writer's thread opens the file by name at each write; a directory gone under it
        # would fail there, printing its own traceback. Checked here, it fails once, in log().
        if not self._dir.is_dir():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self._dir))
        event.wall_time = time.time()
        self._writer.add_event(event)
        self._writer.flush()

    def log(self, row: dict[str, Scalar]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in _numbers(row).items()]
        self._add(self._pb.Event(step=row["step"], summary=Summary(value=values)))

    def close(self) -> None:
        try:
            self._writer.close()
        except OSError:  # its directory went away (log() said so): nothing left to save
            pass


WANDB_MISSING = "logging.wandb is set but wandb is not installed: pip install megatron-gspo[wandb]"


def check_wandb(wandb: dict | None) -> None:
    """logging.wandb set where wandb is not installed: refused when the run starts, before its
    directory is made or written (the sink itself opens only after the start is committed)."""
    import importlib.util

    if wandb is not None and importlib.util.find_spec("wandb") is None:
        raise UserError(WANDB_MISSING)


class WandbSink:
    """wandb.init(**kwargs, config=config). The run id is kept in RUN_DIR/wandb_run_id so that a
    resumed run continues the same W&B run (W&B keeps the values it already has for a step)."""

    def __init__(self, run_dir: Path, kwargs: dict, config: dict | None, start_step: int):
        try:
            import wandb
        except ImportError:
            raise UserError(WANDB_MISSING) from None
        kwargs = {"dir": str(run_dir), **kwargs}
        id_file = Path(run_dir) / "wandb_run_id"
        if start_step > 0 and "id" not in kwargs and id_file.is_file():
            kwargs.update(id=id_file.read_text().strip(), resume="allow")
        self._run = wandb.init(config=config, **kwargs)
        id_file.write_text(self._run.id + "\n")

    def log(self, row: dict[str, Scalar]) -> None:
        self._run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        self._run.finish()


# ---- the logger the loop holds --------------------------------------------------------------


class MetricsLogger:
    """Fans each step's metrics out to metrics.jsonl, TensorBoard, W&B and the console.

    Opening it truncates metrics.jsonl to the steps <= start_step (and drops a torn last line), so
    a resumed run continues the file exactly where its checkpoint left off.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb: dict | None = None,
        console: bool = True,
        config: dict | None = None,
    ):
        if not 0 <= start_step <= total_steps:
            raise UserError(
                f"resuming at step {start_step} of a {total_steps}-step run: "
                "raise train.steps or start a new run directory"
            )
        self.run_dir, self.total_steps = Path(run_dir), total_steps
        self._last = start_step if start_step > 0 else -1  # a fresh run may log step 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._sinks: list = []
        try:
            # W&B first: a missing wandb fails before metrics.jsonl is touched.
            if wandb is not None:
                self._sinks.append(WandbSink(self.run_dir, wandb, config, start_step))
            self._sinks.append(JsonlSink(self.run_dir, start_step))
            if tensorboard:
                self._sinks.append(TensorBoardSink(self.run_dir / "tensorboard", start_step))
            if console:  # (metrics.jsonl holds the steps up to start_step only, by now)
                shown = last_eval(self.run_dir) if start_step > 0 else None
                self._sinks.append(ConsoleProgress(total_steps, eval_reward=shown))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float | int | str]) -> None:
        """Record one step. Steps increase and exceed start_step (a fresh run may log step 0).
        `None` values are left out."""
        if step <= self._last:
            raise ValueError(
                f"step {step} logged after step {max(self._last, 0)}; steps must increase"
            )
        row = clean_metrics(step, metrics)
        if not self.run_dir.is_dir():  # metrics.jsonl, open, would go on into a deleted file
            raise self._sink_error(None)
        try:
            for sink in self._sinks:
                sink.log(row)
        except OSError as e:
            raise self._sink_error(e, sink) from None
        self._last = step

    def _sink_error(self, e: OSError | None, sink: object = None) -> UserError:
        """One line for a sink that cannot write: the run directory gone, its disk full, or why
        not."""
        if e is None or not self.run_dir.is_dir():
            return UserError(
                f"the run directory {self.run_dir} disappeared while training (its checkpoints "
                "with it); start the run again"
            )
        if e.errno == errno.ENOSPC:
            from megatron_gspo.train.checkpointing import latest  # (torch: a run has it loaded)

            written = "tensorboard/" if isinstance(sink, TensorBoardSink) else METRICS_FILE
            return UserError(full_line(self.run_dir, written, latest(self.run_dir)))
        return UserError(
            f"cannot write the metrics in {self.run_dir}: {e}; fix that (space, permissions), "
            "then continue with --resume"
        )

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
