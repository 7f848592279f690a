"""A Ctrl-C that lands inside torch's C++ code ends a command as any other does: the one line
"interrupted", exit 130, nothing half-written left. torch lost such an interrupt or turned it
into its own error: inside its checkpoint writer a RuntimeError ("unexpected pos"), inside its
import a RuntimeError ("generic_type: cannot initialize type ...") or nothing at all (the
command went on; `serve` came up serving), and a half-imported torch crashed the interpreter on
the way out. Each test sends a real SIGINT at that point (an injected hook, in the command's own
process); where torch's C++ code turned it into something else, the hook does the same."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_gspo.outputs import interrupts_kept
from megatron_gspo.train.checkpointing import resume_hint
from tests.helpers import CTRL_C_IN_WRITER, cli_env, run_hooked

pytestmark = pytest.mark.unit


class CtrlCOnWrite(io.BytesIO):
    """A stream whose second write gets a SIGINT: the KeyboardInterrupt is raised inside torch's
    C++ zip writer, which calls this `write`, as a Ctrl-C during a checkpoint's write is. (On
    the first write torch lets it out as it is; on any later one it does not.)"""

    writes = 0

    def write(self, b) -> int:
        self.writes += 1
        if self.writes == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(b)


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt in this process, as at a terminal."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_torchs_writer_turns_a_ctrl_c_into_a_runtime_error(python_sigint):
    """Why `interrupts_kept` is there (torch's behaviour, not ours)."""
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save(torch.arange(1000), CtrlCOnWrite())


def test_a_ctrl_c_inside_torchs_writer_stays_a_keyboard_interrupt(python_sigint):
    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        torch.save(torch.arange(1000), CtrlCOnWrite())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_interrupts_kept_leaves_a_block_without_a_signal_alone(python_sigint):
    with pytest.raises(ValueError, match="mine"), interrupts_kept():
        raise ValueError("mine")
    buf = io.BytesIO()
    with interrupts_kept():
        torch.save(torch.arange(3), buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), torch.arange(3))


# A SIGINT while `import torch` runs, once torch.distributed is loaded, when torch.distributions
# is about to be: raised as it is (AS_IS), or, as torch's C++ module initialization does with
# one, lost (LOST) or turned into a RuntimeError (GARBLED).
CTRL_C_IN_IMPORT = """
import time
class _CtrlC:
    sent = False
    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributions" or _CtrlC.sent:
            return None
        _CtrlC.sent = True
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            if {mode!r} == "as_is":
                raise
            if {mode!r} == "garbled":
                raise RuntimeError('generic_type: cannot initialize type "RpcBackendOptions"')
        return None
sys.meta_path.insert(0, _CtrlC())
"""


def test_convert_stopped_inside_torchs_writer_says_interrupted(tmp_path, tiny_models):
    """The trial's `convert hf-to-megatron` with a SIGINT 3.6 s in: exit 1 and a traceback
    ending in "RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos"."""
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    args = ["convert", "hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(out)]
    code, err = run_hooked(CTRL_C_IN_WRITER, args)
    assert (code, err) == (130, "interrupted\n"), err[-3000:]
    assert not list(work.iterdir())


@pytest.mark.parametrize("module", [None, "megatron_gspo.server"], ids=["serve", "python-m"])
@pytest.mark.parametrize("mode", ["as_is", "lost", "garbled"])
def test_serve_stopped_while_torch_imports_says_interrupted(tmp_path, tiny_models, mode, module):
    """The trial's `serve` with a SIGINT 0.7 s in: a RuntimeError traceback, exit 1; sent a
    little earlier it was lost and the server came up serving; raised as it is, torch was left
    half-imported and importing it again on the way out crashed the interpreter (SIGSEGV).
    `python -m megatron_gspo.server` (the launcher's) imported torch as it loaded, before
    anything held the signal: the same tracebacks, or a server that came up serving."""
    args = ["--model", str(tiny_models["moe"]), "--port", "0"]
    hook = CTRL_C_IN_IMPORT.format(mode=mode)
    code, err = run_hooked(hook, args if module else ["serve", *args], timeout=60, module=module)
    assert (code, err) == (130, "interrupted\n"), err[-3000:]


# `python -m megatron_gspo.server --help`, then whether torch was loaded to say it.
SERVER_HELP = """
import runpy, sys
sys.argv[1:] = ["--help"]
try:
    runpy.run_module("megatron_gspo.server", run_name="__main__")
except SystemExit as e:
    print(e.code, "torch" in sys.modules)
"""


def test_the_servers_module_help_imports_no_torch():
    """`python -m megatron_gspo.server --help` took 2 s (torch imported first) to print it."""
    cmd = [sys.executable, "-c", SERVER_HELP]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=cli_env())
    assert r.stdout.startswith("usage: python -m megatron_gspo.server"), r.stderr
    assert r.stdout.splitlines()[-1] == "0 False"


