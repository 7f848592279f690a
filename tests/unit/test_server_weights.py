"""Where the trainer starts the rollout servers they load model.path's HF weights: a Megatron
checkpoint (its hf/ holds the config and tokenizer only) is refused at the start, naming the
conversion; servers of one's own (rollout.urls) started on whatever copy they load, so there it
is taken (the end-to-end refusal: tests/e2e/test_run_export.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.model.checkpoint import META
from megatron_gspo.train.setup import check_server_weights

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"


def test_a_megatron_model_path_is_refused_only_where_the_trainer_starts_the_servers(tmp_path):
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    (mcore / "hf").mkdir(parents=True)
    (mcore / META).write_text("{}")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        check_server_weights(load_config(CONFIG, [f"model.path={mcore}"]))
    assert str(e.value) == (
        f"model.path {mcore} is a Megatron checkpoint, and the rollout servers the trainer starts "
        f"load HF weights: convert it first (megatron-gspo convert megatron-to-hf --megatron "
        f"{mcore} --out HF_DIR), then pass model.path=HF_DIR"
    )
    check_server_weights(load_config(CONFIG, [f"model.path={hf}"]))
    check_server_weights(
        load_config(CONFIG, [f"model.path={mcore}", "rollout.urls=[http://127.0.0.1:30000]"])
    )
