"""Flattened buckets: HF-named tensors packed back to back into one reusable uint8 buffer.

The layout is SGLang's `flattened_bucket` (REFERENCE.md §2): `flattened_tensor` is the bucket's
bytes, and each metadata entry has name, shape, dtype and byte offsets start_idx/end_idx, with
`numel` counting bytes as SGLang's FlattenedTensorBucket does. Offsets are contiguous (the
receiver of a distributed update recomputes them from names, dtypes and shapes), so a tensor that
would start misaligned for its dtype (possible only with mixed dtypes) starts a new bucket.

Each bucket carries a checksum: the wrapping int64 sum of its bytes read as little-endian 64-bit
words (zero-padded), plus the byte count; it is not a cryptographic hash. Every word counts up to
64 KiB; beyond that one word of each 4 KiB page (at an offset that moves from page to page) and
every word after the last whole page, so it costs about 1/500 of a pass over the bytes instead
of a whole one (a full pass costs as much as a third of the sync's copying). That still catches
a lost, stale, zeroed or truncated page and any change of length, which is how a bucket goes bad
in shared memory; a shard on disk, whose bytes can rot one by one, is checked every byte
(`checksum(flat, every_byte=True)`, disk.py).

Buffers come from a small pool and go back when the transport has handed the bucket over, so a
sender holds `buffers` buckets at most; a tensor larger than a bucket gets a buffer of its own.

Borrowed buckets (`pack(..., borrow=...)`, every transport on CPU): a tensor that already
lives, contiguous, in the trainer's parameter buffer (in shared memory once
`gather.share_parameters` has moved it there, for the tensor transport) is not copied at all.
Its bucket's `flat` is the span of that storage that covers its tensors, and the metadata points
at each tensor's bytes inside the span (SGLang reads each entry by its start_idx/end_idx, so the
gaps between them are never read; the disk transport's writer writes the entries one after
another). A distributed receiver lays a bucket out from names, dtypes and shapes alone, so
there (`gapless`) a bucket is one run of adjacent tensors in offset order. The server, or the
shard file, then gets every such byte once, straight from the trainer's weights. Such a bucket
must only be read while the weights do not change, which holds for a sync: training waits for
it. Buckets are numbered in the order they are sealed (shard files are named by it).
"""

from __future__ import annotations

import itertools
import queue
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

Alloc = Callable[[int], torch.Tensor]  # bytes -> uint8 buffer (shared memory, GPU, ...)


PAGE_WORDS = 512  # 4 KiB
EVERY_WORD_UP_TO = 64 << 10


def checksum(flat: torch.Tensor, every_byte: bool = False) -> int:
    """int64 wrapping sum of `flat`'s 64-bit words (tail zero-padded), xor'd with its length;
    above 64 KiB (unless `every_byte`) of one word per 4 KiB page and the words after them."""
    return _wrap(_word_sum(flat, every_byte)) ^ flat.numel()


def checksum_parts(parts: list[torch.Tensor]) -> int:
    """`checksum(torch.cat(parts), every_byte=True)` without the copy, when every part but the
    last is a whole number of words (else the parts are joined first)."""
    if any(p.numel() % 8 for p in parts[:-1]):
        return checksum(torch.cat(parts), every_byte=True)
    return _wrap(sum(_word_sum(p, True) for p in parts)) ^ sum(p.numel() for p in parts)


def _word_sum(flat: torch.Tensor, every_byte: bool) -> int:
    n = flat.numel()
    n8 = n - n % 8
    total = 0
    if n8:
        body = flat[:n8]
        if body.storage_offset() % 8:
            body = body.clone()
        words = body.view(torch.int64)
        if every_byte or n8 <= EVERY_WORD_UP_TO:
            total = int(words.sum())
        else:
            pages = n8 // 8 // PAGE_WORDS
            p = torch.arange(pages, device=words.device)
            total = int(words[p * PAGE_WORDS + (p * 61) % PAGE_WORDS].sum())
            total += int(words[pages * PAGE_WORDS :].sum())
    if n8 != n:
        tail = bytes(flat[n8:].cpu().tolist()) + bytes(8 - (n - n8))
        total += int.from_bytes(tail, "little", signed=True)
    return total


