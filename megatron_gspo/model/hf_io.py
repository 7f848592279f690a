"""HF safetensors checkpoints on disk: read tensors by name, write shards atomically.

A checkpoint is a directory with config.json and either model.safetensors or shards listed in
model.safetensors.index.json. Missing or truncated files are a UserError that names the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
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


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise UserError(f"{self.path} is not an HF checkpoint (no config.json); check the path")
        self._handles: dict[str, object] = {}
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index} is unreadable ({e}); re-copy the checkpoint") from None
            return dict(weight_map)
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise UserError(
                f"no model.safetensors or {INDEX} in {self.path}; re-copy the checkpoint"
            )
        return {name: single.name for name in self._open(single.name).keys()}

    def _open(self, filename: str):
        if filename not in self._handles:
            from safetensors import safe_open

            path = self.path / filename
            if not path.is_file():
                raise UserError(f"checkpoint file {path} is missing; re-copy the checkpoint")
            try:
                self._handles[filename] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise UserError(
                    f"{path} is truncated or corrupt ({str(e).splitlines()[0]}); re-copy it"
                ) from None
        return self._handles[filename]

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise UserError(
                f"tensor {name!r} missing from {self.path}; the checkpoint is incomplete"
            )
        try:
            return self._open(self.files[name]).get_tensor(name)
        except UserError:
            raise
        except Exception as e:
            raise UserError(
                f"reading {name!r} from {self.path / self.files[name]} failed "
                f"({str(e).splitlines()[0]}); the file is truncated or corrupt, re-copy it"
            ) from None

    def dtype(self) -> torch.dtype:
        """The dtype of the checkpoint's floating-point weights (of its first tensor)."""
        return self.get(next(iter(self.files))).dtype


@contextmanager
def atomic_output_dir(out: str | os.PathLike):
    """Yield a temporary directory beside `out`; rename it to `out` only if the body succeeds."""
    out = Path(out)
    if out.exists():
        raise UserError(f"output path {out} exists; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
