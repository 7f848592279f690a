"""Decode SGLang's /update_weights_from_tensor payloads without running arbitrary pickle.

A payload is base64 of a torch multiprocessing (ForkingPickler) pickle. A pickle can call any
importable function; this unpickler resolves only the globals a tensor payload needs: torch's
tensor and storage rebuild functions for shared CPU memory (the "file_system" strategy), the
tensor and storage classes, dtypes, torch.Size, and plain containers. Anything else — os.system,
builtins.eval, a CUDA IPC handle on a CPU server, the "fd" strategy's file-descriptor passing —
is refused with `BadPayload` before it is called. The classes are given to torch's rebuild
functions as names that cannot be called (torch.Tensor(n) would be n bytes nobody wrote), and a
tensor is rebuilt only where its view fits in its storage (torch's own would grow an empty one).
The decoded object is then checked to be one of the two shapes SGLang accepts.

Shared memory: a CPU tensor arrives as the name of a shared-memory object that the sender's torch
created. torch's own rebuild would open any name the payload gives read-write, connect to a
manager socket at any path it gives, and take part in the object's reference count (so the
server could grow, overwrite or, at exit, delete any /dev/shm object of its user). Here the name
must have torch's form (`/torch_<pid>_<n>_<n>`, nothing else in /dev/shm, no path), its <pid>
must be one of the senders that the client named when it opened the weight-update session
(`shared_memory_senders` of /begin_weight_update: the trainer's ranks), the object must be a
regular file of the server's own user whose size is exactly torch's header plus the claimed size,
and it is mapped read-only: the server never writes, grows, counts or unlinks it
(the sender frees it). The manager socket is ignored. A client on another machine cannot have
created a shared-memory object here, so a payload from one that names any is refused
(`senders=None`; a peer is on this machine when its address is one of this machine's).

A server without an API key refuses shared memory altogether (`WITHOUT_API_KEY`): it cannot
tell which process a client is, so any local process could name another's pid as a sender and
have that process's tensors loaded into the served weights. With a key, only its holder (the
trainer, which gives the servers it starts a random one) opens a weight-update session.
"""

from __future__ import annotations

import base64
import binascii
import io
import mmap
import os
import pickle
import re
import stat
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from megatron_gspo.rollout.server_config import API_KEY_ENV
from megatron_gspo.rollout.weight_payload import SENDERS
from megatron_gspo.server.sampling import BadRequest


class BadPayload(BadRequest):
    """A weight payload that is not (only) named tensors."""


@dataclass
class FlattenedTensorMetadata:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (data only)."""

    name: str = ""
    shape: tuple = ()
    dtype: torch.dtype = torch.float32
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


SHM_DIR = "/dev/shm"
# torch's shared-memory names (libshm: "/torch_" pid "_" random "_" counter)
_TORCH_SHM_NAME = re.compile(rb"/torch_([0-9]{1,10})_[0-9]{1,20}_[0-9]{1,20}")
MAX_PID = 1 << 22  # Linux's largest pid_max
# torch's refcounted shared memory keeps its count in a header before the data
_SHM_HEADER = 64
_MAX_SHARED_BYTES = 1 << 40


def _shared_storage(
    handle: object, nbytes: object, senders: frozenset[int]
) -> torch.UntypedStorage:
    """The bytes of torch shared-memory object `handle`, mapped read-only (see the module doc)."""
    named = _TORCH_SHM_NAME.fullmatch(handle) if isinstance(handle, bytes) else None
    if named is None:
        raise BadPayload(f"shared-memory name {str(handle)[:80]!r} is not torch's: refused")
    name = named.group(0).decode()
    if int(named.group(1)) not in senders:
        raise BadPayload(
            f"shared-memory object {name} was not made by a sender named at "
            f"/begin_weight_update ({SENDERS}: {sorted(senders)[:8]}): refused"
        )
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise BadPayload("shared-memory size must be an integer")
    if not 0 <= nbytes <= _MAX_SHARED_BYTES:
        raise BadPayload(f"shared-memory size {nbytes} is out of range")
    path = SHM_DIR + name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        why = e.strerror
        raise BadPayload(f"shared-memory object {name} cannot be opened: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise BadPayload(f"{name} is not a shared-memory object of this user")
        if info.st_size != _SHM_HEADER + nbytes:
            raise BadPayload(f"{name} holds {info.st_size} bytes, not torch's header + {nbytes}")
        if nbytes == 0:
            return torch.UntypedStorage(0)
        return _MAPPINGS.storage(fd, info, nbytes)
    finally:
        os.close(fd)


class _Mappings:
    """Read-only mappings of the shared-memory objects a sender reuses from one update to the
    next (its bucket pool), kept so that a sync does not fault in fresh pages per bucket (on a
    CPU that costs as much as the copy). One is let go as soon as its object is unlinked (the
    sender freed it), so the memory of freed objects is not held."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.kept: dict[tuple[int, int], tuple[int, torch.UntypedStorage]] = {}  # (dev, ino)
        self.lock = threading.Lock()  # decoding threads and the engine thread (release)

    def storage(self, fd: int, info: os.stat_result, nbytes: int) -> torch.UntypedStorage:
        with self.lock:
            return self._storage(fd, info, nbytes)

    def _storage(self, fd: int, info: os.stat_result, nbytes: int) -> torch.UntypedStorage:
        self._forget_unlinked()
        key = (info.st_dev, info.st_ino)
        if key in self.kept:
            return self.kept[key][1]
        view = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        with warnings.catch_warnings():  # read-only on purpose: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(view, dtype=torch.uint8, offset=_SHM_HEADER, count=nbytes)
        if len(self.kept) >= self.limit:
            self._forget()
        self.kept[key] = (os.dup(fd), data.untyped_storage())
        return self.kept[key][1]

    def _forget_unlinked(self) -> None:
        for key, (fd, _) in list(self.kept.items()):
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                del self.kept[key]

    def forget(self) -> None:
        """Let every mapping go (released memory)."""
        with self.lock:
            self._forget()

    def _forget(self) -> None:
        for fd, _ in self.kept.values():
            os.close(fd)
        self.kept.clear()


