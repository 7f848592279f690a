"""The trainer's side of SGLang's weight-update API: the payloads of /update_weights_from_tensor,
the request bodies of /update_weights_from_distributed, and the process group both sides open.

    with TensorSharing():                                    # file_system strategy on CPU
        body = tensor_update_body(named, load_format="flattened_bucket", weight_version="v3")
        POST /begin_weight_update begin_body() ; /update_weights_from_tensor body ; /end_weight_update

    # distributed: the trainer is rank 0 of a group with the servers' TP ranks after it
    POST /init_weights_update_group {...} (in flight) ; group = open_update_group(..., rank=0)
    POST /update_weights_from_distributed distributed_update_body(named) (in flight)
    broadcast_named(group, named) ; then await both answers

Payload formats (SGLang 0.5.23, `MultiprocessingSerializer`): base64 of a torch multiprocessing
(ForkingPickler) pickle of `[(name, tensor), ...]`, or for load_format "flattened_bucket"
`{"flattened_tensor": uint8 [bytes], "metadata": [obj(name, shape, dtype, start_idx, end_idx,
numel)]}` with byte offsets. The metadata objects are `types.SimpleNamespace`: SGLang reads them by
attribute, and they unpickle in a process that has neither SGLang nor this package.

load_format null loads through the model's HF-name loader (what the trainer's bridge exports).
"direct" copies into parameters by the server's own names: on the built-in server those are HF
names, but on SGLang they are its fused parameters (qkv_proj, experts.w13_weight, ...), and an
unknown name there kills SGLang's scheduler — send HF names with null or "flattened_bucket".

CPU tensors travel as shared-memory file names: the sender must use torch's "file_system" sharing
strategy (the default "fd" strategy passes file descriptors that the server cannot receive over
HTTP), and the built-in server opens only the objects of the processes named at
/begin_weight_update (`begin_body`). On GPU they travel as CUDA IPC handles (same node only)
naming their device by UUID, as SGLang's senders do: a server must see the sender's GPU (colocated servers see the node's GPUs
and start at --base-gpu-id, launch/serve_node.py).
"""

from __future__ import annotations

import base64
import io
import math
import os
import threading
import types
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

NamedTensors = Sequence[tuple[str, torch.Tensor]]
# A field of the built-in server's /update_weights_from_tensor answer, false: it mapped the
# payload's shared memory read-only and did not give back the references the sender's pickles
# took on it (torch's receiver, SGLang's, does, and leaves the field out); the sender does.
RELEASED = "released_shared_memory"
# A field of /begin_weight_update (SGLang ignores it): the process ids that will send CPU
# tensors in shared memory during this session; the built-in server opens no shared-memory
# object that another process made (torch names them /torch_<pid>_...).
SENDERS = "shared_memory_senders"


def begin_body(senders: Sequence[int] | None = None) -> dict:
    """The JSON body of /begin_weight_update; `senders`: the processes that will send shared
    memory (this one when None)."""
    return {"selector": "target", SENDERS: sorted(set(senders or [os.getpid()]))}


class TensorSharing:
    """Context manager: torch multiprocessing's "file_system" sharing strategy inside.

    The strategy is one process-wide setting, and the weight sync enters this block from
    several threads at once (a bucket's allocation while another bucket is serialized). So the
    blocks are counted: the first to enter sets the strategy, and only the last to leave puts
    the old one back. Without the count, one thread leaving restored "file_descriptor" under
    another thread still inside, whose serialization then failed."""

    _lock = threading.Lock()
    _inside = 0
    _old: str | None = None

    def __enter__(self) -> TensorSharing:
        import torch.multiprocessing as mp

        cls = type(self)
        with cls._lock:
            if cls._inside == 0:
                cls._old = mp.get_sharing_strategy()
                mp.set_sharing_strategy("file_system")
            cls._inside += 1
        return self

    def __exit__(self, *exc) -> None:
        import torch.multiprocessing as mp

        cls = type(self)
        with cls._lock:
            cls._inside -= 1
            if cls._inside == 0:
                mp.set_sharing_strategy(cls._old)


# ---- /update_weights_from_tensor ----------------------------------------------------------


def serialize(obj: object) -> str:
    """base64 of a torch multiprocessing pickle, as SGLang's MultiprocessingSerializer makes it."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system" and not _all_cuda(obj):
        raise RuntimeError(
            "CPU tensors must be shared with the 'file_system' strategy; wrap the update in "
            "`with TensorSharing():` (torch.multiprocessing.set_sharing_strategy('file_system'))"
        )
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    for cls in (torch.Tensor, torch.nn.Parameter):  # this pickler's only
        pickler.dispatch_table[cls] = _reduce_tensor
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# rebuild_cuda_tensor's argument that names the tensor's device; torch's reducer gives the
# sender's device index, which means another GPU (or none) in a server whose
# CUDA_VISIBLE_DEVICES differs. SGLang's senders give the device's UUID instead and its
# receivers map a UUID back to their own index, so that is sent.
CUDA_DEVICE_ARG = 6


def _reduce_tensor(t: torch.Tensor):
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = with_device_uuid(args, str(torch.cuda.get_device_properties(t.device).uuid))
    return rebuild, args


def with_device_uuid(args: tuple, uuid: str) -> tuple:
    """rebuild_cuda_tensor's arguments with the device given by `uuid` instead of its index
    (unchanged if it is one already: SGLang's patched reducer, where SGLang is imported)."""
    if isinstance(args[CUDA_DEVICE_ARG], str):
        return args
    if not isinstance(args[CUDA_DEVICE_ARG], int):
        raise TypeError(f"rebuild_cuda_tensor argument {CUDA_DEVICE_ARG} is not a device index")
    return (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])


