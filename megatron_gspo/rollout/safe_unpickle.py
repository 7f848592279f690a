"""Decode SGLang's /update_weights_from_tensor payloads without running arbitrary pickle.

A payload is base64 of a torch multiprocessing (ForkingPickler) pickle. A pickle can call any
importable function; this unpickler resolves only the globals a tensor payload needs: torch's
tensor and storage rebuild functions for shared CPU memory (the "file_system" strategy), the
tensor and storage classes, dtypes, torch.Size, and plain containers. Anything else — os.system,
builtins.eval, a CUDA IPC handle on a CPU server, the "fd" strategy's file-descriptor passing —
is refused with `BadPayload` before it is called. The decoded object is then checked to be one
of the two shapes SGLang accepts.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from megatron_gspo.rollout.sampling import BadRequest


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


_ALLOWED: dict[tuple[str, str], object] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): (
        reductions.rebuild_storage_filename
    ),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
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


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        hint = _HINTS.get(name, "only tensors, dtypes and plain containers are accepted")
        raise BadPayload(f"weight payload refers to {module}.{name}: refused ({hint})")

    def persistent_load(self, pid):
        raise BadPayload("weight payload uses persistent ids: refused")


def loads(b64: str | bytes) -> object:
    """Decode one base64 payload with the restricted unpickler."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise BadPayload(f"serialized_named_tensors is not base64: {e}") from None
    try:
        return _TensorUnpickler(io.BytesIO(raw)).load()
    except BadPayload:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle is the client's error
        raise BadPayload(f"could not decode the weight payload: {type(e).__name__}: {e}") from None


def decode_named_tensors(
    b64: str | bytes, load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of one payload; load_format None/"direct" or "flattened_bucket"."""
    obj = loads(b64)
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
            raise BadPayload(f"metadata of {name!r} points outside the flattened tensor")
        try:
            out.append((name, flat[start:end].view(dtype).reshape(shape)))
        except RuntimeError as e:
            raise BadPayload(f"metadata of {name!r} does not fit its bytes: {e}") from None
    return out
