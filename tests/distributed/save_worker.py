"""Worker for the checkpoint-save tests: step 1 saved whole, then the save of step 2 cut short on
two ranks as CASE says (an injected fault: the signal a Ctrl-C or torchrun would send, sent by the
rank to itself at a chosen point).

torchrun --nproc-per-node 2 tests/distributed/save_worker.py RUN_DIR CASE

    sigint, sigterm        every rank gets the signal inside its model write
    rank0-first            rank 0 gets SIGINT inside its model write; rank 1 is slower and
                           writes its model files (making their directory, as DCP's writer does)
                           only after rank 0 removed the save's directory
    rank1-after-its-share  rank 1 gets SIGINT once its share of the manifest reached rank 0;
                           rank 0 renames the checkpoint into place only after rank 1 stopped
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.model.parallel import start_process_group
from megatron_gspo.train import checkpointing

CASES = ("sigint", "sigterm", "rank0-first", "rank1-after-its-share")
STOPPED = "rank1-stopped"  # the file rank 1 writes beside RUN_DIR once its save raised


def wait_for(done, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


class Files:
    """Writes model/ as Actor.save does (what the files hold is not what is checked), and for
    step 2 meets the fault of `case` there."""

    def __init__(self, case: str | None):
        self.case = case

    def save(self, directory: Path) -> None:
        rank = dist.get_rank()
        if self.case == "rank0-first" and rank == 1:
            wait_for(lambda: not directory.parent.exists())  # rank 0 stopped and removed it
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(torch.arange(4), directory / f"weights{rank}.pt")
        if self.case in ("sigint", "sigterm") or (self.case == "rank0-first" and rank == 0):
            os.kill(os.getpid(), signal.SIGTERM if self.case == "sigterm" else signal.SIGINT)
            time.sleep(5)  # (the signal's exception lands here)


def stop_rank1_after_its_share(run_dir: Path) -> None:
    """Rank 1: SIGINT right after its share of the manifest went out. Rank 0: the rename into
    place waits until rank 1's save raised (whatever it did with the directory then)."""
    if dist.get_rank() == 1:
        gather = dist.all_gather_object

        def gather_then_stop(*args, **kwargs):
            gather(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)

        dist.all_gather_object = gather_then_stop
        return
    replace, final = os.replace, run_dir / "checkpoints" / "step_2"

    def held_replace(src, dst, *args, **kwargs):
        if Path(dst) == final:
            wait_for((run_dir.parent / STOPPED).exists)
        return replace(src, dst, *args, **kwargs)

    os.replace = held_replace


def main(run_dir: Path, case: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (as the CLI's main has it)
    start_process_group()
    checkpointing.save(Files(None), run_dir, 1, {"step": 1}, keep=5)
    if case == "rank1-after-its-share":
        stop_rank1_after_its_share(run_dir)
    try:
        checkpointing.save(Files(case), run_dir, 2, {"step": 2}, keep=5)
    except BaseException:
        if dist.get_rank() == 1:
            (run_dir.parent / STOPPED).touch()
            wait_for((run_dir / "checkpoints" / "step_2").exists, 10)
        raise


if __name__ == "__main__":
    assert sys.argv[2] in CASES, sys.argv[2]
    main(Path(sys.argv[1]), sys.argv[2])
