"""Small process-group helpers shared by the trainer's parts: this rank, rank 0's object to every
rank, a free local port. No Megatron."""

from __future__ import annotations

import socket

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def bcast(obj):
    """Rank 0's `obj` on every rank (itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
