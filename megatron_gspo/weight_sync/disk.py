"""The disk transport and snapshots: buckets written as safetensors shards, then loaded by
/update_weights_from_disk; and the restore point a failed sync brings servers back to.

A version is the directory `DIR/v{version}`: one shard per bucket (`model-s{stage}-{index}`, the
bucket's tensors back to back behind a safetensors header that also records their checksum over
every byte), the index, and the base model's config and tokenizer. A bucket lent from the
trainer's parameter buffer is written straight from it; two shards are written at a time (the
file system takes one file's writes one at a time). Stage senders write into
`DIR/.v{version}.tmp`; the coordinator renames it when every stage is done, so a server never
reads a half-written version. `DIR/restore.json` names the last complete version (the base model
the servers started from until then) and the directories this sync created, of which the newest
`keep_versions` are kept. DIR must be visible to every trainer rank and every server.

A new version reuses the directory of the oldest one it would evict (never the restore point):
that directory is renamed to the temporary one and its shards are overwritten in place, so the
file system neither allocates fresh pages nor frees the old ones during a sync (each costs about
as much as writing the bytes; deleting a 1 GB version on a busy disk took seconds). A failed sync
discards that directory, so it costs one old version, never the restore point.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gspo.hf import io as hf_io
from megatron_gspo.hf.io import ST_DTYPES
from megatron_gspo.weight_sync.bucket import Bucket, checksum, checksum_parts


def write_shard(path: Path, bucket: Bucket) -> None:
    """The bucket as a safetensors file: its tensors back to back behind the header, which also
    records their checksum over every byte."""
    _write(path, *_layout(bucket))


def _layout(bucket: Bucket) -> tuple[list[torch.Tensor], dict]:
    """The bytes a bucket's shard holds, in order, and its header. A packed bucket's offsets
    are already safetensors data offsets; a borrowed one's tensors (spans of the trainer's
    parameter buffer, possibly with gaps between them) go one after another."""
    if bucket.borrowed:
        parts = [bucket.flat[m.start_idx : m.end_idx] for m in bucket.metadata]
        ends = list(itertools.accumulate(p.numel() for p in parts))
        offsets = list(zip([0, *ends[:-1]], ends))
    else:
        parts = [bucket.flat]
        offsets = [(m.start_idx, m.end_idx) for m in bucket.metadata]
    header: dict = {"__metadata__": {"format": "pt"}}
    for m, (start, end) in zip(bucket.metadata, offsets):
        header[m.name] = {
            "dtype": ST_DTYPES[m.dtype],
            "shape": list(m.shape),
            "data_offsets": [start, end],
        }
    return [p.cpu() for p in parts], header


def _write(path: Path, parts: list[torch.Tensor], header: dict) -> None:
    """Write `parts` behind `header`, which gets their checksum over every byte."""
    header["__metadata__"]["checksum"] = str(checksum_parts(parts))  # files rot byte by byte
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    # Overwrite an existing file in place (a recycled version's shard): no truncate first.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    with open(fd, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for part in parts:
            f.write(memoryview(part.numpy()))
        f.truncate(f.tell())


def verify_shard(path: Path) -> None:
    """Raise ValueError if a shard's bytes do not match the checksum in its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    want = header.get("__metadata__", {}).get("checksum")
    if want is not None and checksum(data, every_byte=True) != int(want):
        raise ValueError(f"{path} does not match its checksum: the file is damaged")


class ShardWriter:
    """A stage sender's shards of one version, written `threads` at a time (separate files
    write in parallel; one file's writes queue on its inode). A borrowed bucket (views of the
    trainer's parameters, unchanged until the sync ends) is queued and written in the
    background; a packed one before `write` returns, since its buffer is reused after. `flush`
    waits for all of them and raises the first failure."""

    def __init__(self, tmp_dir: Path, stage: int, threads: int = 2):
        self.dir, self.stage = tmp_dir, stage
        self.weight_map: dict[str, str] = {}
        self.nbytes = 0
        self._pool = ThreadPoolExecutor(threads, "shard-writer")
        self._pending: list[Future] = []

    def write(self, bucket: Bucket) -> None:
        name = f"model-s{self.stage:02d}-{bucket.index:05d}.safetensors"
        done = self._pool.submit(_write, self.dir / name, *_layout(bucket))
        if bucket.borrowed:  # views of the parameters: as many may wait as there are
            self._pending.append(done)
        else:
            done.result()
        if self._pending and self._pending[0].done():
            self._pending.pop(0).result()  # a failure shows up early
        self.weight_map.update({m.name: name for m in bucket.metadata})
        self.nbytes += bucket.nbytes

    def flush(self) -> None:
        try:
            while self._pending:
                self._pending.pop(0).result()
        finally:
            for f in self._pending:
                f.cancel()
            self._pool.shutdown(wait=True)

    def outcome(self) -> dict:
        return {"weight_map": self.weight_map, "bytes": self.nbytes}


