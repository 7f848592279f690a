"""The disk transport: the stage senders' shard writers write the version (weight_sync/disk.py);
the commit has every server load it with /update_weights_from_disk."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_gspo.weight_sync.bucket import Bucket
from megatron_gspo.weight_sync.servers import Servers
from megatron_gspo.weight_sync.transports.base import StageContext, Transport


class DiskTransport(Transport):
    """The stage senders' shard writers (see sync.py) do the sending; the commit has every
    server load the finished version directory."""

    name = "disk"
    needs_session = False  # /update_weights_from_disk needs no begin/end session
    writes_files = True

    def bucket_device(self, model_device: torch.device, servers: Servers) -> torch.device:
        return torch.device("cpu")  # the shard writer writes from CPU memory

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        # A GPU trainer's buckets in pinned memory: the copies out of the GPU run at full speed.
        pin = device.type == "cpu" and torch.cuda.is_available()
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)

    def send(self, bucket: Bucket, ctx: StageContext) -> dict[int, str]:
        return {}

    def commit(self, servers: Servers, live: list[int], version: str, new_dir: Path | None):
        body = {"model_path": str(new_dir), "weight_version": version, "flush_cache": True}
        _, errors = servers.post_many(live, "/update_weights_from_disk", body)
        return errors