_MAPPINGS = _Mappings()
forget_mappings = _MAPPINGS.forget


def _rebuild_storage_filename(senders: frozenset[int]):
    """torch's `rebuild_storage_filename`, minus what a peer must not choose (module doc)."""

    def rebuild(cls, manager, handle, size, dtype=None):
        if dtype is None:
            return _shared_storage(handle, size, senders)
        if not isinstance(dtype, torch.dtype) or type(size) is not int:
            raise BadPayload("a typed shared storage needs a dtype and an integer size")
        untyped = _shared_storage(handle, size * torch._utils._element_size(dtype), senders)
        return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    return rebuild


@dataclass(frozen=True)
class _TypeName:
    """A tensor or storage class as a payload names it: what torch's rebuild functions are
    given. Not the class itself, which a pickle could call (torch.Tensor(n), UntypedStorage(n))
    to make a tensor of n bytes that nobody wrote, loaded as weights."""

    cls: type

    def __call__(self, *args, **kwargs):
        name = f"{self.cls.__module__}.{self.cls.__qualname__}"
        raise BadPayload(
            f"weight payload calls {name}: refused (a tensor's bytes come only from the shared "
            "memory its sender wrote)"
        )


def _rebuild_tensor(cls: object, storage: object, metadata: object) -> torch.Tensor:
    """torch's `rebuild_tensor`, once the view fits in its storage: torch's own would grow an
    empty storage to any size the payload gives and hand back its uninitialized bytes."""
    if not isinstance(cls, _TypeName) or not isinstance(storage, torch.TypedStorage):
        raise BadPayload("a tensor must be rebuilt from a tensor class and a typed storage")
    offset, size, stride, requires_grad = _view(metadata)
    span = 0 if 0 in size else offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    held = storage._untyped_storage.nbytes() // storage.dtype.itemsize  # (no deprecation warning)
    if span > held:
        raise BadPayload(
            f"a tensor of size {str(size)[:80]} needs {span} elements of its storage, which "
            f"holds {held}"
        )
    return reductions.rebuild_tensor(cls.cls, storage, (offset, size, stride, requires_grad))


def _view(metadata: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], bool]:
    """A rebuilt tensor's (offset, size, stride, requires_grad), every number an int >= 0."""
    try:
        offset, size, stride, requires_grad = metadata
        size, stride = tuple(size), tuple(stride)
    except (TypeError, ValueError):
        raise BadPayload("a tensor's metadata must be (offset, size, stride, grad)") from None
    dims = (offset, *size, *stride)
    if len(size) != len(stride) or len(size) > 64 or type(requires_grad) is not bool:
        raise BadPayload("a tensor's metadata must give one stride per size and a bool grad")
    if not all(type(d) is int and d >= 0 for d in dims):
        raise BadPayload("a tensor's offset, sizes and strides must be integers >= 0")
    return offset, size, stride, requires_grad


def _rebuild_storage_empty(cls: object) -> torch.UntypedStorage:
    if cls != _TypeName(torch.UntypedStorage):
        raise BadPayload("an empty storage must be an UntypedStorage")
    return torch.UntypedStorage()


_ALLOWED: dict[tuple[str, str], object] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch", "Tensor"): _TypeName(torch.Tensor),
    ("torch.nn.parameter", "Parameter"): _TypeName(torch.nn.Parameter),
    ("torch", "UntypedStorage"): _TypeName(torch.UntypedStorage),
    ("torch.storage", "UntypedStorage"): _TypeName(torch.UntypedStorage),
    ("torch", "Size"): torch.Size,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}

