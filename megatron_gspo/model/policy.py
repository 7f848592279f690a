"""Load the policy from an HF or a Megatron checkpoint directory into this rank's model chunks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import ModelSpec, load_hf_config, model_spec
from megatron_gspo.hf.io import HFReader
from megatron_gspo.model import checkpoint as mckpt
from megatron_gspo.model import lora_ckpt
from megatron_gspo.model.builder import BuildOptions, build_model
from megatron_gspo.model.lora_apply import apply_lora
from megatron_gspo.model.lora_config import LoraConfig
from megatron_gspo.model.parallel import ParallelDims


def checkpoint_spec(path: str | Path) -> tuple[ModelSpec, dict | None]:
    """The model description of a checkpoint, and its Megatron metadata (None for HF)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    if (path / "model" / lora_ckpt.LORA_FILE).is_file():  # adapters only, no model weights
        raise UserError(
            f"{path} holds LoRA adapters, not a model; make the model with `megatron-gspo "
            f"convert lora-to-hf --checkpoint {path} --out NEW_DIR` and use that"
        )
    if mckpt.is_megatron_checkpoint(path):
        meta = mckpt.read_meta(path)
        return model_spec(load_hf_config(path / "hf")), meta
    return model_spec(load_hf_config(path)), None


def hf_files_dir(path: str | Path) -> Path:
    """Where a checkpoint keeps its HF config and tokenizer."""
    path = Path(path)
    return path / "hf" if mckpt.is_megatron_checkpoint(path) else path


def load_policy(
    path: str | Path, dims: ParallelDims, opts: BuildOptions | None = None,
    lora: LoraConfig | None = None, seed: int = 0,
):  # fmt: skip
    """Build the chunks for `dims` and fill them from `path`; with `lora` on, freeze them and
    attach adapters (initialized from `seed`). Parallel state must exist."""
    import torch

    spec, meta = checkpoint_spec(path)
    opts = opts or BuildOptions()
    if lora is not None and spec.is_moe:  # experts its adapters can sit on (auto: decided here)
        opts = replace(
            opts, moe_grouped_gemm=lora.experts_build(opts.moe_grouped_gemm, opts.uses_te())
        )
    if meta is None:
        reader = HFReader(path)
        opts = replace(opts, params_dtype=opts.params_dtype or reader.dtype())
        chunks = build_model(spec, dims, opts)
        from megatron_gspo.model.weights import load_hf

        load_hf(chunks, reader)
    else:
        dtype = getattr(torch, meta["dtype"])
        opts = replace(
            opts,
            params_dtype=opts.params_dtype or dtype,
            padded_vocab_size=meta["padded_vocab_size"],
        )
        chunks = build_model(spec, dims, opts)
        mckpt.load_model(chunks, Path(path) / "model")
    if lora is not None and apply_lora(chunks, lora, seed):
        rec = lora_ckpt.record(path, lora)  # the base a checkpoint of adapters needs
        for chunk in chunks:
            chunk.lora_record = rec
    return chunks
