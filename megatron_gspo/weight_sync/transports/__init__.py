"""The weight-sync transports, one module each, chosen by `sync.method` through `TRANSPORTS`.
tensor (colocated, shared memory / CUDA IPC), distributed (a broadcast group per pipeline stage),
disk (safetensors versions loaded by the servers)."""

from __future__ import annotations

from megatron_gspo.weight_sync.config import SyncConfig
from megatron_gspo.weight_sync.transports.base import (
    PARTIAL,
    StageContext,
    Transport,
    TransportError,
)
from megatron_gspo.weight_sync.transports.disk import DiskTransport
from megatron_gspo.weight_sync.transports.distributed import DistributedTransport
from megatron_gspo.weight_sync.transports.tensor import TensorTransport

TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t for t in (TensorTransport, DistributedTransport, DiskTransport)
}

__all__ = [
    "PARTIAL",
    "TRANSPORTS",
    "DiskTransport",
    "DistributedTransport",
    "StageContext",
    "TensorTransport",
    "Transport",
    "TransportError",
    "make_transport",
]


def make_transport(config: SyncConfig) -> Transport:
    return TRANSPORTS[config.method]()
