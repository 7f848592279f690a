"""Reading megatron's distributed checkpoints without megatron's loader or a model: tensors
mapped straight from the files where they lie (DistCheckpointReader)."""

from __future__ import annotations

import collections
import io
import math
import mmap
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch

from megatron_gspo.errors import UserError


class DistCheckpointReader:
    """Read regions of the tensors of a torch_dist dist-checkpoint directly from its files.

    Each file is memory-mapped and a stored chunk comes back as a view of the mapping (no read, no
    copy; an item in another form falls back to torch.load). A region held whole by one chunk is a
    view of it; a region spread over chunks is assembled into a new tensor.
    """

    def __init__(self, directory: str | Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(directory)
        try:
            md = FileSystemReader(str(self.path)).read_metadata()
        except Exception as e:
            raise UserError(f"cannot read dist-checkpoint {self.path} ({e}); re-copy it") from None
        self.tensors = {
            k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        self._where = {(i.fqn, tuple(i.offset)): info for i, info in md.storage_data.items()}
        self._files: dict[str, tuple] = {}  # file name -> (open file, its mapping or None)
        self._last = None  # (key, chunk offsets, tensor): the chunk most recently loaded

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def where(self, key: str) -> tuple[str, int]:
        """(file, offset) of the first chunk of `key`, to read in file order."""
        info = self._where[(key, tuple(self.tensors[key].chunks[0].offsets))]
        return info.relative_path, info.offset

    def read(self, key: str, offsets=None, sizes=None) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of tensor `key` (all of it by default)."""
        md = self.tensors[key]
        offsets = tuple(offsets or (0,) * len(md.size))
        sizes = tuple(sizes or md.size)
        ends = [o + n for o, n in zip(offsets, sizes)]
        chunks = [
            c
            for c in md.chunks
            if all(
                co < e and o < co + cs for co, cs, o, e in zip(c.offsets, c.sizes, offsets, ends)
            )
        ]
        out, covered = None, 0
        for c in chunks:
            src = self._chunk(key, c)
            box = [
                (max(o, co), min(e, co + cs))
                for o, e, co, cs in zip(offsets, ends, c.offsets, c.sizes)
            ]
            for d, (lo, hi) in enumerate(box):
                src = src.narrow(d, lo - c.offsets[d], hi - lo)
            if len(chunks) == 1 and src.shape == sizes:
                return src
            if out is None:
                out = torch.empty(sizes, dtype=md.properties.dtype)
            dst = out
            for d, (lo, hi) in enumerate(box):
                dst = dst.narrow(d, lo - offsets[d], hi - lo)
            dst.copy_(src)
            covered += src.numel()
        if covered != math.prod(sizes):
            raise UserError(
                f"dist-checkpoint {self.path} is incomplete: {key} has gaps; re-copy it"
            )
        return out

    def _chunk(self, key: str, chunk) -> torch.Tensor:
        offsets = tuple(chunk.offsets)
        if self._last is not None and self._last[:2] == (key, offsets):
            return self._last[2]
        info = self._where.get((key, offsets))
        if info is None or info.transform_descriptors:
            raise UserError(f"dist-checkpoint {self.path}: {key} {offsets} is unreadable here")
        dtype, sizes = self.tensors[key].properties.dtype, tuple(chunk.sizes)
        try:
            f, mm = self._open(info.relative_path)
            item = _FileSlice(f, info.offset, info.length)
            t = _mapped_tensor(item, mm, dtype, sizes)
            if t is None:
                item.seek(0)
                t = torch.load(item, weights_only=True)
        except Exception as e:
            raise UserError(
                f"reading {key} from {self.path / info.relative_path} failed ({e}); the file is "
                "truncated or corrupt, re-copy it"
            ) from None
        if tuple(t.shape) != sizes or t.dtype != dtype:
            raise UserError(f"dist-checkpoint {self.path}: {key} {offsets} has a wrong shape")
        self._last = (key, offsets, t)
        return t

    def _open(self, name: str):
        if name not in self._files:
            f = open(self.path / name, "rb", buffering=0)
            try:  # copy-on-write: tensors are views of the page cache, writable, never written back
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                mm = None
            self._files[name] = (f, mm)
        return self._files[name]

    def close(self) -> None:
        """Close the files; tensors already read stay valid (they hold their mapping)."""
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
        self._last = None


def _mapped_tensor(item: _FileSlice, mm, dtype: torch.dtype, sizes: tuple) -> torch.Tensor | None:
    """One DCP item (a `torch.save` zip of one tensor) as a view of the mapped file, without
    reading it: its layout from data.pkl, its bytes where the zip stores them. None for anything
    but one contiguous little-endian tensor stored uncompressed (torch.load reads those)."""
    if mm is None or sys.byteorder != "little" or math.prod(sizes) == 0:
        return None
    try:
        with zipfile.ZipFile(item) as zf:
            records = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
    except zipfile.BadZipFile:
        return None
    if "byteorder" in records and _record(item, records["byteorder"]) != b"little":
        return None
    try:
        layout = _LayoutUnpickler(io.BytesIO(_record(item, records["data.pkl"]))).load()
        (_, storage_type, name, _, _), offset, size, stride = layout
        stored = storage_type._dtype
    except Exception:
        return None
    data = records.get(f"data/{name}")
    contiguous = [math.prod(size[i + 1 :]) for i in range(len(size))]
    numel = math.prod(size)
    if (
        data is None
        or data.compress_type != zipfile.ZIP_STORED
        or stored != dtype
        or size != sizes
        or any(st != c for st, c, n in zip(stride, contiguous, size) if n > 1)
        or (offset + numel) * dtype.itemsize > data.file_size
    ):
        return None
    start = item.start + _record_start(item, data) + offset * dtype.itemsize
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=start).view(sizes)


def _record_start(item: _FileSlice, info: zipfile.ZipInfo) -> int:
    """Where a stored zip record's bytes begin (after its local header)."""
    item.seek(info.header_offset)
    head = item.read(30)
    if head[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _record(item: _FileSlice, info: zipfile.ZipInfo) -> bytes:
    """A small stored record's bytes (read as stored: torch.save may leave CRCs unset)."""
    item.seek(_record_start(item, info))
    return item.read(info.file_size)


class _LayoutUnpickler(pickle.Unpickler):
    """Unpickles a torch.save data.pkl of one tensor into (storage id, offset, size, stride)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (
                storage,
                offset,
                tuple(size),
                tuple(stride),
            )
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor")

    def persistent_load(self, pid):
        return pid  # ("storage", storage type, record name, location, numel)


class _FileSlice(io.RawIOBase):
    """The bytes [start, start + length) of an open file as a seekable stream of their own
    (what torch.load needs to read one item of a DCP file)."""

    def __init__(self, f: io.FileIO, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf).cast("B")[:n])
        self.pos += got
        return got
