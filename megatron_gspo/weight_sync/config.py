"""The weight sync's typed config and the rollout servers it updates."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from megatron_gspo.checks import choice, in_range, positive, seconds


class SyncMethod(StrEnum):
    TENSOR = "tensor"  # colocated: /update_weights_from_tensor (shared memory, CUDA IPC)
    DISTRIBUTED = "distributed"  # disaggregated: a broadcast group per pipeline stage
    DISK = "disk"  # safetensors versions + /update_weights_from_disk


TRANSPORTS: tuple[SyncMethod, ...] = tuple(SyncMethod)
MAX_BUCKET_MB = float(1 << 20)  # 1 TiB: a bucket's byte count stays an integer


@dataclass(frozen=True)
class SyncConfig:
    """The run config's `sync` section: how new policy weights reach the rollout servers. The
    method: tensor (colocated: /update_weights_from_tensor, shared memory on CPU, CUDA IPC on
    GPU), distributed (disaggregated: a broadcast group per pipeline stage, gloo on CPU, NCCL on
    GPU) or disk (safetensors shards + /update_weights_from_disk)."""

    method: SyncMethod = SyncMethod.TENSOR  # (above)
    bucket_mb: float = 512.0  # flattened bucket size; tensors larger than this go alone
    buffers: int = 2  # buckets in flight per sender: one is packed while the other is sent
    verify_every: int = 0  # compare probe log-probs with the servers' after every N-th sync
    # the mean |server - trainer| probe log-prob a verification accepts (null: by the server's
    # dtype: 1e-4 for float32, 0.049 for float16, 0.39 for bfloat16, 1.5 for fp8 weights;
    # weight_sync/verify.py)
    verify_tolerance: float | None = None
    probe_sequences: int = 4  # verify_every: the probe's sequences ...
    probe_length: int = 32  # ... their tokens ...
    probe_seed: int = 0  # ... and the seed that draws them
    # Disk versions, snapshots and the restore record live here. Unset: RUN_DIR/weights for a
    # run's disk method; otherwise a fresh directory in /dev/shm (memory, not disk), allowed
    # when the trainer is one node and every server local; WeightSync.close() removes it.
    dir: str | None = None
    snapshot_every: int = 0  # tensor/distributed: also write an HF snapshot every N syncs
    keep_versions: int = 2  # weight directories kept under `dir` (the base model never deleted)
    timeout_s: float = 600.0  # one HTTP request, one group rendezvous or broadcast
    pause_generation: bool = False  # pause in place during the update (else wait for requests)
    master_address: str | None = None  # distributed: address the servers reach the trainer at
    # distributed: keep each stage's update group from one sync to the next (an NCCL setup
    # across every server rank saved per sync; the communicators' buffers stay allocated on the
    # stage senders' and the servers' GPUs in between). false: a new group every sync.
    keep_groups: bool = True

    def check(self) -> None:
        choice(self.method, "sync.method", TRANSPORTS)
        in_range(self.bucket_mb, "sync.bucket_mb", 0, MAX_BUCKET_MB, lo_open=True)
        positive(self.buffers, "sync.buffers")
        for name in ("verify_every", "snapshot_every"):  # 0 turns it off
            in_range(getattr(self, name), f"sync.{name}", 0)
        if self.verify_tolerance is not None:
            in_range(self.verify_tolerance, "sync.verify_tolerance", 0, lo_open=True)
        positive(self.probe_sequences, "sync.probe_sequences")
        in_range(self.probe_length, "sync.probe_length", 2)
        in_range(self.probe_seed, "sync.probe_seed", 0)
        positive(self.keep_versions, "sync.keep_versions")
        seconds(self.timeout_s, "sync.timeout_s")

    def with_run_dir(self, run_dir: Path) -> SyncConfig:
        """This config for a run in `run_dir`: the disk method's versions under RUN_DIR/weights
        unless `dir` is given."""
        if self.dir is not None or self.method != SyncMethod.DISK:
            return self
        return replace(self, dir=str(run_dir / "weights"))

    @property
    def bucket_bytes(self) -> int:
        return max(int(self.bucket_mb * (1 << 20)), 1)


@dataclass(frozen=True)
class ServerRef:
    """One rollout server: its URL, how many TP ranks it has (one payload or group rank each),
    and the launcher's index of the node it runs on (None: unknown, taken as the trainer's own;
    the tensor transport relays to servers on other nodes, relay.py)."""

    url: str
    tp_size: int = 1
    api_key: str | None = None
    node: int | None = None

    @classmethod
    def of(cls, server: str | ServerRef) -> ServerRef:
        if isinstance(server, ServerRef):
            return server
        return cls(str(server).rstrip("/"))
