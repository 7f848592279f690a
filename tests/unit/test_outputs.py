"""megatron_gspo/outputs.py: a SIGTERM whose SystemExit a finalizer swallowed still stops the
block before its output is made final, and Python's report of the swallowed exception is not
printed (any other exception a finalizer drops still is); what the blocks make any user can
read."""

from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_gspo.outputs import interrupts_kept, temp_dir_for, temp_file_for


class SignalInFinalizer:
    """Sends this process `sig` from its `__del__`: the handler's exception is raised there, in
    the finalizer, where Python prints "Exception ignored" and drops it (as when the garbage
    collector runs a library's `__del__` just as a SIGTERM or a Ctrl-C comes)."""

    def __init__(self, sig: int) -> None:
        self.sig = sig

    def __del__(self) -> None:
        signal.raise_signal(self.sig)
        sum(range(1000))  # (the handler runs at a bytecode boundary here)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("make", [temp_file_for, temp_dir_for], ids=["file", "dir"])
def test_a_signal_whose_exception_a_finalizer_swallowed_still_stops_the_output(tmp_path, make, sig):
    out = tmp_path / "out"
    stopped = SystemExit if sig == signal.SIGTERM else KeyboardInterrupt
    with pytest.raises(stopped) as e, make(out) as tmp:
        if make is temp_file_for:
            tmp.write_text("half")
        else:
            (tmp / "part").write_text("half")
        SignalInFinalizer(sig)  # (dropped at once: its finalizer runs here)
        assert tmp.exists()  # the block went on: the signal's exception did not reach it
    if sig == signal.SIGTERM:
        assert e.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # no output, no temporary left


class ErrorInFinalizer:
    """Raises `error` from its `__del__`: a library's own bug, which Python reports."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __del__(self) -> None:
        raise self.error


@pytest.fixture
def reported(monkeypatch) -> list[str]:
    """What Python's hook would print as "Exception ignored in ...": the hook the guards find."""
    seen: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    return seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_only_the_signals_own_exception_goes_unreported(tmp_path, reported, sig):
    """Python printed "Exception ignored in: <function ...__del__>" and a traceback ending in
    "SystemExit: 143" (or "KeyboardInterrupt") before the command's own line."""
    before = sys.unraisablehook
    with pytest.raises((SystemExit, KeyboardInterrupt)), temp_file_for(tmp_path / "out"):
        ErrorInFinalizer(ValueError("a library's own"))
        SignalInFinalizer(sig)
        ErrorInFinalizer(KeyboardInterrupt())  # (the signal's type, not the signal's exception)
    assert reported == ['ValueError("a library\'s own")', "KeyboardInterrupt()"]
    assert sys.unraisablehook is before
    assert list(tmp_path.iterdir()) == []


def test_interrupts_kept_leaves_a_swallowed_ctrl_c_unreported_and_acts_on_it(reported):
    before = sys.unraisablehook
    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        SignalInFinalizer(signal.SIGINT)
        ErrorInFinalizer(ValueError("a library's own"))
    assert reported == ['ValueError("a library\'s own")']
    assert sys.unraisablehook is before


def test_a_signal_swallowed_after_an_inner_block_still_stops_the_outer_output(tmp_path):
    """An inner guarded output (a checkpoint's write inside a command's) ended first and took
    the outer block's note of signals with it (removed by equality: both empty then): a SIGTERM
    swallowed after it was lost, and the outer block's end failed with "list.remove(x): x not
    in list" instead of stopping its output."""
    with pytest.raises(SystemExit) as e, temp_dir_for(tmp_path / "outer") as outer:
        with temp_file_for(outer / "inner") as inner:
            inner.write_text("whole")
        SignalInFinalizer(signal.SIGTERM)
        (outer / "part").write_text("half")
    assert e.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_the_block_without_a_signal_makes_its_output(tmp_path):
    with temp_file_for(tmp_path / "out") as tmp:
        tmp.write_text("whole")
    assert (tmp_path / "out").read_text() == "whole"


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_outputs_are_readable_by_any_user_whatever_made_them(tmp_path):
    """As `convert` leaves its files: 644 files, 755 directories, even where the writer made
    them private (mkstemp's 0600, mkdtemp's 0700) or the umask would."""
    previous = os.umask(0o077)
    try:
        with temp_file_for(tmp_path / "scores.jsonl") as tmp:
            tmp.write_text("{}\n")
        with temp_dir_for(tmp_path / "model") as tmp:
            fd, _ = tempfile.mkstemp(dir=tmp)
            os.close(fd)
            (Path(tempfile.mkdtemp(dir=tmp)) / "part").write_text("x")
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "scores.jsonl") == 0o644
    found = sorted(p for p in (tmp_path / "model").rglob("*"))
    assert len(found) == 3
    assert {_mode(p) for p in found if p.is_file()} == {0o644}
    assert {_mode(p) for p in [tmp_path / "model", *found] if p.is_dir()} == {0o755}


@pytest.mark.parametrize("command", ["make-tiny-model", "make-task-model"])
def test_the_model_commands_write_every_file_readable(tmp_path, command):
    """model.safetensors came 0600 (the other files 0644): a container running as uid 1001
    (docs/deployment.md) could not read the model."""
    from megatron_gspo.data.warmstart import make_task_model
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    if command == "make-tiny-model":
        out = make_tiny_model(TinySpec(layers=1, experts=2, topk=1), tmp_path / "m")
    else:
        knobs = dict(hidden=32, batch_size=8, clean_steps=1, sloppy_steps=1)
        out = make_task_model(tmp_path / "m", seed=0, **knobs)
    modes = {p.name: _mode(p) for p in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o644) and _mode(out) == 0o755
