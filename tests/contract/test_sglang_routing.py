"""R3 with routed experts from a real server: the built-in one always, real SGLang 0.5.23 (CPU,
its own venv) in the contract tier (`-m contract`). Same tiny all-MoE checkpoint on both sides
(SGLang's Qwen3-MoE ignores mlp_only_layers), fp32.

The trainer (gloo, 2 ranks: TP1 x DP2, TP2 + SP, EP2 in one launch) takes the server's payload
as it comes (int32 [prompt + output - 1, every decoder layer, k]) and:
- agrees with it on every (token, MoE layer) position (routing/rollout_train_agreement == 1);
- computes old log-probs, replaying it, equal to the server's own log-probs (built-in: 1e-4,
  SGLang: 2e-5, the contract tier's tolerances against HF);
- trains on it: ratios of exactly 1 before the update, and after the update every router token
  still goes to the server's experts while the router's own top-k has moved;
- gives the same numbers under each layout.
"""

import asyncio
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.launcher import ServerGroup
from tests.contract.sglang_venv import server_config
from tests.helpers import cli_env, torchrun

pytestmark = pytest.mark.contract

SPEC = TinySpec(layers=2, init_std=0.2)
ATOL = {"builtin": 1e-4, "sglang": 2e-5}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34]]
WORKER = Path(__file__).parents[1] / "distributed" / "routing_worker.py"
PLAN = [
    {"name": "tp1", "tp": 1, "pp": 1, "ep": 1, "mbs": 2, "modes": ["r3"]},
    {"name": "tp2", "tp": 2, "pp": 1, "ep": 1, "mbs": 4, "modes": ["r3"]},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2, "mbs": 2, "modes": ["r3"]},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(SPEC, tmp_path_factory.mktemp("r3") / "model")


@pytest.fixture(scope="module", params=["builtin", "sglang"])
def rollouts(request, checkpoint, tmp_path_factory):
    """(server kind, samples): 4 prompts x 2 samples of 6 tokens with routed experts."""
    kind = request.param
    sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}

    async def go(url):
        async with RolloutClient([url], topk=SPEC.topk) as c:
            return await c.generate(PROMPTS, n=2, sampling_params=sp, return_routed_experts=True)

    logs = tmp_path_factory.mktemp(f"logs-{kind}")
    t0 = time.monotonic()
    cfg = server_config(kind, checkpoint)
    with ServerGroup([cfg], logs, health_timeout_s=900, monitor=False) as group:
        print(f"{kind} server healthy after {time.monotonic() - t0:.1f} s")
        groups = asyncio.run(go(group.urls[0]))
    return kind, [s for g in groups for s in g]


@pytest.fixture(scope="module")
def trained(rollouts, checkpoint, tmp_path_factory):

    kind, samples = rollouts
    tmp = tmp_path_factory.mktemp(f"train-{kind}")
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": [s.prompt_ids + s.tokens for s in samples],
        "loss_mask": [[0] * len(s.prompt_ids) + [1] * len(s.tokens) for s in samples],
        "advantages": torch.randn(len(samples), generator=g).tolist(),
        "rollout_experts": [s.routed_experts.tolist() for s in samples],
    }
    (tmp / "batch.json").write_text(json.dumps(batch))
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    cmd = torchrun(
        2, str(WORKER), str(checkpoint), str(tmp / "batch.json"), str(tmp / "out.json"),
        str(tmp / "plan.json"),
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return kind, samples, json.loads((tmp / "out.json").read_text())


def test_payload_is_every_layer_int32(rollouts):
    _, samples = rollouts
    for s in samples:
        n = len(s.prompt_ids) + len(s.tokens)
        assert s.routed_experts.dtype == np.int32
        assert s.routed_experts.shape == (n - 1, SPEC.layers, SPEC.topk)


def test_trainer_agrees_and_reproduces_the_servers_logprobs(trained):
    kind, samples, runs = trained
    for name, run in runs.items():
        assert run["record_metrics"]["routing/rollout_train_agreement"] == 1.0, name
        worst = 0.0
        for s, old in zip(samples, run["old"]):
            ours = np.array(old[len(s.prompt_ids) :])
            worst = max(worst, float(np.abs(ours - np.array(s.logprobs)).max()))
        print(f"{kind} {name}: max |old logprob (R3) - server logprob| = {worst:.2e}")
        assert worst <= ATOL[kind], name


def test_training_replays_the_servers_experts(trained):
    _, _, runs = trained
    for name, run in runs.items():
        assert run["step1"]["ratio_min"] == 1.0 and run["step1"]["ratio_max"] == 1.0, name
        per_layer: dict[str, list[int]] = {}
        for rank in run["experts"]:
            for layer, (checked, wrong) in rank.items():
                acc = per_layer.setdefault(layer, [0, 0])
                acc[0] += checked
                acc[1] += wrong
        assert sorted(per_layer) == ["0", "1"], name
        assert all(c > 0 and w == 0 for c, w in per_layer.values()), (name, per_layer)
        assert run["replay_metrics"]["routing/changed_fraction"] > 0.0, name


def test_layouts_agree(trained):
    _, _, runs = trained
    ref = runs["tp1/r3"]
    for name, run in runs.items():
        for key in ("old", "replayed"):
            for g, r in zip(run[key], ref[key]):
                assert np.allclose(g[1:], r[1:], rtol=0, atol=2e-5), (name, key)
        for key in ("loss", "grad_norm"):
            assert run["step2"][key] == pytest.approx(ref["step2"][key], rel=1e-5), (name, key)