def _wrap(total: int) -> int:
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)  # wrap like the int64 sum


@dataclass
class Bucket:
    """One packed bucket of a pipeline stage. `buffer[:nbytes]` holds the tensors' bytes."""

    stage: int
    index: int
    buffer: torch.Tensor
    nbytes: int = 0
    metadata: list[types.SimpleNamespace] = field(default_factory=list)
    checksum: int | None = None  # see sum()
    pooled: bool = True  # False: an oversized tensor's own buffer (BufferPool.take_big)
    borrowed: bool = False  # True: `buffer` is a span of shared storage the tensors live in

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer if self.borrowed else self.buffer[: self.nbytes]

    def payload(self) -> dict:
        """SGLang's flattened_bucket object: {flattened_tensor, metadata}."""
        return {"flattened_tensor": self.flat, "metadata": self.metadata}

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return unflatten(self.flat, self.metadata)

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        dst = self.buffer[self.nbytes : self.nbytes + n].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=dst.is_cuda)  # GPU to CPU: done when it returns
        self.metadata.append(
            types.SimpleNamespace(
                name=name, shape=torch.Size(t.shape), dtype=t.dtype,
                start_idx=self.nbytes, end_idx=self.nbytes + n, numel=n,
            )
        )  # fmt: skip
        self.nbytes += n

    def fits(self, t: torch.Tensor) -> bool:
        if self.borrowed:
            return self.nbytes + t.numel() * t.element_size() <= self.buffer.numel()
        if not self.pooled:  # an oversized tensor's buffer holds that tensor alone
            return False
        n = t.numel() * t.element_size()
        return self.nbytes + n <= self.buffer.numel() and self.nbytes % t.element_size() == 0

    def seal(self, index: int | None = None) -> Bucket:
        """The bucket, complete (on a GPU: its copies done); numbered `index` if given."""
        if index is not None:
            self.index = index
        if self.buffer.is_cuda:  # the stream this thread copied on, on the buffer's device
            torch.cuda.current_stream(self.buffer.device).synchronize()
        return self

    def sum(self) -> int:
        """The checksum, computed once. Transports compute it while the servers read the
        bucket, so it costs no time on the critical path."""
        if self.checksum is None:
            self.checksum = checksum(self.flat)
        return self.checksum


