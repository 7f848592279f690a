"""Where the trainer starts the rollout servers they load model.path's HF weights: a Megatron
checkpoint (its hf/ holds the config and tokenizer only) is refused at the start, naming the
conversion; servers of one's own (rollout.urls) started on whatever copy they load, so there it
is taken (the end-to-end refusal: tests/e2e/test_run_export.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.data.task_model import check_server_weights
from megatron_gspo.errors import UserError
from megatron_gspo.model.checkpoint import META

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"


def test_a_megatron_model_path_is_refused_only_where_the_trainer_starts_the_servers(tmp_path):
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    (mcore / "hf").mkdir(parents=True)
    (mcore / META).write_text("{}")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        check_server_weights(str(mcore), [])
    assert str(e.value) == (
        f"model.path {mcore} is a Megatron checkpoint, and the rollout servers the trainer starts "
        f"load HF weights: convert it first (megatron-gspo convert megatron-to-hf --megatron "
        f"{mcore} --out HF_DIR), then pass model.path=HF_DIR"
    )
    check_server_weights(str(hf), [])
    check_server_weights(str(mcore), ["http://127.0.0.1:30000"])


def test_a_launch_refuses_a_megatron_model_path_before_any_server_starts(tmp_path, tiny_models):
    """launch/serve_node.py started each server on the checkpoint's hf/ (config and tokenizer
    only), where each failed to load its weights; plan.py (torchrun.sh's check) and serve_node.py
    now refuse first with train's line."""
    root = Path(__file__).resolve().parents[2]
    moe_megatron = tmp_path / "mcore"  # (what the launch reads of one: its meta file and hf/)
    shutil.copytree(tiny_models["moe"], moe_megatron / "hf")
    (moe_megatron / META).write_text("{}")
    line = (
        f"error: model.path {moe_megatron} is a Megatron checkpoint, and the rollout servers the "
        "trainer starts load HF weights: convert it first (megatron-gspo convert megatron-to-hf "
        f"--megatron {moe_megatron} --out HF_DIR), then pass model.path=HF_DIR\n"
    )
    run = lambda *cmd: subprocess.run(  # noqa: E731
        [sys.executable, *cmd, f"model.path={moe_megatron}"], capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    r = run(str(root / "launch/plan.py"), "--config", str(CONFIG))
    assert (r.returncode, r.stderr, r.stdout) == (2, line, "")
    r = run(str(root / "launch/serve_node.py"), "servers", "--config", str(CONFIG),
            "--log-dir", str(tmp_path / "logs"), "--urls-file", str(tmp_path / "urls.txt"))  # fmt: skip
    assert (r.returncode, r.stderr) == (2, line)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "urls.txt").exists()
