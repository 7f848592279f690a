"""Worker for the expert-loop tests: under each layout of a plan, two actors on the same weights,
one whose experts run `ExpertLoop` (the default) and one whose experts run megatron's own loop
(SequentialMLP.forward: `loop_applies` answering False), take the same old log-probs and two
training steps; rank 0 writes whether everything came out bit for bit the same, and how often
each ran the loop. On the first layout, rank 0 also checks one experts module outside DDP (the
weight gradients returned, not fused into main_grad) with an expert that gets no tokens, and
that a hook on an expert's linear sends the layer to megatron's loop.

torchrun --nproc-per-node 2 tests/distributed/expert_loop_worker.py CKPT OUT.json PLAN.json

PLAN.json: [{"name", "tp", "ep", "mode", "loss"}, ...]
"""

import argparse
import json

import torch
import torch.distributed as dist
from grouped_worker import fixed_batch  # this directory: the worker runs as a script

from megatron_gspo.model import expert_loop
from megatron_gspo.model.builder import BuildOptions
from megatron_gspo.model.expert_loop import SequentialExperts
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig

OPTIM = OptimConfig(lr=1e-3)
CALLS = {"loop": 0}


def count_loop_calls() -> None:
    forward = expert_loop.ExpertLoop.forward

    def counted(*args, **kwargs):
        CALLS["loop"] += 1
        return forward(*args, **kwargs)

    expert_loop.ExpertLoop.forward = staticmethod(counted)


def experts_modules(chunks) -> list[SequentialExperts]:
    return [m for c in chunks for m in c.modules() if isinstance(m, SequentialExperts)]


def run(ckpt, dims, layout, loop: bool) -> dict:
    opts = BuildOptions(routing_replay=layout["mode"] != "none")
    actor = Actor(load_policy(ckpt, dims, opts), OPTIM, routing_replay=layout["mode"])
    modules = experts_modules(actor.chunks)
    if not loop:
        for m in modules:
            m.loop_applies = lambda *args: False
    loss = AlgoConfig(loss=layout["loss"], clip_low=0.2, clip_high=0.28)
    batch = fixed_batch(actor.spec)
    initial = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters()}
    before = CALLS["loop"]
    old, _ = actor.logprobs(batch, 2)
    batch.set("old_logprobs", old)
    stats = [actor.train_step(batch, loss, 2).stats for _ in range(2)]
    params = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters()}
    moved = sum(not torch.equal(params[n], p0) for n, p0 in initial.items())
    return dict(old=old, stats=stats, params=params, calls=CALLS["loop"] - before,
                modules=len(modules), moved=moved)  # fmt: skip


def same(a: dict, b: dict) -> dict:
    lp = torch.equal(a["old"].nan_to_num(7.0), b["old"].nan_to_num(7.0))
    keys = ("loss", "grad_norm")
    stats = all(x[k] == y[k] for x, y in zip(a["stats"], b["stats"], strict=True) for k in keys)
    differ = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    return dict(logprobs=lp, stats=stats, params_differ=len(differ), params=len(a["params"]),
                params_moved=a["moved"], loop_calls=[a["calls"], b["calls"]],
                modules=a["modules"], grad_norms=[s["grad_norm"] for s in a["stats"]])  # fmt: skip


def module_checks(ckpt, dims) -> dict:
    """One experts module outside DDP, loop against megatron's, every gradient returned; an
    expert without tokens; then a hook on an expert's linear."""
    chunks = load_policy(ckpt, dims, BuildOptions())
    m = experts_modules(chunks)[0]
    for p in m.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    e, h = m.num_local_experts, m.config.hidden_size
    sizes = torch.tensor([3, 0, 5, 2, 4, 1, 0, 6][:e] + [2] * max(0, e - 8))
    x0 = torch.randn(int(sizes.sum()), h, generator=g)
    p0 = torch.rand(int(sizes.sum()), generator=g)
    dy = torch.randn(int(sizes.sum()), h, generator=g)
    results = []
    for use_loop in (True, False):
        if not use_loop:
            m.loop_applies = lambda *args: False
        m.zero_grad(set_to_none=True)
        x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        before = CALLS["loop"]
        y, _ = m(x, sizes, p)
        y.backward(dy)
        grads = [q.grad.clone() for q in m.parameters()]
        results.append((y.detach(), x.grad, p.grad, grads, CALLS["loop"] - before))
    (y1, x1, p1, g1, c1), (y2, x2, p2, g2, c2) = results
    out = dict(
        y=torch.equal(y1, y2), x_grad=torch.equal(x1, x2), probs_grad=torch.equal(p1, p2),
        weight_grads=all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True)),
        empty_expert_zero_grad=bool(torch.count_nonzero(g1[2]) == 0),
        calls=[c1, c2], grad_scale=float(max(t.abs().max() for t in g1)),
    )  # fmt: skip
    del m.loop_applies
    applies = m.loop_applies(x0, p0)
    handle = m.local_experts[0].linear_fc1.register_forward_hook(lambda *args: None)
    out["applies"], out["applies_with_hook"] = applies, m.loop_applies(x0, p0)
    handle.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("checkpoint", "out", "plan"):
        ap.add_argument(name)
    a = ap.parse_args()
    count_loop_calls()
    results = {}
    for i, layout in enumerate(json.loads(open(a.plan).read())):
        dims = ParallelDims(tp=layout["tp"], ep=layout["ep"], world_size=world_size_from_env())
        init_distributed(dims)
        runs = [run(a.checkpoint, dims, layout, loop) for loop in (True, False)]
        result = same(*runs)
        if i == 0:
            result["module"] = module_checks(a.checkpoint, dims)
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, result)
        results[layout["name"]] = parts
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
