"""A disk that runs full under a write: said in one line (`full_line`), never as the traceback of
the error it comes out as.

Python raises OSError(ENOSPC) where it writes (the state file, the manifest, metrics.jsonl).
torch's checkpoint writer hides it: its zip writer calls the file's `write`, and when that raises
it fails on its own bookkeeping instead ("RuntimeError: [enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598"), the OSError left only as that error's `__context__`; DCP then
carries the error to every rank without it. So the trainer's checkpoint writer raises that OSError
in its place (`hidden_os_error`, model/checkpoint.py) and every rank sees ENOSPC. A torch write
error with no errno behind it (a file torch opened itself: "file write failed") is taken for a
full disk where less than FULL_BELOW is free on the disk it wrote to.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from megatron_gspo.errors import in_context

FULL_BELOW = 16 << 20  # free bytes under which a torch write error is the disk running full
TORCH_WRITE_ERRORS = ("unexpected pos", "file write failed")


def hidden_os_error(e: BaseException) -> OSError | None:
    """The OSError that torch's zip writer turned into `e` ("unexpected pos"), found as the
    context it left; None where there is none."""
    return in_context(e, OSError)


def disk_full(e: BaseException, where: Path) -> bool:
    """Whether `e`, raised writing under `where`, is the disk running full: ENOSPC in it (what it
    was raised from or during, each rank's failure of a DCP CheckpointException), or a torch
    write error while less than FULL_BELOW is free there."""
    errors = _errors(e)
    if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in errors):
        return True
    torch_write = any(isinstance(x, RuntimeError) and any(t in str(x) for t in TORCH_WRITE_ERRORS)
                      for x in errors)  # fmt: skip
    return torch_write and free_bytes(where) < FULL_BELOW


def full_line(where: Path, what: str, last: Path | None) -> str:
    """The line for the disk holding `where` full while writing `what`; `last`: the run's last
    complete checkpoint, which the failed write left as it was (None: the run has none)."""
    free = free_bytes(where) / (1 << 20)
    if last is None:
        fix = "free space and run the same command again (the run has no checkpoint yet)"
    else:
        fix = (f"free space ({last.name}, the last complete checkpoint, is intact) and rerun "
               "with --resume")  # fmt: skip
    return f"the disk holding {where} is full ({free:.1f} MiB free) writing {what}; {fix}"


def free_bytes(where: Path) -> int:
    """Bytes free to this user on the disk holding `where` (its nearest existing parent)."""
    path = Path(where).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _errors(e: BaseException) -> list[BaseException]:
    """`e`, the exceptions it was raised from or during, and, for DCP's CheckpointException,
    each rank's failure (a pair: the exception and its stack) and theirs."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in found):
            continue
        found.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found
