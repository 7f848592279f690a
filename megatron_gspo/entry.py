"""How each entry point (`megatron-gspo`, `python -m megatron_gspo.server`) runs its command:
bad input (`UserError`) is the one line "error: ..." and exit 2, under torchrun on every rank
even where one rank alone refused (comm.py); a Ctrl-C is the one line
"interrupted" (with what was kept, for `Interrupted`) and exit 130, the shell's code for it (a
SIGTERM that a command turned into `Interrupted`, as `train` does: the same line, exit 143).
Each command imports what it runs with SIGINT and SIGTERM held (`outputs.signals_held`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from megatron_gspo.errors import Interrupted, UserError, in_context
from megatron_gspo.outputs import raise_exit

INTERRUPTED = 130  # the exit code of a command stopped by a Ctrl-C (the shell's: 128 + SIGINT)


def run_command(command: Callable[[], object]) -> None:
    """`command()`, its bad input and its Ctrl-C said in one line, as above."""
    interrupts = _note_interrupts()
    try:
        command()
    except UserError as e:
        _refuse(str(e))
    except BaseException as e:  # a Ctrl-C: one line, not a traceback
        # (a SIGINT inside torch's import or its checkpoint writer comes out as their own error)
        ctrl_c = isinstance(e, (Interrupted, KeyboardInterrupt)) or bool(interrupts)
        refused = _refusal_behind(e)
        if refused is not None:
            _refuse(refused)
        if isinstance(e, SystemExit) or not ctrl_c:
            raise
        if _rank() == 0:
            print(f"interrupted{f': {e}' if isinstance(e, Interrupted) else ''}", file=sys.stderr)
        sys.exit(128 + e.signum if isinstance(e, Interrupted) else INTERRUPTED)
    finally:
        _shutdown()


def _refuse(line: str) -> None:
    """The one line and exit 2. Under torchrun the line is posted for the other ranks first
    (comm.py: one that fails or is stopped because this one left says it too). Once one rank has
    exited torchrun stops the others with SIGTERM, while they are still on their way out (the
    interpreter's exit takes a second or two after torch): ignored from here, so each ends with
    the same status, not as killed by the signal. (Ignored, not handled: the interpreter puts
    back the default action of a handled signal as it exits.)"""
    comm = sys.modules.get("megatron_gspo.comm")
    if comm is not None:
        line = comm.post_refusal(line)
    print(f"error: {line}", file=sys.stderr, flush=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(2)


def _refusal_behind(e: BaseException) -> str | None:
    """The refusal that `e` came of, None where it came of none (nor is a plain exit): the
    UserError a stop came during (a signal's exception: SIGTERM's SystemExit(143), a Ctrl-C,
    `Interrupted`), as the command unwound from it; else the line another rank posted before it
    exited (comm.py), which this rank's error or stop (torchrun's SIGTERM) came of."""
    if isinstance(e, SystemExit) and e.code != 128 + signal.SIGTERM:
        return None
    if isinstance(e, (SystemExit, Interrupted, KeyboardInterrupt)):
        during = in_context(e, UserError)
        if during is not None:
            return str(during)
    comm = sys.modules.get("megatron_gspo.comm")
    return None if comm is None else comm.posted_refusal()


def _note_interrupts() -> list[int]:
    """SIGINT raises KeyboardInterrupt, as Python's own handler does, and is noted in the list
    returned: one landing inside a library's C++ code comes out as that library's error (inside
    torch's import: "generic_type: cannot initialize type ..."; inside its checkpoint writer:
    "unexpected pos"), which `run_command` then reports as the interrupt it is. A SIGINT that is
    not Python's (ignored, as by a script's background job) is left as it is."""
    noted: list[int] = []
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return noted

    def interrupt(signum: int, frame: object) -> None:
        noted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    return noted


@contextlib.contextmanager
def terminate_stops() -> Iterator[None]:
    """Inside the block SIGTERM raises SystemExit(128 + SIGTERM), as SIGINT raises
    KeyboardInterrupt: the code it lands in unwinds (a command's servers and workers stopped on
    the way out) where its default action ends the process there and then. A SIGTERM ignored is
    left so, as is the block off the main thread (where Python sets no handler)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# On the way out nothing is imported: after a SIGINT inside torch's import, importing torch
# again (a module of ours that imports it) crashes the interpreter (a second TORCH_LIBRARY).
def _rank() -> int:
    """This process's rank (0 where megatron_gspo.comm, and so torch, was never loaded)."""
    comm = sys.modules.get("megatron_gspo.comm")
    return 0 if comm is None else comm.rank()


def _shutdown() -> None:
    """Process groups and parallel state down, where model/parallel.py (which alone starts
    them) was loaded."""
    parallel = sys.modules.get("megatron_gspo.model.parallel")
    if parallel is not None:
        parallel.shutdown()
