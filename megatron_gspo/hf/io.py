"""HF safetensors checkpoints on disk: read tensors by name, write shards atomically.

A checkpoint is a directory with config.json and either model.safetensors or shards listed in
model.safetensors.index.json. Missing or truncated files are a UserError that names the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_gspo.errors import UserError

INDEX = "model.safetensors.index.json"
NON_WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
DTYPES_ST = {v: k for k, v in ST_DTYPES.items()}


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise UserError(f"{self.path} is not an HF checkpoint (no config.json); check the path")
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[dict, int]] = {}
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{index} is unreadable ({e}); re-copy the checkpoint") from None
            return _own_files(index, weight_map)
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise UserError(
                f"no model.safetensors or {INDEX} in {self.path}; re-copy the checkpoint"
            )
        return {name: single.name for name in self._open(single.name).keys()}

    def _open(self, filename: str):
        if filename not in self._handles:
            from safetensors import safe_open

            path = self._existing(filename)
            try:
                self._handles[filename] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise UserError(
                    f"{path} is truncated or corrupt ({str(e).splitlines()[0]}); re-copy it"
                ) from None
        return self._handles[filename]

    def _existing(self, filename: str) -> Path:
        path = self.path / filename
        if not path.is_file():
            raise UserError(f"checkpoint file {path} is missing; re-copy the checkpoint")
        return path

    def _file_of(self, name: str) -> str:
        if name not in self.files:
            raise UserError(
                f"tensor {name!r} missing from {self.path}; the checkpoint is incomplete"
            )
        return self.files[name]

    def keys(self) -> list[str]:
        return list(self.files)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every tensor, from the files' headers (no weight is read)."""
        out = {}
        for name, filename in self.files.items():
            header, _ = self._header(filename)
            entry = header.get(name)
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list):
                raise UserError(f"{self.path / filename} has no readable entry for {name!r}")
            out[name] = tuple(shape)
        return out

    def get(self, name: str) -> torch.Tensor:
        filename = self._file_of(name)
        try:
            return self._open(filename).get_tensor(name)
        except UserError:
            raise
        except Exception as e:
            raise UserError(
                f"reading {name!r} from {self.path / filename} failed "
                f"({str(e).splitlines()[0]}); the file is truncated or corrupt, re-copy it"
            ) from None

    def read_into(self, targets: list[tuple[str, torch.Tensor]], threads: int = 2) -> None:
        """Read each named tensor straight into its target (same shape; any dtype, converted).

        Every name, shape and file length is checked against the safetensors headers before
        any target is written, so a bad checkpoint leaves the targets as they were. A
        contiguous CPU target of the file's dtype is filled by reading the file into its
        memory (one copy, no temporary); others go through a temporary. Files are read on
        `threads` threads (file reads release the GIL)."""
        plan: dict[str, list] = {}
        for name, dst in targets:
            filename = self._file_of(name)
            header, base = self._header(filename)
            entry = header.get(name)
            dtype = DTYPES_ST.get(entry.get("dtype", "")) if isinstance(entry, dict) else None
            if dtype is None or not isinstance(entry, dict):  # (no dtype unless a dict)
                raise UserError(f"{self.path / filename} has no readable entry for {name!r}")
            shape = tuple(entry["shape"])
            if shape != tuple(dst.shape):
                raise UserError(f"weight {name!r} has shape {shape}, expected {tuple(dst.shape)}")
            start, end = entry["data_offsets"]
            if end - start != dst.numel() * dtype.itemsize:
                raise UserError(f"{self.path / filename}: {name!r} has the wrong byte length")
            plan.setdefault(filename, []).append((dst, dtype, base + start, end - start))
        for filename, items in plan.items():
            path = self.path / filename
            need = max(offset + n for _, _, offset, n in items)
            if path.stat().st_size < need:
                raise UserError(f"checkpoint file {path} is truncated; re-copy the checkpoint")
        # Contiguous runs of about equal bytes, one per thread, in file order.
        items = [(f, *item) for f, its in plan.items() for item in sorted(its, key=lambda x: x[2])]
        total = sum(item[-1] for item in items)
        lanes: list[list] = [[]]
        done = 0
        for item in items:
            if done >= total * len(lanes) / max(threads, 1) and len(lanes) < threads:
                lanes.append([])
            lanes[-1].append(item)
            done += item[-1]
        if len(lanes) == 1:
            self._read_lane(lanes[0])
            return
        with ThreadPoolExecutor(len(lanes), "hf-read") as ex:
            list(ex.map(self._read_lane, lanes))

    def _read_lane(self, items: list) -> None:
        fds: dict[str, int] = {}
        try:
            for filename, dst, dtype, offset, n in items:
                if filename not in fds:
                    fds[filename] = os.open(self.path / filename, os.O_RDONLY)
                direct = dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == dtype
                tmp = dst if direct else torch.empty(dst.shape, dtype=dtype)
                _pread_into(fds[filename], tmp, offset, n, self.path / filename)
                if not direct:
                    with torch.no_grad():
                        dst.copy_(tmp)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _header(self, filename: str) -> tuple[dict, int]:
        """A shard's safetensors header and where its data starts (cached)."""
        if filename not in self._headers:
            path = self._existing(filename)
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
            except (struct.error, ValueError, MemoryError, OverflowError) as e:
                raise UserError(
                    f"{path} is truncated or corrupt ({type(e).__name__}); re-copy it"
                ) from None
            if not isinstance(header, dict):
                raise UserError(f"{path} is truncated or corrupt (bad header); re-copy it")
            self._headers[filename] = (header, 8 + n)
        return self._headers[filename]

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's floating-point weights (of its first tensor)."""
        return self.get(next(iter(self.files))).dtype


