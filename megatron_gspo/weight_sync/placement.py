"""Where a sync's data lives, decided once for every trainer rank: the device of the buckets and
the directory of versions on disk. Rank 0 decides and broadcasts, so the ranks never disagree."""

from __future__ import annotations

import os
import tempfile
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_gspo.comm import bcast, rank
from megatron_gspo.errors import UserError
from megatron_gspo.weight_sync.servers import LOCAL_HOSTS, ServerError, Servers


def bucket_device(model_device: torch.device, servers: Servers) -> torch.device:
    """`model_device`, or the CPU when the model is on a GPU and a server says (in
    /get_server_info's `device`, as SGLang's server args do) that it runs on CPU. A server that
    does not say is taken to run where the trainer does. Rank 0 asks and every rank follows, so
    a server that answers one rank and not another cannot split the ranks over two devices."""
    if model_device.type == "cpu":
        return model_device
    on_cpu = bcast(_a_server_on_cpu(servers) if rank() == 0 else None)
    return torch.device("cpu") if on_cpu else model_device


def _a_server_on_cpu(servers: Servers) -> bool:
    for i in range(len(servers)):
        try:
            info = servers.get(i, "/get_server_info", timeout_s=30)
        except ServerError:
            continue  # a dead server is reported by the sync itself
        if str(info.get("device") or "").startswith("cpu"):
            return True
    return False


def shm_dir(servers: Servers) -> str:
    """A fresh directory in /dev/shm for versions on disk, named by the coordinator."""
    hosts = {urlparse(r.url).hostname for r in servers.refs}
    world = dist.get_world_size() if dist.is_initialized() else 1
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    if not (os.path.isdir("/dev/shm") and one_node and hosts <= LOCAL_HOSTS):
        raise UserError(
            "sync.dir is required for the disk transport and for snapshots unless the trainer "
            "is one node with local servers (then /dev/shm is used); set it to a directory "
            "every trainer rank and server can read"
        )
    path = tempfile.mkdtemp(prefix="megatron-gspo-sync-", dir="/dev/shm") if rank() == 0 else None
    return bcast(path)


def enter_thread(device: torch.device) -> None:
    """Run the calling (new) thread on `device`, with a CUDA stream of its own. Threads that
    share a stream run their NCCL work in the order it was queued across all of them: a relay
    waiting in one stage's group would hold up this rank's gathers and its fan-out of another
    stage, while the rank on the other node does the same the other way round."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a new thread starts on device 0
        torch.cuda.set_stream(torch.cuda.Stream(device))
