"""`megatron-gspo convert lora-to-hf`: a LoRA run's checkpoint -> the merged HF model (W + s * B A,
which any server loads without LoRA support) and the adapters in PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` loads
onto the base model).

The checkpoint names its base (lora.json: path and fingerprint); the base is loaded from there,
or from `--base` (a base moved since: lora.json is listed in the checkpoint's manifest, so it is
not edited), and must still match, checked before anything is loaded. Adapters load under any
layout (dist-checkpoint resharding).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.hf import io as hf_io
from megatron_gspo.model import lora_ckpt
from megatron_gspo.model.lora import is_lora_param
from megatron_gspo.model.lora_config import LoraConfig
from megatron_gspo.model.lora_peft import all_factors, peft_config, peft_tensors
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.outputs import check_new_output

PEFT_DIR = "adapter"  # under --out: the PEFT adapter beside the merged model


def adapter_shapes(chunks) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: global shape} of the adapters the chunks hold, over every rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_gspo.model.checkpoint import sharded_model_state

    mine = {}
    for sd in sharded_model_state(chunks).values():
        adapters = {name: sh for name, sh in sd.items() if is_lora_param(name)}
        for t in nested_values(adapters):
            if isinstance(t, ShardedTensor):
                mine[t.key] = tuple(t.global_shape)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for p in parts for k, v in p.items()}


def check_adapters(chunks, directory: Path) -> None:
    """The checkpoint at `directory` holds exactly the adapters lora.json implies, each of its
    shape: a record that names fewer targets or another rank than the tensors would otherwise
    drop trained adapters without a word, or fail deep inside the load."""
    from megatron_gspo.model.checkpoint_reader import DistCheckpointReader

    reader = DistCheckpointReader(directory)
    try:
        found = {
            k: reader.shape(k)
            for k in reader.keys()
            if is_lora_param(k) and not k.startswith("optimizer.")
        }
    finally:
        reader.close()
    want = adapter_shapes(chunks)
    where = f"{directory / lora_ckpt.LORA_FILE} disagrees with the adapters saved beside it"
    odd = sorted(set(want) ^ set(found))
    if odd:
        which = "lacks" if odd[0] in want else "also holds"
        raise UserError(
            f"{where}: {len(odd)} adapter tensor(s) differ, e.g. the checkpoint {which} {odd[0]}; "
            "fix lora.json or re-copy the checkpoint"
        )
    for key, shape in want.items():
        if found[key] != shape:
            raise UserError(f"{where}: {key} is {found[key]}, lora.json implies {shape}")


def load_adapters(chunks, directory: Path) -> None:
    """Fill the adapters of `chunks` from a run checkpoint's model/ (collective)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_gspo.model.checkpoint import (
        LOAD_ERRORS,
        load_error,
        sharded_model_state,
        take_over,
    )

    model = sharded_model_state(chunks)
    model = {k: {n: v for n, v in sd.items() if is_lora_param(n)} for k, sd in model.items()}
    try:
        state = dist_checkpointing.load({"model": model}, str(directory))
    except LOAD_ERRORS as e:  # a truncated or damaged file, in any form
        # (torch's CheckpointException here: adapter shapes are checked before, so a file)
        is_file = isinstance(e, CheckpointException)
        first = "a file is truncated or corrupt" if is_file else load_error(e)
        raise UserError(f"cannot read dist-checkpoint {directory} ({first}); re-copy it") from None
    for i, chunk in enumerate(chunks):
        take_over(chunk, state["model"][f"model{i}"], directory, copy=True, keep=is_lora_param)


