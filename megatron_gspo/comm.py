"""Small process-group helpers shared by the trainer's parts: this rank, rank 0's object to every
rank, one rank's refusal made every rank's, a free local port. No Megatron.

A `UserError` found by one rank alone (an input only rank 0 reads, a write that failed on one
rank) used to end that rank alone: the others waited in their next collective for it and died
there with gloo's "Connection closed by peer" traceback, which torchrun then named as the root
cause. Where the other ranks wait for rank 0's outcome anyway (a start's checks) `from_rank0`
hands it to them; anywhere else the refusing rank posts its line in torchrun's store before it
exits (`post_refusal`, entry.py), and a rank that fails or is stopped after that says the same
line (`posted_refusal`). Either way every rank ends on the one line and exit status 2.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megatron_gspo.errors import UserError

T = TypeVar("T")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def bcast(obj):
    """Rank 0's `obj` on every rank (itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_rank0(work: Callable[[], T]) -> T:
    """Collective: rank 0 runs `work` (what only it does: an input it alone reads, servers it
    alone starts) and every rank gets its result, or raises its UserError, the same line. Any
    other exception ends rank 0 alone, as it would have."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    box: list = [None]
    refused: UserError | None = None
    if dist.get_rank() == 0:
        try:
            box = [(True, work())]
        except UserError as e:
            refused, box = e, [(False, str(e))]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if refused is not None:
        raise refused
    if not ok:
        raise UserError(value)
    return value


def post_refusal(line: str) -> str:
    """Leave this rank's refusal (its one line) in the process group's store before the rank
    exits: another rank whose collective then fails because this one left, or which torchrun
    stops, finds it there (`posted_refusal`) and ends on the same line. The first one posted
    stays, and is returned: ranks refusing together (a full disk's free space measured a moment
    apart) say the one line."""
    store = _store()
    if store is None:
        return line
    try:
        return store.compare_set(_refusal_key(), "", line).decode()
    except Exception:  # noqa: BLE001 - no store left to tell: the others say their own
        return line


def posted_refusal() -> str | None:
    """The line a rank of this run posted (`post_refusal`) before it exited, if one did."""
    store = _store()
    if store is None:
        return None
    try:
        key = _refusal_key()
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store gone with its host: nothing to learn there
        return None


def _refusal_key() -> str:
    # (torchrun's agent keeps its store over a restart of the ranks: a key per attempt)
    return f"megatron_gspo/refusal/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    """The default process group's store where torchrun's agent holds it (it outlives the ranks;
    one rank 0 held is gone with rank 0, and a call to it fails with a C++ stack printed), None
    elsewhere and without a group of several ranks."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not agent or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return None if get is None else get()
    except Exception:  # noqa: BLE001 - (a torch without it: the ranks say their own errors)
        return None


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
