"""megatron_gspo/outputs.py: a SIGTERM whose SystemExit a finalizer swallowed still stops the
block before its output is made final."""

from __future__ import annotations

import signal

import pytest

from megatron_gspo.outputs import temp_dir_for, temp_file_for


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


def test_the_block_without_a_signal_makes_its_output(tmp_path):
    with temp_file_for(tmp_path / "out") as tmp:
        tmp.write_text("whole")
    assert (tmp_path / "out").read_text() == "whole"
