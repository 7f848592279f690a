"""rollout.urls at built-in servers the trainer did not start: one serving another model (another
vocabulary) is refused at start, before anything trains; one serving the model being trained is
taken (rollout/served_model.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.train.fleet import ServerFleet
from megatron_gspo.train.io_thread import IoThread
from tests.e2e.server_process import running_server
from tests.helpers import QUICK_TRAIN, cli_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    return {
        # (the other's token ids all fit the trained vocabulary: nothing else would notice)
        "trained": make_tiny_model(TinySpec(vocab_size=160), root / "trained"),
        "other": make_tiny_model(TinySpec(seed=5), root / "other"),  # 128 tokens
    }


def _start_fleet(trained: Path, url: str, run_dir: Path) -> None:
    """ServerFleet.start as rank 0 runs it, for `trained` with rollout.urls = [url]."""
    cfg = load_config(None, [f"model.path={trained}", f"rollout.urls=[{url}]"])
    io = IoThread()
    try:
        ServerFleet.start(cfg, run_dir, trained, io, lambda: 8).close()
    finally:
        io.close()


def _refusal(url: str, models: dict[str, Path], trained: Path) -> str:
    return (
        f"{url} serves {models['other'].resolve()} (a vocabulary of 128 tokens), not the model "
        f"being trained, {trained} (160 tokens): its token ids would be another vocabulary's; "
        f"point rollout.urls at servers of {trained}"
    )


def test_a_server_of_another_model_is_refused_at_start_and_one_of_this_model_is_taken(
    models, tmp_path
):
    """The start used to take any server that answered /health: another model's token ids
    were trained on without a word. (The built-in server says its vocabulary; SGLang does not,
    and the checkpoint at its model path is read instead: tests/unit/test_rollout_client.py.)"""
    trained = models["trained"]
    with running_server(models["other"]) as url:
        with urllib.request.urlopen(url + "/model_info", timeout=30) as answer:
            assert json.load(answer)["vocab_size"] == 128
        with pytest.raises(UserError) as e:
            _start_fleet(trained, url, tmp_path / "a")
    assert str(e.value) == _refusal(url, models, trained)
    with running_server(trained) as url:
        _start_fleet(trained, url, tmp_path / "b")


def test_train_at_a_server_of_another_model_exits_2_before_it_trains(models, tmp_path):
    trained, run_dir = models["trained"], tmp_path / "run"
    with running_server(models["other"]) as url:
        cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config",
               str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run_dir),
               "--steps", "2", f"model.path={trained}", *QUICK_TRAIN, f"rollout.urls=[{url}]"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                           timeout=600)  # fmt: skip
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert errors == [f"error: {_refusal(url, models, trained)}"], out[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()
