"""`megatron-gspo convert megatron-to-hf` of a training run's checkpoint, RUN_DIR/checkpoints/step_N.

Its model/ holds the trained weights (beside the optimizer's state) but not what model they are:
that comes from the model the run started from, model.path in RUN_DIR/config.yaml (an HF
checkpoint, or a Megatron one from `convert hf-to-megatron`), whose config.json and tokenizer go
with the weights. The weights keep the dtype they were trained in (model.dtype), and config.json's
dtype is set to it (hf/io.py's `copy_model_files`). The checkpoint is verified against its
manifest before anything is written. A LoRA run's checkpoint holds adapters only: `convert
lora-to-hf` merges them into their base.
A Megatron checkpoint of `convert hf-to-megatron` goes to model/convert.py as before.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.model import convert
from megatron_gspo.model.checkpoint import is_megatron_checkpoint
from megatron_gspo.model.lora_ckpt import LORA_FILE, newest_step
from megatron_gspo.model.parallel import ParallelDims
from megatron_gspo.outputs import check_new_output
from megatron_gspo.train import checkpointing
from megatron_gspo.yaml_io import read_yaml


def megatron_to_hf(path: str | Path, out: str | Path, dims: ParallelDims) -> None:
    """A Megatron checkpoint, or a full-weight training run's checkpoint, as an HF checkpoint
    at `out` (collective)."""
    path, out = Path(path), Path(out)
    _check_not_a_run_dir(path)
    if is_run_checkpoint(path):
        run_checkpoint_to_hf(path, out, dims)
    else:  # (a Megatron checkpoint; a LoRA run's checkpoint or anything else: its own line)
        convert.megatron_to_hf(path, out, dims)


def is_run_checkpoint(path: Path) -> bool:
    """A full-weight training run's checkpoint (train/checkpointing.py), damaged or not."""
    if not (path / "model").is_dir() or is_megatron_checkpoint(path):
        return False
    if (path / "model" / LORA_FILE).is_file():
        return False
    return any((path / f).is_file() for f in (checkpointing.STATE_FILE, checkpointing.MANIFEST))


def refuse_run_checkpoint(path: Path, flag: str) -> None:
    """A full-weight training run's checkpoint, or its run directory, given as `flag` to a
    command that loads an HF or Megatron checkpoint (score): its weights sit beside the
    optimizer's state and its model's files are its run's model.path, so the line names the
    export that makes an HF checkpoint of it (a LoRA run's checkpoint has its own line)."""
    ckpt: Path | None = path
    what = "checkpoint"
    if not is_run_checkpoint(path) and not (path / "config.json").is_file():
        ckpt, what = newest_step(path / "checkpoints"), "directory"
    if ckpt is None or not is_run_checkpoint(ckpt):
        return
    which = "it" if ckpt == path else "one of its checkpoints"
    e_g = "" if ckpt == path else ", e.g. the newest"
    raise UserError(
        f"{path} is a training run's {what}, not an HF or Megatron checkpoint; export {which} "
        f"to HF first{e_g}: megatron-gspo convert megatron-to-hf --megatron {ckpt} --out "
        f"NEW_DIR, then pass {flag} NEW_DIR"
    )


def run_checkpoint_to_hf(ckpt: Path, out: Path, dims: ParallelDims) -> None:
    """Collective: the trained weights of `ckpt` with its run's model files, at `out`."""
    from megatron_gspo.hf.config import load_hf_config, model_spec
    from megatron_gspo.model.policy import hf_files_dir

    base = run_base(ckpt)
    check_new_output(out, "--out")
    hf_files = hf_files_dir(base)
    spec = model_spec(load_hf_config(hf_files))
    dims.validate(spec)
    _verify(ckpt)
    convert.dist_checkpoint_to_hf(ckpt / "model", hf_files, spec, out, dims)


def run_base(ckpt: Path) -> Path:
    """The model the run of checkpoint `ckpt` started from (its config.yaml's model.path), there
    still; else a UserError naming it and what to do."""
    config = ckpt.parent.parent / "config.yaml"
    if ckpt.parent.name != "checkpoints":
        raise UserError(
            f"{ckpt} is a training run's checkpoint outside its run, whose config.yaml names the "
            "model it was trained from (model.path); export it where its run left it: "
            "--megatron RUN_DIR/checkpoints/step_N"
        )
    if not config.is_file():
        raise UserError(
            f"{config}, which names the model {ckpt} was trained from (model.path), is missing; "
            "re-copy the run's config.yaml"
        )
    cfg = read_yaml(config)
    model = cfg.get("model") if isinstance(cfg, dict) else None
    path = model.get("path") if isinstance(model, dict) else None
    if not isinstance(path, str) or not path:
        raise UserError(f"{config} has no model.path string; re-copy the run's config.yaml")
    base = Path(path)
    if not (base.is_dir() and (is_megatron_checkpoint(base) or (base / "config.json").is_file())):
        where = "" if base.is_absolute() else f" (relative to {Path.cwd()})"
        raise UserError(
            f"{ckpt}'s model comes from the model its run started from, {path}{where} "
            f"(model.path in {config}), which is not there: run the command in the directory "
            "the run was started from, or put that model back at that path"
        )
    return base


def _verify(ckpt: Path) -> None:
    """Rank 0 checks each file of `ckpt` against its manifest; every rank gets the answer."""
    import torch.distributed as dist

    from megatron_gspo.model.parallel import start_process_group

    start_process_group()
    box = [checkpointing.verify(ckpt) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UserError(
            f"checkpoint {ckpt} does not verify ({box[0]}); re-copy it, or export another of "
            "its run's checkpoints"
        )


def _check_not_a_run_dir(path: Path) -> None:
    """A run directory (or its checkpoints/) given for a checkpoint: the one to pass."""
    if is_run_checkpoint(path):
        return
    for where, what in ((path / "checkpoints", "a run directory"),
                        (path, "a run's directory of checkpoints")):  # fmt: skip
        newest = newest_step(where)
        if newest is not None:
            raise UserError(
                f"{path} is {what}, not a checkpoint; pass one of its checkpoints, e.g. the "
                f"newest: --megatron {newest}"
            )