def lora_to_hf(
    checkpoint: str | Path, out: str | Path, dims: ParallelDims, base: str | Path | None = None
) -> None:
    """Write the merged HF model to `out` and the PEFT adapter to `out`/adapter (collective);
    the base model is `base` when given, else the one lora.json records."""
    from megatron_gspo.model.convert import (
        name_shards,
        shared_output,
        write_rank_shards,
    )
    from megatron_gspo.model.policy import hf_files_dir, load_policy
    from megatron_gspo.model.weights import iter_hf

    checkpoint, out = lora_ckpt.checkpoint_dir(Path(checkpoint)), Path(out)
    rec, cfg = read_lora(checkpoint)
    base = check_base(checkpoint, rec, base)
    check_new_output(out, "--out")
    init_distributed(dims)
    chunks = load_policy(base, dims, lora=cfg)
    built = lora_ckpt.lora_record(chunks)
    if built is None:
        raise UserError(f"{checkpoint}'s lora.json targets no module of the model at {base}")
    if built["base_fingerprint"] != rec["base_fingerprint"]:  # (changed while loading)
        raise UserError(f"the base at {base} changed since {checkpoint} was saved")
    check_adapters(chunks, checkpoint / "model")
    load_adapters(chunks, checkpoint / "model")
    with shared_output(out) as tmp:
        name_shards(tmp, write_rank_shards(iter_hf(chunks), tmp))
        tensors = peft_tensors(all_factors(chunks), cfg)
        if dist.get_rank() == 0:
            hf_io.copy_model_files(hf_files_dir(base), tmp)  # (its dtype: the merged weights')
            write_peft(tmp / PEFT_DIR, tensors, cfg, base, chunks[0].model_spec)


def read_lora(checkpoint: Path) -> tuple[dict, LoraConfig]:
    """The checkpoint's lora.json record and adapters' config; a full-weight checkpoint (no
    lora.json) is pointed at the command that converts it."""
    if not (checkpoint / "model" / lora_ckpt.LORA_FILE).is_file():
        raise UserError(
            f"{checkpoint} holds no LoRA adapters (no model/{lora_ckpt.LORA_FILE}): a full-weight "
            f"checkpoint converts with: megatron-gspo convert megatron-to-hf --megatron "
            f"{checkpoint} --out OUT"
        )
    return lora_ckpt.read_record(checkpoint / "model")


def check_base(checkpoint: Path, rec: dict, given: str | Path | None = None) -> str:
    """The LoRA base to load: `given` (--base) or the one lora.json records (base_path), there
    and with the files the adapters were trained on (base_fingerprint), checked before anything
    is loaded or written."""
    if given is not None:
        return check_given_base(Path(given), checkpoint, rec)
    base, where = rec["base_path"], checkpoint / "model" / lora_ckpt.LORA_FILE
    fix = (
        "put the base model the adapters were trained on back there, or pass --base PATH where "
        "it is now"
    )
    if not Path(base).is_dir():
        what = "is not a directory" if Path(base).exists() else "does not exist"
        raise UserError(f"the LoRA base model {base} (base_path in {where}) {what}; {fix}")
    if lora_ckpt.fingerprint(base) != rec["base_fingerprint"]:
        raise UserError(
            f"the LoRA base model {base} (base_path in {where}) changed since {checkpoint} was "
            f"saved (its files differ from base_fingerprint); {fix}"
        )
    return base


def check_given_base(base: Path, checkpoint: Path, rec: dict) -> str:
    """`--base`, used in place of the recorded base: a directory whose files are the ones the
    adapters were trained on (base_fingerprint in lora.json); its resolved path."""
    where = checkpoint / "model" / lora_ckpt.LORA_FILE
    trained = f"the base model the adapters were trained on ({rec['base_path']} when saved)"
    if not base.is_dir():
        what = "is not a directory" if base.exists() else "does not exist"
        raise UserError(f"--base {base} {what}; pass the directory of {trained}")
    if lora_ckpt.fingerprint(base) != rec["base_fingerprint"]:
        raise UserError(
            f"--base {base} is not {trained}: its files differ from base_fingerprint in {where}; "
            "pass that model's directory"
        )
    return str(base.resolve())


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