def _own_files(index: Path, weight_map: object) -> dict[str, str]:
    """The index's tensor -> file map, once every file is a plain name in the index's own
    directory: a name with a path in it ("../x", "/etc/passwd", "sub/x") would have a server
    that checked the directory it was given read files it never checked."""
    if not isinstance(weight_map, dict):
        raise UserError(f"{index}'s weight_map is no mapping; re-copy the checkpoint")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\0" in file:
            raise UserError(
                f"{index} puts {str(name)[:100]!r} in {str(file)[:100]!r}, not a file of the "
                "checkpoint's own directory; re-copy the checkpoint"
            )
    return dict(weight_map)


def _pread_into(fd: int, dst: torch.Tensor, offset: int, n: int, path: Path) -> None:
    view = dst.view(-1).view(torch.uint8).numpy().data  # a memoryview of the tensor's bytes
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise UserError(f"checkpoint file {path} is truncated; re-copy the checkpoint")
        done += got


def copy_non_weight_files(src: Path, dst: Path) -> None:
    for name in NON_WEIGHT_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_index(out: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_model_files(hf_files: Path, out: Path) -> None:
    """Rank 0, once every rank's weights are in `out`: the config, tokenizer and generation files
    of `hf_files`, with config.json's dtype naming that of the weights written. The weights keep
    the dtype they are in (a run trained in bfloat16 from a float32 model exports bfloat16), and
    transformers loads a checkpoint in its config's dtype: a config still saying float32 would
    have them upcast without a word, and a server's `--dtype auto` run them in float32."""
    copy_non_weight_files(hf_files, out)
    dtype = weights_dtype(out)
    if dtype is not None:
        set_config_dtype(out / "config.json", dtype)


def weights_dtype(directory: Path) -> torch.dtype | None:
    """The dtype of the floating-point tensors in the safetensors files of `directory` (the one
    holding the most bytes, should they differ), from the files' headers; None if none."""
    from safetensors import safe_open

    nbytes: dict[torch.dtype, int] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                dtype = DTYPES_ST.get(t.get_dtype())
                if dtype is not None and dtype.is_floating_point:
                    nbytes[dtype] = nbytes.get(dtype, 0) + math.prod(t.get_shape()) * dtype.itemsize
    return max(nbytes, key=nbytes.__getitem__) if nbytes else None


def set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """Make config.json at `path` name `dtype`: `dtype` (what transformers 5 writes and reads
    first) and, where the config has it, the older `torch_dtype`. A config that already names
    it in every such key is left as it is, byte for byte."""
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = ["dtype", *(["torch_dtype"] if "torch_dtype" in cfg else [])]
    present = [k for k in keys if k in cfg]
    if present and all(cfg[k] == name for k in present):
        return
    cfg.update({k: name for k in keys})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, path)  # (a read-only copy of the base's file is replaced, not written)
