"""Worker for the shared-output tests: two ranks write into `convert.shared_output(OUT)` (a
stand-in for a conversion: each rank's file in model/, its directory made as DCP's writer makes
it), cut short as CASE says (an injected fault: the signal a Ctrl-C or torchrun would send, sent
by the rank to itself at a chosen point).

torchrun --nproc-per-node 2 tests/distributed/shared_output_worker.py OUT CASE

    sigint, sigterm        every rank gets the signal inside its write
    rank0-first            rank 0 gets SIGINT, then SIGTERM (a second Ctrl-C, or torchrun's
                           stop), inside its write and ends; rank 1 is slower: it writes (making
                           the directory again) only after rank 0 removed it, and is stopped
                           (SIGTERM) before it sent its flag
    rank1-after-its-flag   rank 1 gets SIGINT once its `ok` flag reached rank 0; rank 0 renames
                           the output into place only after rank 1 stopped
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.model.convert import shared_output
from megatron_gspo.model.parallel import start_process_group
from megatron_gspo.outputs import signals_held

CASES = ("sigint", "sigterm", "rank0-first", "rank1-after-its-flag")
STOPPED = "rank1-stopped"  # the file rank 1 writes beside OUT's directory once it raised


def wait_for(done, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def stop(*signals: int) -> None:
    """`signals` come at once (blocked while sent): Python handles them in turn, SIGINT first."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    for sig in signals:
        os.kill(os.getpid(), sig)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    time.sleep(5)  # (the signal's exception lands here)


def write(tmp: Path, case: str) -> None:
    """This rank's share of the output, meeting the fault of `case` there."""
    rank = dist.get_rank()
    directory = tmp / "model"
    if case == "rank0-first" and rank == 1:
        # a rank inside a long write (C code: a signal waits until it returns)
        with signals_held():
            wait_for(lambda: not tmp.exists())  # rank 0 stopped and removed it
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(torch.arange(4), directory / f"weights{rank}.pt")
        stop(signal.SIGTERM)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(torch.arange(4), directory / f"weights{rank}.pt")
    if case in ("sigint", "sigterm"):
        stop(signal.SIGTERM if case == "sigterm" else signal.SIGINT)
    if case == "rank0-first":
        stop(signal.SIGINT, signal.SIGTERM)


def stop_rank1_after_its_flag(out: Path) -> None:
    """Rank 1: SIGINT right after its `ok` flag went out. Rank 0: the rename into place waits
    until rank 1 raised (whatever it did with the directory then)."""
    if dist.get_rank() == 1:
        gather = dist.all_gather_object

        def gather_then_stop(*args, **kwargs):
            gather(*args, **kwargs)
            stop(signal.SIGINT)

        dist.all_gather_object = gather_then_stop
        return
    replace = os.replace

    def held_replace(src, dst, *args, **kwargs):
        if Path(dst) == out:
            wait_for((out.parent.parent / STOPPED).exists)
        return replace(src, dst, *args, **kwargs)

    os.replace = held_replace


def main(out: Path, case: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (as the CLI's main has it)
    start_process_group()
    if case == "rank1-after-its-flag":
        stop_rank1_after_its_flag(out)
    try:
        with shared_output(out) as tmp:
            write(tmp, case)
    except BaseException:
        if case == "rank1-after-its-flag" and dist.get_rank() == 1:
            (out.parent.parent / STOPPED).touch()
            wait_for(out.exists, 10)
        raise


if __name__ == "__main__":
    assert sys.argv[2] in CASES, sys.argv[2]
    main(Path(sys.argv[1]), sys.argv[2])
