"""`convert lora-to-hf --checkpoint PATH`: a path that is not a checkpoint gets the line that names
what to pass (a missing path, a file, a run directory, its checkpoints/), not 'holds no LoRA
adapters'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.errors import UserError
from megatron_gspo.model.lora_ckpt import LORA_FILE, checkpoint_dir


def _run_dir(root: Path, steps: list[int]) -> Path:
    run = root / "lora"
    for n in steps:
        (run / "checkpoints" / f"step_{n}" / "model").mkdir(parents=True)
    (run / "checkpoints" / ".step_99.tmp").mkdir(parents=True)  # a save cut short: not one
    (run / "checkpoints" / "unverified").mkdir()
    (run / "metrics.jsonl").write_text("")
    return run


def _error(path: Path) -> str:
    with pytest.raises(UserError) as e:
        checkpoint_dir(path)
    return str(e.value)


def test_a_missing_checkpoint_is_said_not_to_exist_and_the_newest_beside_it_named(tmp_path):
    run = _run_dir(tmp_path, [10, 30, 20])
    msg = _error(run / "checkpoints" / "step_40")
    assert msg.startswith(f"{run / 'checkpoints' / 'step_40'} does not exist; pass a LoRA run's")
    assert msg.endswith(f"(the newest there: {run / 'checkpoints' / 'step_30'})")
    assert _error(tmp_path / "nowhere").endswith("RUN_DIR/checkpoints/step_N")


@pytest.mark.parametrize("given", ["", "checkpoints"])
def test_a_run_directory_or_its_checkpoints_names_the_newest_checkpoint(tmp_path, given):
    run = _run_dir(tmp_path, [8, 40, 9])  # 40 > 9 as numbers, not as names
    msg = _error(run / given)
    what = "a directory of checkpoints" if given else "a run directory"
    assert msg == (
        f"{run / given} is {what}, not a checkpoint; pass one of its checkpoints, e.g. the "
        f"newest: --checkpoint {run / 'checkpoints' / 'step_40'}"
    )
    assert "no LoRA adapters" not in msg


def test_a_run_directory_without_checkpoints_and_a_file_say_so(tmp_path):
    run = _run_dir(tmp_path, [])
    assert "is a run directory with no checkpoint yet" in _error(run)
    assert _error(run / "metrics.jsonl").startswith(f"{run / 'metrics.jsonl'} is a file; pass")


def test_a_checkpoint_passes_and_reads_on(tmp_path):
    step = _run_dir(tmp_path, [5]) / "checkpoints" / "step_5"
    assert checkpoint_dir(step) == step
    (step / "model" / LORA_FILE).write_text("{}")
    assert checkpoint_dir(step) == step


def test_the_cli_says_it_on_one_line_and_exits_2(tmp_path):
    run = _run_dir(tmp_path, [40])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), OMP_NUM_THREADS="1")
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "megatron_gspo", "convert", "lora-to-hf", "--checkpoint"]
    proc = subprocess.run([*cmd, str(run), "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {run} is a run directory, not a checkpoint; pass one of its checkpoints, e.g. "
        f"the newest: --checkpoint {run / 'checkpoints' / 'step_40'}"
    ]
    assert not out.exists()


def _lora_step(tmp_path: Path, base: Path) -> Path:
    """A LoRA run's checkpoint whose lora.json records `base` (no adapter tensors: the checks
    below come before any is read)."""

    from megatron_gspo.model.lora_ckpt import record
    from megatron_gspo.model.lora_config import LoraConfig

    step = _run_dir(tmp_path, [5]) / "checkpoints" / "step_5"
    rec = record(base, LoraConfig(rank=2))
    (step / "model" / LORA_FILE).write_text(json.dumps(rec, indent=2) + "\n")
    return step


def test_lora_to_hf_names_the_recorded_base_and_how_to_supply_it(tmp_path, tiny_models, capsys):
    """The base moved away was "checkpoint BASE does not exist; check the path", though the
    user passed the run's checkpoint, which exists; a changed base named no fix; a full-weight
    checkpoint was not pointed at megatron-to-hf. Nothing is written in any case. The fix named
    for a moved base was to edit base_path in lora.json, which the checkpoint's manifest holds
    the checksum of: now it is --base."""
    import shutil

    from megatron_gspo import cli

    base = Path(shutil.copytree(tiny_models["moe"], tmp_path / "base"))
    step = _lora_step(tmp_path, base)
    where = step / "model" / LORA_FILE
    fix = "put the base model the adapters were trained on back there, or pass --base PATH where it is now"
    out = tmp_path / "hf"
    argv = ["convert", "lora-to-hf", "--checkpoint", str(step), "--out", str(out)]

    def error() -> str:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return err.strip()

    base.rename(tmp_path / "moved")
    assert (
        error() == f"error: the LoRA base model {base} (base_path in {where}) does not exist; {fix}"
    )
    (tmp_path / "moved").rename(base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert error() == (
        f"error: the LoRA base model {base} (base_path in {where}) changed since {step} was "
        f"saved (its files differ from base_fingerprint); {fix}"
    )
    where.unlink()
    assert error() == (
        f"error: {step} holds no LoRA adapters (no model/{LORA_FILE}): a full-weight checkpoint "
        f"converts with: megatron-gspo convert megatron-to-hf --megatron {step} --out OUT"
    )
    assert not out.exists()


@pytest.mark.parametrize("given", ["another model", "missing", "a file"])
def test_lora_to_hf_refuses_a_base_that_is_not_the_trained_one(
    tmp_path, tiny_models, capsys, given
):
    """--base is checked against the fingerprint lora.json records before anything is loaded:
    another model (here the recorded base is there too, and is not used) is one line naming
    both paths, and nothing is written."""
    from megatron_gspo import cli

    step = _lora_step(tmp_path, tiny_models["moe"])
    where = step / "model" / LORA_FILE
    (tmp_path / "f").write_text("")
    base = {"another model": tiny_models["moe_all"], "missing": tmp_path / "nowhere",
            "a file": tmp_path / "f"}[given]  # fmt: skip
    out = tmp_path / "hf"
    argv = ["convert", "lora-to-hf", "--checkpoint", str(step), "--base", str(base)]
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(out)])
    assert e.value.code == 2
    trained = f"the base model the adapters were trained on ({tiny_models['moe']} when saved)"
    assert capsys.readouterr().err.splitlines() == [
        {
            "another model": f"error: --base {base} is not {trained}: its files differ from "
            f"base_fingerprint in {where}; pass that model's directory",
            "missing": f"error: --base {base} does not exist; pass the directory of {trained}",
            "a file": f"error: --base {base} is not a directory; pass the directory of {trained}",
        }[given]
    ]
    assert not out.exists()