# The first torch.save sends SIG from a finalizer, as when the garbage collector runs a
# library's `__del__` just as a Ctrl-C or a SIGTERM comes: its exception is raised there, where
# Python drops it and reports it as "Exception ignored in ...".
SIGNAL_IN_FINALIZER = """
import torch
_save = torch.save

class _Finalized:
    sent = False
    def __del__(self):
        _Finalized.sent = True
        signal.raise_signal({sig})
        sum(range(1000))  # (the handler runs at a bytecode boundary here)

def _saving(*args, **kwargs):
    if not _Finalized.sent:
        _Finalized()
    return _save(*args, **kwargs)

torch.save = _saving
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_a_finalizer_swallowed_ends_convert_with_only_its_line(tmp_path, tiny_models, sig):
    """The output was not made (outputs.py noted the signal), but stderr began with Python's
    "Exception ignored in: <function ...__del__>" and a traceback ending "SystemExit: 143"."""
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    args = ["convert", "hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(out)]
    code, err = run_hooked(SIGNAL_IN_FINALIZER.format(sig=int(sig)), args)
    said = (130, "interrupted\n") if sig == signal.SIGINT else (128 + signal.SIGTERM, "")
    assert (code, err) == said, err[-3000:]
    assert not list(work.iterdir())


def test_the_interrupt_line_says_the_same_command_where_it_had_resume(tmp_path):
    """An interrupted `train` said "the same command with --resume goes on from it" even where
    the command had --resume already (the quickstart's, on its later runs): then it is the same
    command that goes on."""
    run = tmp_path / "run"
    none_yet = f"{run} holds no checkpoint yet: the same command starts the run again"
    assert resume_hint(run) == f"{none_yet} (with --resume too)"
    assert resume_hint(run, resumed=True) == none_yet
    for step in (2, 10):  # (the newest is step 10's, not the last in name order)
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    newest = run / "checkpoints" / "step_10"
    assert resume_hint(run) == (
        f"{newest} is the run's newest checkpoint: the same command with --resume goes on from it"
    )
    assert resume_hint(run, resumed=True) == (
        f"{newest} is the run's newest checkpoint: the same command goes on from it"
    )


def test_closing_the_io_thread_ends_what_still_runs_on_it(caplog):
    """A Ctrl-C during a rollout stops its caller (rank 0's main thread), not the rollout on the
    io thread's loop: closed with it pending, asyncio logged "Task was destroyed but it is
    pending!" and the task after train's "interrupted: ..." line (a flaky last line in
    tests/e2e/test_interrupt.py). Now the rest is cancelled, and ends, before the loop closes."""
    import asyncio
    import gc
    import threading

    from megatron_gspo.train.io_thread import IoThread

    io = IoThread()
    started = threading.Event()

    async def rollout() -> None:
        started.set()
        await asyncio.sleep(3600)

    caller = asyncio.run_coroutine_threadsafe(rollout(), io.loop)
    assert started.wait(10)
    io.close()
    assert caller.cancelled()
    del caller
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text