def _all_cuda(obj: object) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return all(_all_cuda(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_cuda(v) for v in obj)
    return True


def _detached(t: torch.Tensor) -> torch.Tensor:
    # Sharing a CPU tensor moves its storage into shared memory in place: copy, so the trainer's
    # parameters (and whatever else shares their storage) stay where they are.
    return t.detach() if t.is_cuda else t.detach().clone()


def flatten_bucket(named: NamedTensors) -> dict:
    """SGLang's flattened bucket: every tensor's bytes in one uint8 tensor, plus metadata."""
    chunks, metadata, start = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        chunks.append(flat)
        n = flat.numel()
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(t.shape),
                dtype=t.dtype,
                start_idx=start,
                end_idx=start + n,
                numel=n,
            )
        )
        start += n
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(flat: torch.Tensor, metadata: Iterable) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flattened bucket (views into `flat`)."""
    out = []
    for m in metadata:
        t = flat[m.start_idx : m.end_idx].view(m.dtype).reshape(tuple(m.shape))
        out.append((m.name, t))
    return out


def tensor_update_body(
    named: NamedTensors,
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    tp_size: int = 1,
) -> dict:
    """The JSON body of /update_weights_from_tensor. Call it inside `TensorSharing()` on CPU.

    Every server TP rank reads its own entry of `serialized_named_tensors`. Each entry is its own
    pickle: a shared-memory tensor pickle carries one reference that its receiver releases, so
    one pickle handed to several ranks would unlink the memory under the later ones.
    """
    obj: object
    if load_format == "flattened_bucket":
        obj = flatten_bucket(named)
    elif load_format in (None, "direct"):
        obj = [(name, _detached(t)) for name, t in named]
    else:
        raise ValueError(f"load_format must be None, 'direct' or 'flattened_bucket': {load_format}")
    return {
        "serialized_named_tensors": [serialize(obj) for _ in range(tp_size)],
        "load_format": load_format,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }


# ---- /update_weights_from_distributed -----------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def distributed_update_body(
    named: NamedTensors,
    group_name: str,
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> dict:
    """The JSON body of /update_weights_from_distributed for `named`, in broadcast order."""
    if load_format not in (None, "flattened_bucket"):
        raise ValueError(f"load_format must be None or 'flattened_bucket': {load_format}")
    return {
        "names": [name for name, _ in named],
        "dtypes": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group_name,
        "load_format": load_format,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


def init_group_body(
    master_address: str, master_port: int, world_size: int, group_name: str,
    backend: str = "gloo", rank_offset: int = 1,
) -> dict:  # fmt: skip
    """The JSON body of /init_weights_update_group: the server's TP ranks from rank_offset on."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def host_update_store(
    master_address: str, world_size: int, timeout_s: float = 300.0
) -> tuple[dist.TCPStore, int]:
    """Rank 0's store of an update group, listening before anyone is told where: on a port it
    binds itself (a port picked first could be taken before the bind). Returns it and its port
    (for the servers' /init_weights_update_group; give the store to `open_update_group`)."""
    store = dist.TCPStore(master_address, 0, world_size, is_master=True,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
    return store, store.port


def open_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """A process group of its own (no default group needed), as SGLang's
    `init_custom_process_group` builds it: a TCPStore hosted by rank 0, wrapped in
    PrefixStore(group_name) — a plain init_process_group on the trainer side hangs.
    Rank 0 (the trainer) must call this while the servers join (their HTTP call is in flight),
    with the store of `host_update_store` when it has one.
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
        )
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=cast("c10d.GroupName", group_name),  # a NewType of str
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast_named(
    group: dist.ProcessGroup, named: NamedTensors, load_format: str | None = None
) -> None:
    """Rank 0's side of /update_weights_from_distributed: one broadcast per tensor in order,
    or one uint8 broadcast of the flattened bucket."""
    if load_format == "flattened_bucket":
        dist.broadcast(flatten_bucket(named)["flattened_tensor"], src=0, group=group)
        return
    for _, t in named:
        dist.broadcast(t.detach().contiguous(), src=0, group=group)


def bucket_layout(
    names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> tuple[list[types.SimpleNamespace], int]:
    """The flattened_bucket metadata of tensors packed back to back in this order, and the
    bucket's size in bytes (what the sender's broadcast holds)."""
    metadata, start = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        n = math.prod(shape) * dtype.itemsize
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=torch.Size(shape), dtype=dtype,
                start_idx=start, end_idx=start + n, numel=n,
            )
        )  # fmt: skip
        start += n
    return metadata, start


def receive_named(
    group: dist.ProcessGroup,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    load_format: str | None = None,
    buffer: torch.Tensor | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """A server rank's side of broadcast_named, received in the same order.

    flattened_bucket: the bucket is received straight into `buffer` (a uint8 tensor reused
    across requests, used if it is large enough) or a fresh one, and the tensors returned are
    views into it, so the bytes are copied once more only when they are loaded into the weights.
    """
    if load_format == "flattened_bucket":
        metadata, nbytes = bucket_layout(names, dtypes, shapes)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        flat = buffer[:nbytes]
        dist.broadcast(flat, src=0, group=group)
        return unflatten_bucket(flat, metadata)
    empty = [(n, torch.empty(s, dtype=d)) for n, d, s in zip(names, dtypes, shapes)]
    for _, t in empty:
        dist.broadcast(t, src=0, group=group)
    return empty
