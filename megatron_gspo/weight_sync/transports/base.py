"""The transport interface: how a stage sender's buckets reach the servers.

    open_stage(ctx)       before the stage's first bucket (distributed: join the stage's group)
    send(bucket, ctx)     one bucket to every live server: {server index: error} for those that
                          failed; raises TransportError when the trainer side failed (all affected)
    close_stage(ctx)      after the last bucket, also after a failure
    commit(...)           on the coordinator, after every stage (disk: the servers load the files)

What differs between transports beyond sending (where buckets live, how the parameter buffer is
lent, relays, gapless buckets, stage turns) is a method or a class attribute here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_gspo.weight_sync import gather
from megatron_gspo.weight_sync.bucket import Bucket
from megatron_gspo.weight_sync.config import SyncConfig
from megatron_gspo.weight_sync.placement import bucket_device
from megatron_gspo.weight_sync.servers import Servers

PARTIAL = "partial:"  # weight_version prefix a server carries while an update is incomplete


class TransportError(RuntimeError):
    """The trainer's side of a transfer failed: every server of the stage may be half-updated."""


@dataclass
class StageContext:
    """One stage sender's view of one sync; `live` shrinks as servers fail."""

    servers: Servers
    config: SyncConfig
    version: str
    stage: int
    live: list[int]
    touched: set[int] = field(default_factory=set)  # servers that were sent at least one bucket
    failed: dict[int, str] = field(default_factory=dict)
    buckets: int = 0
    device: torch.device = torch.device("cpu")  # where the buckets are
    state: dict = field(default_factory=dict)  # the transport's own per-stage state

    def fail(self, errors: dict[int, str]) -> None:
        for i, msg in errors.items():
            self.failed.setdefault(i, msg)
            if i in self.live:
                self.live.remove(i)

    def version_for_bucket(self) -> str | None:
        """The first bucket marks the servers as mid-update; the commit sets the real version."""
        return PARTIAL + self.version if self.buckets == 0 else None


class Transport:
    name = "base"
    needs_session = True  # wrap in /begin_weight_update + /end_weight_update
    writes_files = False  # the stage senders' shard writers are the transfer (disk)
    gapless = False  # a lent bucket must be tensors back to back (the receiver lays it out)
    stages_in_turn = False  # pipeline stages send one after another, in stage order
    relays = False  # servers on other nodes get their buckets through a trainer rank there

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def bucket_device(self, model_device: torch.device, servers: Servers) -> torch.device:
        """Where the buckets live (every rank calls it: a collective on a GPU)."""
        return bucket_device(model_device, servers)

    def lend(self, chunks: list) -> object:
        """On the stage sender, what its parameter buffer is lent as instead of being copied
        into buckets (bucket.py): here to the broadcast or the shard writer, as a plain buffer."""
        return gather.buffer_parameters(chunks)

    def open_stage(self, ctx: StageContext) -> None:
        pass

    def send(self, bucket: Bucket, ctx: StageContext) -> dict[int, str]:
        raise NotImplementedError

    def close_stage(self, ctx: StageContext) -> None:
        pass

    def close(self, servers: Servers) -> None:
        """When the sync object closes: let go of what was kept between syncs."""

    def commit(self, servers: Servers, live: list[int], version: str, new_dir: Path | None):
        """On the coordinator once every stage is sent: make `version` current on `live`
        (`new_dir`: this version written to disk, if it was). Returns {server index: error}."""
        _, errors = servers.post_many(live, "/update_weight_version", {"new_version": version})
        return errors