_HINTS = {
    "rebuild_storage_fd": "the sender used the 'fd' sharing strategy; CPU tensors must be sent "
    "with torch.multiprocessing.set_sharing_strategy('file_system')",
    "rebuild_cuda_tensor": "CUDA IPC tensors cannot be received by a server running on CPU",
}


_SHARED = ("torch.multiprocessing.reductions", "rebuild_storage_filename")


# why shared memory is refused where `senders` is None
FROM_ANOTHER_MACHINE = (
    "weight payload refers to shared memory, which only a process on this machine can pass: "
    "refused from a client on another machine (from there, sync weights with sync.method "
    "distributed or disk)"
)
WITHOUT_API_KEY = (
    "weight payload refers to shared memory, which this server loads only for a client holding "
    "its API key (without one, any local process could name another's objects): start it with "
    f"--api-key KEY (or ${API_KEY_ENV}) and give the trainer the same key"
)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, senders: frozenset[int] | None, refusal: str):
        super().__init__(file)
        self.senders, self.refusal = senders, refusal

    def find_class(self, module: str, name: str):
        if (module, name) == _SHARED:
            if self.senders is None:
                raise BadPayload(self.refusal)
            return _rebuild_storage_filename(self.senders)
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        hint = _HINTS.get(name, "only tensors, dtypes and plain containers are accepted")
        raise BadPayload(f"weight payload refers to {module}.{name}: refused ({hint})")

    def persistent_load(self, pid):
        raise BadPayload("weight payload uses persistent ids: refused")


def loads(
    b64: str | bytes,
    senders: frozenset[int] | None = frozenset(),
    refusal: str = FROM_ANOTHER_MACHINE,
) -> object:
    """Decode one base64 payload with the restricted unpickler. Shared-memory tensors: only
    those made by the processes `senders`; None refuses them, saying `refusal`."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise BadPayload(f"serialized_named_tensors is not base64: {e}") from None
    try:
        return _TensorUnpickler(io.BytesIO(raw), senders, refusal).load()
    except BadPayload:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the client's error
        raise BadPayload(f"could not decode the weight payload: {type(e).__name__}: {e}") from None


def decode_named_tensors(
    b64: str | bytes,
    load_format: str | None,
    senders: frozenset[int] | None = frozenset(),
    refusal: str = FROM_ANOTHER_MACHINE,
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of one payload; load_format None/"direct" or "flattened_bucket".
    `senders`: the processes whose shared-memory tensors are accepted (`loads`)."""
    obj = loads(b64, senders, refusal)
    if load_format == "flattened_bucket":
        return _from_bucket(obj)
    if not isinstance(obj, (list, tuple)):
        raise BadPayload(f"expected a list of (name, tensor) pairs, got {type(obj).__name__}")
    out = []
    for item in obj:
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise BadPayload("expected a list of (name, tensor) pairs")
        out.append((item[0], item[1]))
    return out


def _from_bucket(obj: object) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
        raise BadPayload("a flattened_bucket payload is {flattened_tensor, metadata}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise BadPayload("flattened_tensor must be a 1-d uint8 tensor")
    out = []
    m: Any  # an entry, or None where metadata is no list (then refused as a bad entry)
    for m in metadata if isinstance(metadata, (list, tuple)) else [None]:
        try:
            name, dtype, start, end = m.name, m.dtype, int(m.start_idx), int(m.end_idx)
            shape = tuple(int(s) for s in m.shape)
        except (AttributeError, TypeError, ValueError):
            raise BadPayload(
                "metadata entries need name, shape, dtype, start_idx, end_idx"
            ) from None
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise BadPayload("metadata name must be a string and dtype a torch dtype")
        if not 0 <= start <= end <= flat.numel():
            raise BadPayload(f"metadata of {name[:100]!r} points outside the flattened tensor")
        if not _fits(shape, dtype, end - start):
            raise BadPayload(
                f"metadata of {name[:100]!r}: shape {str(shape)[:80]} of {dtype} does not fit "
                f"its {end - start} bytes"
            )
        try:
            out.append((name, flat[start:end].view(dtype).reshape(shape)))
        except (RuntimeError, TypeError, ValueError) as e:
            raise BadPayload(f"metadata of {name[:100]!r} does not fit its bytes: {e}") from None
    return out


def _fits(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> bool:
    """Whether `nbytes` hold exactly a `shape` tensor of `dtype` (sizes >= 0, at most 64 dims;
    the product capped as it grows, so a hostile shape costs nothing)."""
    if len(shape) > 64 or any(d < 0 for d in shape):
        return False
    numel = 1
    for d in shape:
        numel = min(numel * d, nbytes + 1)
    return numel * dtype.itemsize == nbytes
