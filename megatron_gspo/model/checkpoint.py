"""Megatron checkpoints of the policy: a torch_dist dist-checkpoint plus the HF files that say
what model it is. Resharding is megatron's: save under one layout, load under any other.

    DIR/
      megatron_gspo.json   format, architecture, dtype, padded vocab size
      hf/                  config.json, tokenizer and generation files of the source model
      model/               torch_dist dist-checkpoint of the model chunks

`_extra_state` entries (Transformer Engine fp8 metadata; None in the local spec) are not saved, so
a checkpoint moves between the local and TE layer specs.

Conversion takes two shortcuts through the format, both plain torch.distributed.checkpoint (DCP):
`save_sharded` writes in this process with DCP's FileSystemWriter (megatron's default writer forks
worker processes and starts a spawned queue manager, seconds per save on a small machine), and
`DistCheckpointReader` (checkpoint_reader.py) maps tensors straight from the DCP files, without
a model to load into.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_gspo.disk_full import hidden_os_error
from megatron_gspo.errors import UserError, first_line
from megatron_gspo.outputs import interrupts_kept

META = "megatron_gspo.json"
FORMAT = "megatron-gspo/dist-v1"
WRITE_THREADS = 1  # files each rank writes in parallel in `save_sharded`


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META).is_file()


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path / META} is unreadable ({e}); re-copy the checkpoint") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if not (path / "model" / "metadata.json").is_file():
        raise UserError(f"{path}/model is not a complete dist-checkpoint (no metadata.json)")
    return meta


def unreadable(directory: Path) -> str | None:
    """None when this megatron-core can read the dist-checkpoint `directory` (its metadata.json
    names a backend and version it has a load strategy for); else why not, in a few words."""
    from megatron.core.dist_checkpointing.serialization import verify_checkpoint_and_load_strategy

    name = f"{directory.name}/metadata.json"
    if not (directory / "metadata.json").is_file():
        return f"{name} is missing"
    try:
        verify_checkpoint_and_load_strategy(str(directory))
    except Exception as e:  # noqa: BLE001 - whatever megatron finds wrong, the load would too
        first = first_line(e)[:200]
        return f"{name} names a format this version cannot read ({first})"
    return None


def write_meta(path: Path, *, spec, padded_vocab: int, dtype: torch.dtype, extra=None) -> None:
    meta = {
        "format": FORMAT,
        "architecture": spec.architecture,
        "dtype": str(dtype).removeprefix("torch."),
        "padded_vocab_size": padded_vocab,
        **(extra or {}),
    }
    (path / META).write_text(json.dumps(meta, indent=2) + "\n")


def sharded_model_state(chunks) -> dict:
    """{"model<i>": sharded state dict of chunk i}, without `_extra_state`. Keys inside are
    global (layer offsets applied), so the chunk numbering does not tie a checkpoint to a layout."""
    out = {}
    for i, chunk in enumerate(chunks):
        sd = chunk.sharded_state_dict()
        out[f"model{i}"] = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    return out


def save_model(chunks, directory: str | Path, *, fsync: bool = True) -> None:
    """Collective: every rank calls it with the same (existing, empty) directory.

    `fsync=False` skips megatron's per-file fsync (it doubles the time of a large save on a
    slow disk); conversion uses it because its output only appears, by rename, once complete.
    """
    from megatron.core import dist_checkpointing

    with interrupts_kept(), contextlib.nullcontext() if fsync else _without_fsync():
        dist_checkpointing.save(sharded_model_state(chunks), str(directory))


def save_sharded(
    state: dict, directory: str | Path, *, fsync: bool = True, checksums: bool = True
) -> None:
    """Collective: `dist_checkpointing.save` of a sharded state dict, the files written by this
    process (same torch_dist format and metadata as megatron's own writer). A Ctrl-C (or SIGTERM)
    during it is raised as such, not as the error torch's writer makes of it (`interrupts_kept`).

    `checksums=False` leaves the zip CRC32 of each stored tensor unset: torch.load never checks
    it, and computing it costs about as much as the write itself here."""
    from megatron.core import dist_checkpointing

    strategy = _in_process_strategy(fsync)
    with interrupts_kept(), contextlib.nullcontext() if checksums else _without_crc32():
        if strategy is None:  # a megatron without the pieces used here: its default writer
            with contextlib.nullcontext() if fsync else _without_fsync():
                dist_checkpointing.save(state, str(directory))
            return
        dist_checkpointing.save(state, str(directory), sharded_strategy=strategy)


@contextlib.contextmanager
def _without_crc32():
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:
        yield
        return
    before = get()
    put(False)
    try:
        yield
    finally:
        put(before)


def _in_process_strategy(fsync: bool):
    """megatron's torch_dist save strategy with its forked async writer swapped for DCP's
    synchronous FileSystemWriter; None where this megatron lacks the functions it reuses."""
    try:
        from megatron.core.dist_checkpointing.strategies import torch as mtorch
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        replace_keys = mtorch._replace_state_dict_keys_with_sharded_keys
        to_pyt, planner = mtorch.mcore_to_pyt_state_dict, mtorch.MCoreSavePlanner
    except (ImportError, AttributeError):
        return None

    class Writer(FileSystemWriter):
        """DCP's writer, with the OSError that torch's zip writer hid (a full disk's ENOSPC)
        raised in place of its "unexpected pos": DCP hands every rank this rank's error without
        the context that held the OSError (disk_full.py)."""

        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except RuntimeError as e:
                hidden = hidden_os_error(e)
                if hidden is None:
                    raise
                raise OSError(hidden.errno, hidden.strerror) from e

    class InProcessTorchDistSave(mtorch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = replace_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = Writer(str(checkpoint_dir), sync_files=fsync, thread_count=self.thread_count)
            dcp_save(
                to_pyt(state, False),
                storage_writer=writer,
                planner=planner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                ),
            )

    return InProcessTorchDistSave("torch_dist", 1, thread_count=WRITE_THREADS)


@contextlib.contextmanager
def _without_fsync():
    """Force `use_fsync=False` in megatron's torch_dist file writer, where it has that knob."""
    try:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import (
            FileSystemWriterAsync as writer,
        )
    except ImportError:
        yield
        return
    orig = writer.__dict__.get("write_preloaded_data")
    func = getattr(orig, "__func__", None)
    if func is None or "use_fsync" not in inspect.signature(func).parameters:
        yield
        return

    def write_preloaded_data(*args, **kwargs):
        kwargs["use_fsync"] = False
        return func(*args, **kwargs)

    writer.write_preloaded_data = staticmethod(write_preloaded_data)
    try:
        yield
    finally:
        writer.write_preloaded_data = orig


# What a dist-checkpoint load raises on a damaged or mismatched checkpoint: torch's
# CheckpointException (a BaseException, which `except Exception` lets through) and the rest.
LOAD_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def load_error(e: BaseException) -> str:
    """Why a dist-checkpoint load failed, in one line: the first line of the error, or for
    torch's CheckpointException (each failing rank's traceback) its last, the cause."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return (lines[-1] if isinstance(e, CheckpointException) else lines[0])[:300]


def load_model(chunks, directory: str | Path) -> None:
    """Collective: load a dist-checkpoint saved under any layout into this layout's chunks."""
    from megatron.core import dist_checkpointing

    try:
        state = dist_checkpointing.load(sharded_model_state(chunks), str(directory))
    except LOAD_ERRORS as e:
        raise UserError(
            f"cannot read dist-checkpoint {directory} ({load_error(e)}); re-copy it"
        ) from None
    for i, chunk in enumerate(chunks):
        take_over(chunk, state[f"model{i}"], directory)


@torch.no_grad()
def take_over(chunk, state: dict, directory, copy: bool = False, keep=None) -> None:
    """Point each parameter at its loaded tensor (no second copy). Unlike
    `load_state_dict(assign=True)` this keeps the Parameter objects and the attributes megatron
    set on them (tensor_model_parallel, sequence_parallel, ...). With `copy`, copy into the
    existing storage instead (needed once DDP has laid the parameters out in its buffers).
    `keep(name)` picks the parameters the state holds (LoRA: the adapters only)."""
    params = {n: p for n, p in chunk.named_parameters() if keep is None or keep(n)}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(k for k in set(state) - set(params) if not k.endswith("_extra_state"))
    if missing or unexpected:
        raise UserError(
            f"checkpoint {directory} does not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; was it made from another config?"
        )
    for name, p in params.items():
        t = state[name]
        if t.shape != p.shape:
            raise UserError(
                f"checkpoint {directory}: {name} is {tuple(t.shape)}, "
                f"the model needs {tuple(p.shape)}"
            )
        if copy:
            p.copy_(t)
        else:
            p.data = t.to(p.dtype).contiguous()


_take_over = take_over  # its former name
