"""A directory that several ranks write into, and which of them removes it when the write is cut
short (an error, SIGINT, SIGTERM). A checkpoint's save (train/checkpointing.py) and a
conversion's output (model/convert.py) both follow this one rule.

A signal stops every rank wherever it is, so no collective after it can be counted on: each rank
decides alone. Rank 0 always removes the half-write (it alone completes the directory, and only
once every rank's share came). Another rank removes it only if it stopped before it sent its
share: without that share rank 0 cannot complete the directory, and such a rank, still writing
when rank 0 removed it, may have made it again (DCP's writer makes its directory). A rank
stopped after sending its share leaves the directory to rank 0: it may be completed. The removal
is held against a second signal (a second Ctrl-C, torchrun's SIGTERM) that would cut it short too.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from megatron_gspo.outputs import signals_held


class HalfWrite:
    """Context manager around this rank's part of a write into `path`: left by an exception, it
    removes `path` where this rank still removes it (see the module's docstring). `path` may be
    set inside the block (None until then: nothing to remove)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.removes = True

    def __enter__(self) -> HalfWrite:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is not None and self.removes:
            self.remove()

    def gather(self, share: object) -> list:
        """Collective: every rank's share of the write, on every rank. Once this rank's share
        is on its way rank 0 may complete the directory: from here only rank 0 removes it. A
        rank with no share to send (None: its part failed) still removes it."""
        if share is not None:
            self.removes = dist.get_rank() == 0
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, share)
        return shares

    def remove(self) -> None:
        """Remove the directory now, a second signal held until it is gone."""
        if self.path is not None:
            with signals_held():
                shutil.rmtree(self.path, ignore_errors=True)
