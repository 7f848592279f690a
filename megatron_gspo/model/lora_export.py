"""`megatron-gspo convert lora-to-hf`: a LoRA run's checkpoint -> the merged HF model (W + s * B A,
which any server loads without LoRA support) and the adapters in PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` loads
onto the base model).

The checkpoint names its base (lora.json: path and fingerprint); the base is loaded from there
and must still match. Adapters load under any layout (dist-checkpoint resharding).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.hf import io as hf_io
from megatron_gspo.model import lora_ckpt
from megatron_gspo.model.lora import is_lora_param
from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig
from megatron_gspo.model.lora_peft import all_factors, peft_config, peft_tensors
from megatron_gspo.model.parallel import ParallelDims, init_distributed

PEFT_DIR = "adapter"  # under --out: the PEFT adapter beside the merged model


def read_record(checkpoint: Path) -> tuple[dict, LoraConfig]:
    path = checkpoint / "model" / lora_ckpt.LORA_FILE
    if not path.is_file():
        raise UserError(f"{checkpoint} holds no LoRA adapters (no model/{lora_ckpt.LORA_FILE})")
    rec = json.loads(path.read_text())
    cfg = dict(rec["lora"])
    cfg["experts"] = ExpertAdapters(cfg["experts"])
    return rec, LoraConfig(**cfg)


def load_adapters(chunks, directory: Path) -> None:
    """Fill the adapters of `chunks` from a run checkpoint's model/ (collective)."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.model.checkpoint import sharded_model_state, take_over

    model = sharded_model_state(chunks)
    model = {k: {n: v for n, v in sd.items() if is_lora_param(n)} for k, sd in model.items()}
    state = dist_checkpointing.load({"model": model}, str(directory))
    for i, chunk in enumerate(chunks):
        take_over(chunk, state["model"][f"model{i}"], directory, copy=True, keep=is_lora_param)


def lora_to_hf(checkpoint: str | Path, out: str | Path, dims: ParallelDims) -> None:
    """Write the merged HF model to `out` and the PEFT adapter to `out`/adapter (collective)."""
    from megatron_gspo.model.convert import (
        finish_output,
        name_shards,
        shared_tmpdir,
        write_rank_shards,
    )
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.model.weights import iter_hf

    checkpoint, out = Path(checkpoint), Path(out)
    rec, cfg = read_record(checkpoint)
    if out.exists():
        raise UserError(f"output path {out} exists; remove it or choose another --out")
    init_distributed(dims)
    chunks = load_policy(rec["base_path"], dims, lora=cfg)
    if chunks[0].lora_record["base_fingerprint"] != rec["base_fingerprint"]:
        raise UserError(f"the base at {rec['base_path']} changed since {checkpoint} was saved")
    load_adapters(chunks, checkpoint / "model")
    tmp, ok = shared_tmpdir(out), False
    try:
        name_shards(tmp, write_rank_shards(iter_hf(chunks), tmp))
        tensors = peft_tensors(all_factors(chunks), cfg)
        if dist.get_rank() == 0:
            hf_io.copy_non_weight_files(Path(rec["base_path"]), tmp)
            write_peft(tmp / PEFT_DIR, tensors, cfg, rec["base_path"], chunks[0].model_spec)
        ok = True
    finally:
        finish_output(tmp, out, ok)


def write_peft(directory: Path, tensors: dict, cfg: LoraConfig, base: str, spec) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    dense = not all(spec.moe_layers) if spec.is_moe else True
    config = peft_config(cfg, dense=dense)
    config.update(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base,
                  bias="none", fan_in_fan_out=False, inference_mode=True)  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors"
    )
