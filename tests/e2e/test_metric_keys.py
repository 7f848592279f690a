"""The metric registry (train/metric_defs.py, the source of docs/metrics.md) against what real runs
write: every registered key is written by a run (or, for a key only a fault writes, by its writer
with the fault injected), and every key a run writes is registered. docs/metrics.md twice listed
keys nothing wrote (`ratio/max_minus_1`, `rollout/tokens`); this fails on the next one.

Two short runs of `megatron-gspo train` (2 steps, eval on) between them switch on every feature
that adds keys (RUNS). The tiny configs as they are (GSPO, GRPO, GRPO+R2, GRPO+R3, packed and
padded) add none of their own; tests/e2e/test_train.py checks their keys registered too.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.sample import Sample
from megatron_gspo.train.metric_defs import DEFINITIONS, entry, undefined
from megatron_gspo.train.results import Collected
from megatron_gspo.train.samples import nonfinite_inputs
from tests.e2e.test_train import metrics, train

pytestmark = [pytest.mark.e2e]

# A chat model (episodes need its template); its random weights route tokens differently in a
# bf16 server than in the fp32 trainer, so R3's split by routing agreement has both halves.
SPEC = TinySpec(tokenizer="chars", layers=3, dense_layers=[0], init_std=0.2, seed=7)

# Two model turns, a tool message between them; the reward: the second turn's first token is
# even (a spread within groups, so dynamic sampling keeps some)
ENV = """
from megatron_gspo.rollout.env import Step


class Env:
    def __init__(self, row):
        self.row = row

    def prompt(self):
        return [{"role": "user", "content": self.row.prompt}]

    def step(self, turn):
        if turn.index == 1:
            return Step(done=True, reward=float(bool(turn.ids) and turn.ids[0] % 2 == 0))
        return Step([{"role": "tool", "content": str(turn.index)}])
"""

# run -> (config, overrides): the features that add keys, between them all
RUNS = {
    # LoRA, a bf16 server (routing that differs from the trainer's), TIS, the KL in the loss,
    # padded microbatches
    "grpo_r3_lora_tis_kl_padded": ("tiny_moe_grpo_r3.yaml", [
        "lora.rank=4", "lora.alpha=8", "rollout.dtype=bfloat16", "algo.mismatch=tis",
        "algo.kl_coef=0.01", "train.pack=false"]),
    # SAPO, IcePop, the KL in the reward, a multi-turn environment, dynamic sampling, rollouts
    # one step ahead continued across the sync (partial); an lr that moves the routing under R2
    "sapo_r2_icepop_env_ahead": ("tiny_moe_grpo_r2.yaml", [
        "algo.loss=sapo", "algo.mismatch=icepop", "algo.icepop_k=1.001", "rollout.dtype=bfloat16",
        "algo.kl_coef=0.01", "algo.kl_in=reward", "env.fn={env}:Env", "rollout.max_new_tokens=5",
        "algo.dynamic_sampling=true", "rollout.max_staleness=1", "rollout.partial=true",
        "optim.lr=1e-2"]),
}  # fmt: skip

# keys only a fault writes, found by their writer with the fault injected (fault_keys)
FAULT_ONLY = {"input/nonfinite_advantages", "input/nonfinite_logprobs"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """{run: its metrics.jsonl rows} of every run in RUNS."""
    root = tmp_path_factory.mktemp("metric_keys")
    model = make_tiny_model(SPEC, root / "model")
    env = root / "env.py"
    env.write_text(ENV)
    out = {}
    for name, (config, overrides) in RUNS.items():
        run_dir = root / name
        rc, log = train(config, run_dir, model, *[o.format(env=env) for o in overrides])
        assert rc == 0, (name, log[-3000:])
        out[name] = metrics(run_dir)
        assert [r["step"] for r in out[name]] == [0, 1, 2], name
    return out


def fault_keys() -> set[str]:
    """The keys the producer logs for a batch with non-finite inputs (producer.py:
    `Collected.set_nonfinite_inputs(nonfinite_inputs(...))`): a NaN log-prob from the server
    and an infinite advantage injected."""
    samples = [Sample(0, 0, [1], [2, 3], logprobs=[-0.5, math.nan], finish_reason="stop")]
    collected = Collected(batch=None, metrics={})
    collected.set_nonfinite_inputs(nonfinite_inputs(samples, torch.tensor([math.inf, 0.0])))
    return set(collected.metrics)


def test_the_registry_holds_exactly_the_keys_the_runs_write(runs):
    """One test, so that xdist never splits the runs' fixture over two workers; it names both
    kinds of key it finds."""
    unregistered = sorted({(name, k) for name, rows in runs.items() for r in rows
                           for k in undefined(r)})  # fmt: skip
    written = {entry(k) for rows in runs.values() for r in rows for k in r} - {"step"}
    assert fault_keys() == FAULT_ONLY
    dead = sorted(set(DEFINITIONS) - written - FAULT_ONLY)
    assert not unregistered and not dead, (
        f"written but not registered in train/metric_defs.py: {unregistered}; "
        f"registered there but written by no run: {dead}"
    )
    # the runs are what RUNS says: padded and packed microbatches, eval at steps 0 and 2
    padded, packed = runs["grpo_r3_lora_tis_kl_padded"], runs["sapo_r2_icepop_env_ahead"]
    assert all(r["train/padding_fraction"] > 0 for r in padded[1:])
    assert all(r["train/padding_fraction"] == 0 for r in packed[1:])
    assert all("eval/reward" in r for rows in runs.values() for r in (rows[0], rows[2]))