def unflatten(flat: torch.Tensor, metadata: Iterable) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (views into `flat`)."""
    return [
        (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(tuple(m.shape)))
        for m in metadata
    ]


class BufferPool:
    """`size` reusable buffers of `capacity` bytes, allocated on first use by `alloc`.

    A tensor larger than `capacity` gets a buffer of its own (`take_big`); those are kept too
    (at most `size`, the largest) and reused by later syncs, because allocating shared memory
    costs as much as copying the bytes twice.
    """

    def __init__(self, capacity: int, size: int, alloc: Alloc):
        self.capacity, self.size, self.alloc = capacity, size, alloc
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._made = 0
        self._big: list[torch.Tensor] = []  # free oversized buffers, smallest first
        self._big_lock = threading.Lock()

    def take(self, timeout_s: float | None = None) -> torch.Tensor:
        """A free buffer, a new one while fewer than `size` exist (counted once it exists: a
        failed allocation takes no place), else the next one given back (queue.Empty after
        `timeout_s`)."""
        if self._free.empty() and self._made < self.size:
            buf = self.alloc(self.capacity)
            self._made += 1
            return buf
        return self._free.get(timeout=timeout_s)

    def give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def take_big(self, nbytes: int) -> torch.Tensor:
        with self._big_lock:
            for i, buf in enumerate(self._big):
                if buf.numel() >= nbytes:
                    return self._big.pop(i)
        return self.alloc(nbytes)

    def give_big(self, buf: torch.Tensor) -> None:
        with self._big_lock:
            self._big.append(buf)
            self._big.sort(key=torch.Tensor.numel)
            del self._big[: max(len(self._big) - self.size, 0)]


def pack(
    named: Iterable[tuple[str, torch.Tensor]],
    pool: BufferPool,
    stage: int = 0,
    borrow: Callable[[torch.Tensor], bool] | None = None,
    gapless: bool = False,
) -> Iterator[Bucket]:
    """Buckets of `named`, each complete (on GPU: copied) when it is yielded. The consumer must
    `release` every bucket, or packing stalls once the pool is empty.

    `borrow(t)` True: `t` (contiguous, in the trainer's parameter buffer) goes into a borrowed
    bucket of its storage instead of being copied; those fill up to the pool's capacity too.
    `gapless`: a borrowed bucket is one run of adjacent tensors in offset order, so that it is
    a flattened bucket its receiver can lay out from names, dtypes and shapes alone (the
    distributed transport); a span with gaps becomes one bucket per run."""
    cur: Bucket | None = None
    spans: dict[int, _Span] = {}  # storage -> the borrowed bucket being filled
    index = itertools.count()  # numbered as sealed: shard files are named by it
    for name, t in named:
        if borrow is not None and borrow(t):
            key = t.untyped_storage().data_ptr()
            span = spans.get(key)
            if span is not None and not span.fits(t, pool.capacity):
                yield from span.seal(stage, index, gapless)
                span = None
            if span is None:
                span = spans[key] = _Span(t.untyped_storage())
            span.add(name, t)
            continue
        n = t.numel() * t.element_size()
        if cur is not None and not cur.fits(t):
            yield cur.seal(next(index))
            cur = None
        if cur is None:
            if n > pool.capacity:
                cur = Bucket(stage, -1, pool.take_big(n), pooled=False)
            else:
                cur = Bucket(stage, -1, pool.take())
        cur.add(name, t)
    if cur is not None:
        yield cur.seal(next(index))
    for span in spans.values():
        yield from span.seal(stage, index, gapless)


class _Span:
    """Tensors of one storage (the parameter buffer) gathered into borrowed buckets (offsets
    absolute until `seal` knows where each bucket starts)."""

    def __init__(self, storage: torch.UntypedStorage):
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.entries: list[tuple[str, torch.Tensor, int]] = []
        self.nbytes = 0

    def fits(self, t: torch.Tensor, capacity: int) -> bool:
        return self.nbytes + _nbytes(t) <= capacity

    def add(self, name: str, t: torch.Tensor) -> None:
        self.entries.append((name, t, t.storage_offset() * t.element_size()))
        self.nbytes += _nbytes(t)

    def seal(self, stage: int, index: Iterator[int], gapless: bool) -> Iterator[Bucket]:
        entries = self.entries
        if gapless:  # runs of adjacent tensors, each in offset order
            entries = sorted(entries, key=lambda e: e[2])
            runs, run = [], [entries[0]]
            for e in entries[1:]:
                if e[2] != run[-1][2] + _nbytes(run[-1][1]):
                    runs.append(run)
                    run = []
                run.append(e)
            runs.append(run)
        else:
            runs = [entries]
        for run in runs:
            yield self._bucket(run, stage, next(index))

    def _bucket(self, entries: list, stage: int, index: int) -> Bucket:
        lo = min(start for _, _, start in entries)
        hi = max(start + _nbytes(t) for _, t, start in entries)
        metadata = [
            types.SimpleNamespace(
                name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=start - lo,
                end_idx=start - lo + _nbytes(t), numel=_nbytes(t),
            )
            for name, t, start in entries
        ]  # fmt: skip
        nbytes = sum(_nbytes(t) for _, t, _ in entries)
        return Bucket(stage, index, self.bytes[lo:hi], nbytes, metadata, borrowed=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def release(bucket: Bucket, pool: BufferPool) -> None:
    if bucket.borrowed:
        pass  # the storage belongs to the tensors
    elif bucket.pooled:
        pool.give(bucket.buffer)
    else:
        pool.give_big(bucket.buffer)
    bucket.buffer = bucket.buffer[:0]