@dataclass
class RestorePoint:
    path: str
    version: str


class VersionDirs:
    """Version directories under `root` and the restore record."""

    def __init__(self, root: str | os.PathLike, keep: int, base: RestorePoint):
        # absolute: a version's path goes to the servers as their model_path, and servers
        # someone else started (rollout.urls) run in another working directory than the
        # trainer, whose run directory may be relative (`train` defaults to runs/NAME)
        self.root, self.keep = Path(root).absolute(), keep
        self.record = self.root / "restore.json"
        self.restore, self.created = base, []
        if self.record.is_file():  # a restarted trainer continues from what the last one wrote
            saved = json.loads(self.record.read_text())
            # A run directory copied to branch a run carries a record naming the versions of the
            # run it was copied from: only directories under this root are ours to delete, and
            # only one of ours is a restore point, since that run may delete its own. Without
            # one a restarted server starts on the base model and the trainer's catch_up brings
            # it to the current weights, as before this run's first sync.
            if self._ours(saved["path"]):
                self.restore = RestorePoint(saved["path"], saved["version"])
            self.created = [p for p in saved.get("created", []) if self._ours(p)]

    def tmp(self, version: str) -> Path:
        return self.root / f".v{version}.tmp"

    def start(self, version: str) -> Path:
        """The temporary directory for `version` (on the coordinator, before the senders): the
        oldest version's directory when this one would evict it, else a fresh one."""
        tmp = self.tmp(version)
        shutil.rmtree(tmp, ignore_errors=True)
        old = self._recyclable()
        if old is not None:
            self.created.remove(old)
            os.replace(old, tmp)
        else:
            tmp.mkdir(parents=True)
        return tmp

    def _ours(self, path: str) -> bool:
        """Whether `path` is a version directory under this root, however either is spelled
        (a run directory given as a relative path one time and an absolute one the next)."""
        return Path(path).resolve().parent == self.root.resolve()

    def _recyclable(self) -> str | None:
        if len(self.created) < self.keep or self.created[0] == self.restore.path:
            return None
        old = self.created[0]
        return old if self._ours(old) and Path(old).is_dir() else None

    def finish(self, version: str, outcomes: list[dict], base_model: Path) -> Path:
        """Index the stages' shards, add config and tokenizer, rename into place."""
        tmp, out = self.tmp(version), self.root / f"v{version}"
        weight_map, total = {}, 0
        for o in outcomes:
            weight_map.update(o["weight_map"])
            total += o["bytes"]
        shards = set(weight_map.values())
        for stale in tmp.glob("*.safetensors"):  # a recycled directory's leftovers
            if stale.name not in shards:
                stale.unlink()
        hf_io.write_index(tmp, weight_map, total)
        hf_io.copy_model_files(base_model, tmp)  # (config.json naming the weights' dtype)
        tmp.chmod(0o755)
        if out.exists():  # a retried version: the new files replace the old
            shutil.rmtree(out)
        os.replace(tmp, out)
        return out

    def discard(self, version: str) -> None:
        shutil.rmtree(self.tmp(version), ignore_errors=True)

    def set_restore(self, point: RestorePoint) -> None:
        self.restore = point
        if point.path not in self.created and self._ours(point.path):
            self.created.append(point.path)
        while len(self.created) > self.keep:
            old = self.created.pop(0)
            if old != point.path and self._ours(old):
                shutil.rmtree(old, ignore_errors=True)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps({**point.__dict__, "created": self.created}, indent=2) + "\n")
        os.replace(tmp, self.record)

    def check(self, path: str | os.PathLike) -> None:
        """Raise ValueError if any shard under `path` fails its checksum."""
        for shard in sorted(Path(path).glob("*.safetensors")):
            verify_shard(shard)
