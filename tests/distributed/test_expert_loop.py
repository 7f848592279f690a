"""Sequential experts as one autograd node (ExpertLoop, model/expert_loop.py) against megatron's
own loop over its per-expert MLPs, on the tiny MoE (first layer dense), fp32, gloo, 2 ranks:
the same old log-probs, losses, gradient norms and weights after two steps, bit for bit, under
DP2 (GRPO with R3 replay), EP2 (GSPO) and TP2 with sequence parallelism (expert-TP 2, GRPO);
one experts module outside DDP (its weight gradients returned, not fused), with an expert
that gets no tokens; and a hook on an expert's linear (how a LoRA adapter attaches) sends the
layer to megatron's loop.

The independent side is megatron-core's SequentialMLP.forward, run on the same module."""

import json
from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("expert_loop_worker.py")
PLAN = [
    {"name": "dp2-grpo-r3", "tp": 1, "ep": 1, "mode": "r3", "loss": "grpo"},
    {"name": "ep2-gspo", "tp": 1, "ep": 2, "mode": "none", "loss": "gspo"},
    {"name": "tp2-grpo", "tp": 2, "ep": 1, "mode": "none", "loss": "grpo"},
]
NAMES = [layout["name"] for layout in PLAN]


@pytest.fixture(scope="module")
def result(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert_loop")
    plan, out = tmp / "plan.json", tmp / "out.json"
    plan.write_text(json.dumps(PLAN))
    return run_distributed(WORKER, 2, str(tiny_models["moe"]), str(out), str(plan), out=out)


@pytest.mark.parametrize("name", NAMES)
def test_two_steps_bit_for_bit_as_megatrons_loop(result, name):
    for rank in result[name]:
        assert rank["modules"] >= 1
        calls, megatron_calls = rank["loop_calls"]
        assert calls > 0 and megatron_calls == 0  # the loop ran, and only on its side
        assert rank["logprobs"] and rank["stats"], rank
        assert rank["params_moved"] > 0 and all(g > 0 for g in rank["grad_norms"])
        assert rank["params_differ"] == 0, rank


def test_one_module_outside_ddp_with_an_expert_without_tokens(result):
    got = result[NAMES[0]][0]["module"]
    assert got["calls"] == [1, 0]
    assert got["grad_scale"] > 1e-4
    for key in ("y", "x_grad", "probs_grad", "weight_grads", "empty_expert_zero_grad"):
        assert got[key], (key, got)


def test_a_hook_on_an_experts_linear_runs_megatrons_loop(result):
    got = result[NAMES[0]][0]["module"]
    assert got["applies"] and not got["applies_with_hook"]
