"""The built-in tasks' starting models, named without making one: the presets' shapes and the
check that model.path is there, naming the command that makes it where it is not.

Light on purpose (no torch, no Megatron): the launch scripts (launch/plan.py, serve_node.py)
check a config with it before anything starts; making the model is data/warmstart.py's work.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.hf.tokenizer_files import MEGATRON_META, check_tokenizer

# Named model shapes (each with its task); flags and knobs override them. drift: many MoE layers
# of many small experts and a long answer, where routing drifts and token-level ratios are noisy;
# drift_long: the same shape on sortlong20's 40-token answers (the answer-length lever).
_DRIFT_SHAPE = {"layers": 6, "hidden": 64, "experts": 32, "topk": 4, "moe_ffn": 32}
PRESETS: dict[str, dict] = {
    "drift": {"task": "sortlong", **_DRIFT_SHAPE},
    "drift_long": {"task": "sortlong20", **_DRIFT_SHAPE},
}


def check_model_path(path: str, train_source: str) -> None:
    """model.path is a directory, or a one-line error naming how to get one there: for a
    built-in task, the command that makes its starting model (as scripts/quickstart.sh does). A
    file there is named as such (making a model over it would only fail again). A model there
    must have its tokenizer (hf/tokenizer_files.py)."""
    if Path(path).is_dir():
        check_tokenizer(path, "model.path")
        return
    if Path(path).exists():
        raise UserError(
            f"model.path {path} is a file, not a model directory (an HF checkpoint: config.json "
            "and *.safetensors, or a Megatron checkpoint from `megatron-gspo convert "
            "hf-to-megatron`); point model.path at one"
        )
    fix = "point model.path at an HF or Megatron checkpoint"
    if train_source.startswith("builtin:"):
        task = train_source.removeprefix("builtin:")
        command = f"megatron-gspo make-task-model {make_task_model_flags(task)} --out {path}"
        fix += f", or make {task}'s starting model there: {command}"
    raise UserError(f"model.path {path} does not exist: {fix}")


def check_server_weights(path: str, urls: list[str]) -> None:
    """The rollout servers the trainer or a launch starts (no rollout.urls) load model.path's HF
    weights, which a Megatron checkpoint does not hold (its hf/ has the config and tokenizer
    only: each server failed on it after the run directory was written): refused in one line,
    naming the conversion. Servers of one's own (rollout.urls) load whatever copy they were
    started on."""
    if urls or not (Path(path) / MEGATRON_META).is_file():
        return
    raise UserError(
        f"model.path {path} is a Megatron checkpoint, and the rollout servers the trainer starts "
        "load HF weights: convert it first (megatron-gspo convert megatron-to-hf --megatron "
        f"{path} --out HF_DIR), then pass model.path=HF_DIR"
    )


def make_task_model_flags(task: str) -> str:
    """make-task-model's flags for a built-in task's starting model: its preset's (sortlong:
    the drift preset), else --task."""
    preset = next((name for name, p in PRESETS.items() if p["task"] == task), None)
    return f"--task {task}" if preset is None else f"--preset {preset}"
