"""Weight sync into real SGLang 0.5.23 (CPU, its own venv; the contract tier, `-m contract`).

The same worker as the built-in server's weight-sync tests (tests/distributed/
weight_sync_worker.py): a Megatron trainer under each layout perturbs its policy and syncs it
into a running SGLang server once per transport (tensor: flattened buckets in shared memory;
distributed: gloo broadcast over SGLang's own weights-update group; disk: safetensors shards +
/update_weights_from_disk), with verify_every=1, which fails unless the server's log-probs of the
probe batch equal the trainer's (tolerance 1e-4; SGLang fp32 is within ~2e-6 of HF). Afterwards
the server reports the last version and serves its weights, far from every earlier version's.

SGLang's Qwen3-MoE ignores `mlp_only_layers`, so the checkpoint is all-MoE.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.launcher import ServerGroup
from tests.contract.sglang_venv import server_config
from tests.helpers import cli_env, torchrun

pytestmark = pytest.mark.contract

SPEC = TinySpec(layers=4, norm_topk_prob=False, seed=1)
WORKER = Path(__file__).parents[1] / "distributed" / "weight_sync_worker.py"
TOL = 1e-4
LAYOUTS = {  # id: (processes, flags); ids carry "sglang" so the tier selects them
    "sglang-tp1": (1, []),
    "sglang-tp2": (2, ["--tp", "2"]),
    "sglang-ep2": (2, ["--ep", "2"]),
    "sglang-pp2": (2, ["--pp", "2"]),
    "sglang-tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(SPEC, tmp_path_factory.mktemp("wsync") / "moe")


@pytest.fixture(scope="module")
def sglang_url(model, tmp_path_factory):
    with ServerGroup([server_config("sglang", model)], tmp_path_factory.mktemp("logs")) as group:
        yield group.urls[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_transport_brings_sglang_to_the_trainer(layout, model, sglang_url, tmp_path):
    nproc, flags = LAYOUTS[layout]
    out, log = tmp_path / "out.json", tmp_path / "worker.log"
    cmd = [
        *torchrun(nproc), str(WORKER), str(model), str(out), sglang_url,
        "--dir", str(tmp_path / "sync"), "--transports", "tensor,distributed,disk", *flags,
    ]  # fmt: skip
    with open(log, "w") as f:  # a file, not a pipe (see tests/distributed/test_weight_sync.py)
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=600, env=cli_env())
    assert rc.returncode == 0, log.read_text()[-4000:]
    result = json.loads(out.read_text())
    assert [s["transport"] for s in result["syncs"]] == ["tensor", "distributed", "disk"]
    for s in result["syncs"]:
        assert s["buckets"] > 5  # small buckets: many per sync
        [r] = s["verify"]
        assert r["error"] is None and r["version"] == s["version"], r
        assert r["max_diff"] < TOL, (s["transport"], r)
    served = result["serving"][sglang_url]
    assert served["version"] == "3" and served["diffs"]["3"] < TOL, served
    assert min(d for v, d in served["diffs"].items() if v != "3") > 100 * TOL, served


@pytest.mark.real_sglang
def test_sglang_keeps_the_distributed_groups_between_syncs(model, sglang_url, tmp_path):
    """PP2, one WeightSync, three distributed syncs into SGLang: each stage's group is opened
    once and carries every sync (SGLang answers the empty update that asks whether it still
    holds it), every sync reaches the trainer's log-probs, and close() destroys the groups
    (SGLang then says they do not exist). A group SGLang does not hold is refused by that
    same empty update, which is how a restarted server is told apart."""
    from megatron_gspo.weight_sync.servers import Servers

    out, log = tmp_path / "out.json", tmp_path / "worker.log"
    cmd = [
        *torchrun(2), str(WORKER), str(model), str(out), sglang_url,
        "--dir", str(tmp_path / "sync"), "--transports", "distributed,distributed,distributed",
        "--pp", "2", "--one-sync",
    ]  # fmt: skip
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=600, env=cli_env())
    assert rc.returncode == 0, log.read_text()[-4000:]
    result = json.loads(out.read_text())
    groups = [s["groups"] for s in result["syncs"]]
    assert sorted(groups[0]) == ["0", "1"] and groups[0] == groups[1] == groups[2], groups
    for s in result["syncs"]:
        [r] = s["verify"]
        assert r["error"] is None and r["max_diff"] < TOL, r
    for name, [answer] in result["destroy_after_close"].items():
        assert "does not exist" in answer, (name, answer)
    servers = Servers([sglang_url], 60)
    try:
        servers.post(0, "/begin_weight_update", {"selector": "target"})
        probe = {"names": [], "dtypes": [], "shapes": [], "group_name": "never-made"}
        _, errors = servers.post_many([0], "/update_weights_from_distributed", probe)
        servers.post(0, "/end_weight_update", {})
    finally:
        servers.close()
    assert "never-made" in errors[0], errors
