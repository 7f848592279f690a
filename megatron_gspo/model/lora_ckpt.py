"""A LoRA run's checkpoint: the adapters and their optimizer state, plus `lora.json` naming the
frozen base (its path and a fingerprint) and the adapters' config.

The base weights are not written again: on `--resume` they are loaded from the base path (the
run's model.path) and the fingerprint must match. The fingerprint is a SHA-256 over each weight
file's name, size, safetensors header and its first and last MiB, plus config.json: it catches
another checkpoint or a rewritten file without reading a 60 GB model at every save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig

LORA_FILE = "lora.json"
_STEP = re.compile(r"step_(\d+)")  # RUN_DIR/checkpoints/step_N (train/checkpointing.py)
_MIB = 1 << 20


def fingerprint(path: str | Path) -> str:
    """SHA-256 over the base checkpoint's config and weight files (see the module docstring)."""
    root = Path(path)
    h = hashlib.sha256()
    files = sorted([*root.glob("*.safetensors"), *root.glob("model/**/*"), root / "config.json"])
    for f in files:
        if not f.is_file():
            continue
        size = f.stat().st_size
        h.update(f"{f.relative_to(root)}:{size}\n".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_MIB))
            if size > 2 * _MIB:
                fh.seek(size - _MIB)
                h.update(fh.read(_MIB))
    return h.hexdigest()


def record(path: str | Path, cfg) -> dict:
    """What a checkpoint of adapters on the base at `path` stores about it."""
    return {
        "base_path": str(Path(path).resolve()),
        "base_fingerprint": fingerprint(path),
        "lora": {
            k: str(v) if isinstance(v, str) else v for k, v in dataclasses.asdict(cfg).items()
        },
    }


def lora_record(modules) -> dict | None:
    """The record the chunks carry (set when adapters were attached), None without LoRA."""
    return getattr(modules[0], "lora_record", None)


def write(directory: Path, modules) -> None:
    rec = lora_record(modules)
    if rec is not None:
        (Path(directory) / LORA_FILE).write_text(json.dumps(rec, indent=2) + "\n")


def check(directory: Path, modules) -> None:
    """The checkpoint at `directory` holds adapters for this model's base (or neither has)."""
    rec, path = lora_record(modules), Path(directory) / LORA_FILE
    if rec is None and not path.is_file():
        return
    if rec is None:
        raise UserError(f"{directory} holds LoRA adapters; set lora.rank (see {path}) to resume it")
    if not path.is_file():
        raise UserError(f"{directory} is a full-weight checkpoint; set lora.rank=0 to resume it")
    saved = json.loads(path.read_text())
    if saved["base_fingerprint"] != rec["base_fingerprint"]:
        raise UserError(
            f"{directory}'s adapters were trained on {saved['base_path']}, whose files differ "
            f"from model.path {rec['base_path']}; point model.path at that base"
        )
    differ = shape_differences(saved["lora"], rec["lora"])
    if differ:
        raise UserError(
            f"{directory}'s adapters have {differ}, which set their shapes; resume with those "
            "(the run's config), or start another run with --run-dir NEW_DIR"
        )


# The lora: keys that set the adapters' tensors (their names and shapes); alpha and dropout
# change only what they compute.
SHAPE_KEYS = ("rank", "targets", "experts")


def shape_differences(saved: dict, now: dict) -> str:
    """The shape-setting keys where a checkpoint's adapters (`saved`) differ from the config's
    (`now`), as "lora.rank=16 (not 8), ..."; "" where none does."""
    out = []
    for key in SHAPE_KEYS:
        a, b = saved.get(key), now.get(key)
        if key == "targets":
            a, b = sorted(a or []), sorted(b or [])
        if a != b:
            out.append(f"lora.{key}={_show(saved.get(key))} (not {_show(now.get(key))})")
    return ", ".join(out)


def _show(value) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def checkpoint_dir(checkpoint: Path) -> Path:
    """`checkpoint` when it can be one: else a UserError for a missing path or a file, and for a
    run directory (or its checkpoints/) one naming the checkpoint to pass, the newest there."""
    checkpoint = Path(checkpoint)
    want = "pass a LoRA run's checkpoint, RUN_DIR/checkpoints/step_N"
    if not checkpoint.exists():
        there = newest_step(checkpoint.parent)
        also = f" (the newest there: {there})" if there is not None else ""
        raise UserError(f"{checkpoint} does not exist; {want}{also}")
    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint} is a file; {want}")
    for where, what in ((checkpoint / "checkpoints", "a run directory"), (checkpoint, "")):
        newest = newest_step(where)
        if newest is not None:
            what = what or "a directory of checkpoints"
            raise UserError(
                f"{checkpoint} is {what}, not a checkpoint; pass one of its checkpoints, "
                f"e.g. the newest: --checkpoint {newest}"
            )
    if (checkpoint / "checkpoints").is_dir():
        raise UserError(f"{checkpoint} is a run directory with no checkpoint yet; {want}")
    return checkpoint


def newest_step(directory: Path) -> Path | None:
    """The step_N directory with the largest N in `directory` (None: none, or no directory)."""
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP.fullmatch(p.name)) and p.is_dir()]  # fmt: skip
    return max(steps)[1] if steps else None


def read_record(directory: Path) -> tuple[dict, LoraConfig]:
    """The record a checkpoint's model/ `directory` holds, and its adapters' config, fully
    checked (UserError naming the file): a hand-edited or damaged lora.json must fail here, not
    as a traceback inside the model build or as adapters merged at the wrong scale."""
    path = Path(directory) / LORA_FILE
    if not path.is_file():
        raise UserError(f"{directory.parent} holds no LoRA adapters (no model/{LORA_FILE})")
    try:
        rec = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-copy the checkpoint") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("lora"), dict):
        raise UserError(f'{path} has no "lora" object; re-copy the checkpoint')
    for key in ("base_path", "base_fingerprint"):
        if not isinstance(rec.get(key), str):
            raise UserError(f"{path} has no {key} string; re-copy the checkpoint")
    return rec, _config(rec["lora"], path)


def _config(saved: dict, path: Path) -> LoraConfig:
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    if set(saved) != fields:
        odd = sorted(set(saved) ^ fields)
        raise UserError(f'{path}: "lora" must hold exactly {sorted(fields)} (not so: {odd})')
    try:
        experts = ExpertAdapters(saved["experts"])
    except ValueError:
        choices = [e.value for e in ExpertAdapters]
        raise UserError(
            f"{path}: lora.experts {saved['experts']!r} is not one of {choices}"
        ) from None
    rank, targets = saved["rank"], saved["targets"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"{path}: lora.rank must be an integer >= 1, not {rank!r}")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise UserError(f"{path}: lora.targets must be a list of names, not {targets!r}")
    cfg = LoraConfig(**{**saved, "experts": experts})
    try:
        cfg.check()  # alpha a finite number > 0, dropout in [0, 1), known targets
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    return cfg
