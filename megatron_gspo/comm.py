"""Small process-group helpers shared by the trainer's parts: this rank, rank 0's object to every
rank, a free local port. No Megatron."""

from __future__ import annotations

import random
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


_PICK = random.SystemRandom()  # (a seeded `random` would give every process the same picks)
LOWEST_PICKED = 10000
# SGLang picks the ports its children bind later (its nccl_port, where a TCP store listens) from
# 22000-29999 the same way: below that, a server's own pick cannot take the port picked for it
ABOVE_PICKED = 22000


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process that binds it a little later. Picked below
    the kernel's ephemeral range and SGLang's own range (`ABOVE_PICKED`) where there is room: the
    ports the kernel hands out meanwhile (a bind to port 0, as gloo's listeners do, or an
    outgoing connection) are never there, so only another picker can take the port before the
    bind."""
    high = min(ephemeral_range()[0], ABOVE_PICKED)
    if high - LOWEST_PICKED >= 1000:
        for _ in range(64):
            port = _PICK.randrange(LOWEST_PICKED, high)
            if bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the ports it picks itself (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def bindable(port: int) -> bool:
    """Whether a bind of 127.0.0.1:`port` succeeds now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
