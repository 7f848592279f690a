"""Checkpoint conversion HF <-> Megatron dist-checkpoint, under any TP/PP/EP/expert-TP layout.

Both directions run on every rank of the layout (torchrun converts large checkpoints in parallel:
each rank reads or writes only its own share). Output goes to a temporary directory beside the
target and is renamed into place only when every rank has finished, so a failed or interrupted
(SIGINT, SIGTERM) conversion leaves nothing behind.

Neither direction loads weights into a model. HF -> Megatron builds the layout's model only for
its sharded state dict (keys, shapes, shards) and writes HF tensors through it; Megatron -> HF
reads the dist-checkpoint's tensors directly, split among the ranks by size whatever layout the
checkpoint was saved under (the layout given only sets the number of processes).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.half_write import HalfWrite
from megatron_gspo.hf import io as hf_io
from megatron_gspo.hf.shapes import check_tensors
from megatron_gspo.model import checkpoint as mckpt
from megatron_gspo.model import weights
from megatron_gspo.model.checkpoint_reader import DistCheckpointReader
from megatron_gspo.model.lora_ckpt import LORA_FILE
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import checkpoint_spec, hf_files_dir
from megatron_gspo.outputs import (
    check_new_output,
    signals_held,
    stop_if_terminated,
    terminate_raises,
)

SHARD_BYTES = 4 << 30  # largest HF shard file a rank writes
# a training run's checkpoint keeps the optimizer's state under these keys (train/optim_state.py)
OPTIMIZER_PREFIX = "optimizer."


def _check_inputs(src: Path, out: Path, dims: ParallelDims, want_megatron: bool):
    if want_megatron and not _has_model_files(src):
        raise UserError(
            f"{src} is neither a Megatron checkpoint (no {mckpt.META}) nor a training run's "
            "checkpoint (RUN_DIR/checkpoints/step_N); check --megatron"
        )
    spec, meta = checkpoint_spec(src)
    if want_megatron != (meta is not None):
        kind = "a Megatron" if want_megatron else "an HF"
        raise UserError(f"{src} is not {kind} checkpoint; check --hf / --megatron")
    check_new_output(out, "--out")
    dims.validate(spec)
    if meta is None:  # a missing or truncated file, or weights the config does not describe
        check_tensors(hf_io.HFReader(src).shapes(), spec, str(src))
    return spec


def _has_model_files(src: Path) -> bool:
    """Whether `src` is missing or has what says what model it is: a Megatron checkpoint's
    metadata, an HF config.json (refused as such), or LoRA adapters (their own line)."""
    if not src.is_dir() or mckpt.is_megatron_checkpoint(src):
        return True
    return (src / "config.json").is_file() or (src / "model" / LORA_FILE).is_file()


@contextlib.contextmanager
def shared_output(out: Path) -> Iterator[Path]:
    """Collective: a temporary directory beside `out` (made by rank 0) that every rank writes
    into, renamed to `out` once every rank finished the block. An error on any rank, SIGINT or
    SIGTERM removes it: a signal removes it at once (it stops every rank wherever it is, so the
    collectives that follow may never complete). Who removes it is `HalfWrite`'s rule: rank 0
    always (it renames it only once every rank's `ok` flag came), and each other rank cut short
    before it sent its flag. A rank stopped after sending it leaves it to rank 0: it may be
    renamed into place, complete."""
    box: list = [None]
    rank0 = dist.get_rank() == 0
    half = HalfWrite()
    with terminate_raises(), half:
        if rank0:
            out.parent.mkdir(parents=True, exist_ok=True)
            with signals_held():
                box[0] = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
                half.path = Path(box[0])
        dist.broadcast_object_list(box, src=0)
        half.path = tmp = Path(box[0])
        try:
            yield tmp
        except BaseException as e:
            if not isinstance(e, Exception):  # SIGINT, SIGTERM: at once
                half.remove()
            _settle(half, tmp, out, ok=False)
            raise
        _settle(half, tmp, out, ok=True)
        if rank0:
            half.remove()  # (gone once renamed; left where a rank's flag was not ok)


def _settle(half: HalfWrite, tmp: Path, out: Path, ok: bool) -> None:
    """Collective: every rank's `ok` flag to rank 0, which renames `tmp` to `out` when all
    are."""
    flags = half.gather(True if ok else None)  # (None: no share sent, this rank still removes)
    if dist.get_rank() == 0 and all(flags):
        stop_if_terminated()
        for f in tmp.rglob("*"):
            f.chmod(0o755 if f.is_dir() else 0o644)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    dist.barrier()


def _without_gc(fn):
    """Conversion makes next to no cyclic garbage; the collector's first full pass over all that
    the imports left behind (tenths of a second) is not worth taking in the middle of it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


@_without_gc
def hf_to_megatron(hf_dir: str | Path, out: str | Path, dims: ParallelDims) -> None:
    from megatron_gspo.model.builder import BuildOptions, build_model

    hf_dir, out = Path(hf_dir), Path(out)
    spec = _check_inputs(hf_dir, out, dims, want_megatron=False)
    init_distributed(dims)
    with shared_output(out) as tmp:
        reader = hf_io.HFReader(hf_dir)
        dtype = reader.dtype()
        # sequential experts: each entry of their sharded state is a view of one parameter
        opts = BuildOptions(params_dtype=dtype, moe_grouped_gemm=False)
        chunks = build_model(spec, dims, opts)
        state = weights.hf_sharded_state(chunks, reader)
        (tmp / "model").mkdir(exist_ok=True)
        dist.barrier()
        mckpt.save_sharded(state, tmp / "model", fsync=False, checksums=False)
        if dist.get_rank() == 0:
            (tmp / "hf").mkdir()
            hf_io.copy_non_weight_files(hf_dir, tmp / "hf")
            mckpt.write_meta(tmp, spec=spec, padded_vocab=chunks[0].padded_vocab_size, dtype=dtype)


@_without_gc
def megatron_to_hf(meg_dir: str | Path, out: str | Path, dims: ParallelDims) -> None:
    meg_dir, out = Path(meg_dir), Path(out)
    spec = _check_inputs(meg_dir, out, dims, want_megatron=True)
    dist_checkpoint_to_hf(meg_dir / "model", hf_files_dir(meg_dir), spec, out, dims)


def dist_checkpoint_to_hf(
    model_dir: Path, hf_files: Path, spec, out: Path, dims: ParallelDims
) -> None:
    """Collective: the model tensors of dist-checkpoint `model_dir` (an optimizer's state beside
    them, as a training run's checkpoint holds, is left out) as the HF checkpoint `out` of the
    model `spec` describes, with `hf_files`' config.json, tokenizer and generation files."""
    init_distributed(dims)
    with shared_output(out) as tmp:
        reader = DistCheckpointReader(model_dir)
        reader.tensors = {
            k: v for k, v in reader.tensors.items() if not k.startswith(OPTIMIZER_PREFIX)
        }
        try:
            params = weights.stored_params(reader, spec)
            where = str(model_dir.parent)
            check_tensors(weights.stored_hf_shapes(reader, params, spec), spec, where)
            weights.check_vocab_padding(reader, params, spec)
            mine = _my_share(params, reader)
            tensors = (t for sp in mine for t in weights.read_stored(reader, sp, spec))
            written = write_rank_shards(tensors, tmp)
        finally:
            reader.close()
        name_shards(tmp, written)
        if dist.get_rank() == 0:
            hf_io.copy_model_files(hf_files, tmp)


def _my_share(params: list, reader) -> list:
    """This rank's parameters: largest first to the least loaded rank (the same split on every
    rank), then in file order so each rank reads its files front to back."""
    load = [0] * dist.get_world_size()
    mine = []
    for sp in sorted(params, key=lambda sp: -sp.nbytes):
        r = load.index(min(load))
        load[r] += sp.nbytes
        if r == dist.get_rank():
            mine.append(sp)
    return sorted(mine, key=lambda sp: (reader.where(sp.key), sp.index))


def write_rank_shards(tensors, tmp: Path) -> list[tuple[str, list[str], int]]:
    """Save (name, tensor) pairs in files of at most SHARD_BYTES; returns
    [(filename, tensor names, bytes)] for this rank."""
    rank = dist.get_rank()
    files, pending, size = [], {}, 0

    def flush():
        nonlocal pending, size
        if pending:
            name = f"rank{rank:05d}-{len(files):05d}.safetensors"
            hf_io.write_shard(tmp / name, pending)
            files.append((name, list(pending), size))
            pending, size = {}, 0

    for name, tensor in tensors:
        pending[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    return files


def name_shards(tmp: Path, written) -> None:
    """Rank 0 renames every rank's files to HF's model-0000i-of-0000N and writes the index."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, written)
    if dist.get_rank() != 0:
        return
    files = [f for per_rank in everything for f in per_rank]
    total = sum(f[2] for f in files)
    if len(files) == 1:
        os.replace(tmp / files[0][0], tmp / "model.safetensors")
        return
    weight_map = {}
    for i, (name, tensors, _) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        weight_map.update({t: final for t in tensors})
    hf_io.write_index(tmp, weight_map, total)
