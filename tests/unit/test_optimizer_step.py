"""The actor's optimizer step (`step_parts.optimizer_step`) is megatron's own step with the
gradient norm taken once: two actors on the same weights and batches, one stepping through
megatron's `optimizer.step()` (which takes the norm again to clip), give bit for bit the same
weights and norms over three updates that clip, with the plain and the distributed optimizer;
the norm is taken once per update instead of twice. One subprocess per optimizer kind (the
single-rank process group and megatron's global state are per process)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = r"""
import json, sys
import torch
from megatron_gspo.model.parallel import ParallelDims, init_distributed
init_distributed(ParallelDims())
import megatron.core.optimizer.optimizer as mopt
from megatron_gspo.model.builder import BuildOptions
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train import actor as actor_mod
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import StepBatch

model, distributed = sys.argv[1], sys.argv[2] == "1"
norm_calls = [0]
counted = mopt.get_grad_norm_fp32
def counting(*args, **kwargs):
    norm_calls[0] += 1
    return counted(*args, **kwargs)
mopt.get_grad_norm_fp32 = counting

def megatron_route(opt):
    # what optimizer_step did before: the norm for the guard, then megatron's whole step
    assert not opt.prepare_grads()
    norm = opt.get_grad_norm()
    ok, _, _ = opt.step()
    return ok, float(norm), True

g = torch.Generator().manual_seed(0)
tokens = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
masks = [[0] * 3 + [1] * (len(t) - 3) for t in tokens]
adv = [1.0, -0.5, 0.25, -1.0]
loss = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)
runs = {}
for name, step_fn in (("ours", actor_mod.optimizer_step), ("megatron", megatron_route)):
    actor_mod.optimizer_step = step_fn
    # clip_grad 1e-3: every update clips (the norms are ~1)
    optim = OptimConfig(lr=1e-3, clip_grad=1e-3, distributed=distributed)
    actor = Actor(load_policy(model, ParallelDims(), BuildOptions()), optim)
    norms, calls = [], []
    for _ in range(3):
        batch = StepBatch.from_rows(tokens, masks, adv)
        norm_calls[0] = 0
        update = actor.train_step(batch, loss, 2, on_policy=True)
        assert update.applied and update.finite
        norms.append(update.grad_norm)
        calls.append(norm_calls[0])
    weights = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    runs[name] = (norms, calls, weights)
(on, oc, ow), (mn, mc, mw) = runs["ours"], runs["megatron"]
moved = max((ow[n] - w).abs().max().item() for n, w in mw.items())
start = load_policy(model, ParallelDims(), BuildOptions())[0]
trained = max((w - p.detach()).abs().max().item()
              for w, p in zip(ow.values(), start.parameters(), strict=True))
print(json.dumps({"norms": [on, mn], "calls": [oc, mc], "equal": moved, "trained": trained,
                  "same_names": sorted(ow) == sorted(mw)}))
"""


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_optimizer_step_is_megatrons_step_with_one_norm(tiny_models, distributed):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_models["moe"]), str(int(distributed))],
        capture_output=True, text=True, timeout=300,
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1",
             "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ours, megatron = r["norms"]
    assert ours == megatron and all(n > 1e-2 for n in ours)  # clipped: clip_grad is 1e-3
    assert r["same_names"] and r["equal"] == 0.0  # bit for bit the same weights
    assert r["trained"] > 0  # the updates moved the weights
    assert r["calls"] == [[1, 1, 1], [2, 2, 2]]  # the norm once per update, not twice
