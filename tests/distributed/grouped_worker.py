"""Worker for the grouped-experts tests: each layout of a plan runs the same work with sequential
and with grouped experts, and rank 0 writes the differences as JSON.

torchrun --nproc-per-node N tests/distributed/grouped_worker.py CKPT OUT.json PLAN.json WORKDIR

PLAN.json: [{"name", "tp", "pp", "ep", "mbs", "recompute", "mode", "cross_load"}, ...]. Per
layout and experts kind, on fresh weights: log-probs of a fixed batch (routing replay `mode`,
r3: the batch's own random expert choices), recording what every experts module received
(tokens per expert and their hidden states), the weights as HF tensors (loaded through the
per-expert views, read back through them), then one optimizer step (no clipping, the plain
optimizer: every rank's gradient buffer holds the reduced gradient), keeping each parameter's
gradient under its per-expert (SequentialMLP) name. With `cross_load` each kind saves its actor
after the step; a fresh actor of the other kind loads it, and both take a second step; and
the HF checkpoint converted to a Megatron one (sequential experts) is loaded into grouped ones.
Reported: the largest differences (max over ranks) between the kinds.
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.model.builder import BuildOptions
from megatron_gspo.model.experts import expert_views, is_grouped
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.model.weights import iter_hf
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import RLBatch, StepBatch
from megatron_gspo.weight_sync.gather import iter_stage

LOSS = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)
OPTIM = OptimConfig(lr=1e-3, clip_grad=0.0, distributed=False)


def fixed_batch(spec, n: int = 8) -> StepBatch:
    """Samples of different lengths; routed experts [len - 1, layers, k], distinct per token."""
    g = torch.Generator().manual_seed(0)
    tokens, masks, experts = [], [], []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        tokens.append(torch.randint(0, spec.vocab_size, (length,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
        scores = torch.rand(length - 1, spec.num_layers, spec.num_experts, generator=g)
        experts.append(scores.topk(spec.topk, dim=-1).indices.numpy().astype(np.int32))
    adv = torch.randn(n, generator=g).tolist()
    return RLBatch(tokens, masks, adv, rollout_experts=experts)


class ExpertInputs:
    """Forward pre-hooks on every experts module: what each received, per layer, in order."""

    def __init__(self, chunks):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.seen: dict[int, list] = {}
        self.handles = [
            m.experts.register_forward_pre_hook(self._hook(m.layer_number - 1))
            for c in chunks
            for m in c.modules()
            if isinstance(m, MoELayer)
        ]

    def _hook(self, layer):
        def hook(module, args):
            x, tokens_per_expert = args[0], args[1]
            self.seen.setdefault(layer, []).append(
                (torch.as_tensor(tokens_per_expert).tolist(), x.detach().clone())
            )

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def per_expert(chunks, what: str) -> dict[str, torch.Tensor]:
    """Every parameter's value or gradient under its per-expert name (grouped weights split)."""
    spec = chunks[0].model_spec
    ep = _ep()
    out = {}
    for i, c in enumerate(chunks):
        for name, p in c.named_parameters():
            t = (p.main_grad if what == "grad" else p).detach()
            views = (
                expert_views(name, t, spec.num_experts // ep, spec.hidden_size)
                if is_grouped(name)
                else [(name, t)]
            )
            out.update({f"{i}.{n}": v.clone() for n, v in views})
    return out


def _ep() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_expert_model_parallel_world_size()


def build(ckpt, dims, layout, grouped: bool) -> Actor:
    opts = BuildOptions(
        routing_replay=True, moe_grouped_gemm=grouped, recompute=layout.get("recompute")
    )
    return Actor(load_policy(ckpt, dims, opts), OPTIM, routing_replay=layout.get("mode", "none"))


def run_kind(ckpt, dims, layout, grouped: bool, workdir: str) -> dict:
    actor = build(ckpt, dims, layout, grouped)
    modules = [c.module for c in actor.chunks]
    batch = fixed_batch(modules[0].model_spec)
    # the loaded weights as HF tensors (TP-gathered; weight sync's and export's view of them)
    hf = {n: t.clone() for n, t in iter_hf(modules, only_writer=False)}
    # and as weight sync gathers them (over EP too) on each pipeline stage's sender
    hf.update({f"sync:{n}": t.clone() for n, t in iter_stage(modules)})
    inputs = ExpertInputs(modules)
    old, _ = actor.logprobs(batch, layout["mbs"])
    inputs.close()
    batch.set("old_logprobs", old)
    step = actor.train_step(batch, LOSS, layout["mbs"]).stats
    kept = dict(old=old, step=step, inputs=inputs.seen, grads=per_expert(modules, "grad"), hf=hf)
    kept["kinds"] = sorted({type(m.mlp.experts).__name__ for c in modules for m in c.decoder.layers
                            if hasattr(m.mlp, "experts")})  # fmt: skip
    kept["moe_act_recompute"] = any(
        getattr(m, "activation_recompute", False) for c in modules for m in c.modules()
    )
    if layout.get("cross_load"):
        where = os.path.join(workdir, f"{layout['name']}-{'grouped' if grouped else 'seq'}")
        if dist.get_rank() == 0:
            os.makedirs(where)
        dist.barrier()
        actor.save(where)
        params1 = per_expert(modules, "param")
        kept.update(batch=batch, saved=where, params1=params1)
        kept["step2"] = second_step(actor, batch, layout)
    return kept


def second_step(actor: Actor, batch: StepBatch, layout) -> dict:
    """A second step (its update uses the Adam moments of the first); the weights after it."""
    metrics = actor.train_step(batch, LOSS, layout["mbs"]).stats
    return dict(metrics=metrics, params=per_expert([c.module for c in actor.chunks], "param"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a) if a else 0.0


def input_diffs(a: dict, b: dict) -> tuple[bool, float]:
    """(tokens per expert identical everywhere, largest hidden-state difference)."""
    same, diff = a.keys() == b.keys(), 0.0
    for layer in a:
        for (ta, xa), (tb, xb) in zip(a[layer], b.get(layer, []), strict=True):
            same &= ta == tb
            if xa.shape == xb.shape:
                diff = max(diff, float((xa - xb).abs().max()))
            else:
                same = False
    return same, diff


def logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of two flat log-prob tensors where both have one."""
    both = ~(a.isnan() | b.isnan())
    assert both.any(), "no log-probs to compare"
    return float((a[both] - b[both]).abs().max())


def cross_load(ckpt, dims, layout, runs: dict) -> dict:
    """Each kind loads the other's checkpoint: same weights exactly, then the same second step."""
    out = {}
    for grouped in (False, True):
        saver = runs[not grouped]
        actor = build(ckpt, dims, layout, grouped)
        actor.load(saver["saved"])
        loaded = per_expert([c.module for c in actor.chunks], "param")
        step2 = second_step(actor, saver["batch"], layout)
        tag = "grouped_loads_seq" if grouped else "seq_loads_grouped"
        out[tag] = dict(
            params_after_load=max_diff(loaded, saver["params1"]),
            step2_params=max_diff(step2["params"], saver["step2"]["params"]),
            step2_grad_norm=(step2["metrics"]["grad_norm"], saver["step2"]["metrics"]["grad_norm"]),
        )
    return out


def from_converted(ckpt, dims, layout, workdir, grp: dict) -> float:
    """`convert hf-to-megatron` (sequential experts) loaded into grouped experts: log-probs as
    from the HF checkpoint loaded into them."""
    from megatron_gspo.model.convert import hf_to_megatron

    out = os.path.join(workdir, f"{layout['name']}-converted")
    hf_to_megatron(ckpt, out, dims)
    actor = build(out, dims, layout, grouped=True)
    old, _ = actor.logprobs(fixed_batch(actor.spec), layout["mbs"])
    return logprob_diff(old, grp["old"])


def compare(seq: dict, grp: dict) -> dict:
    same_counts, hidden = input_diffs(seq["inputs"], grp["inputs"])
    return dict(
        hf_weights=max_diff(seq["hf"], grp["hf"]),
        hf_tensors=len(seq["hf"]),
        sync_tensors=sum(k.startswith("sync:") for k in seq["hf"]),  # rank 0: a stage sender
        logprobs=logprob_diff(seq["old"], grp["old"]),
        grads=max_diff(seq["grads"], grp["grads"]),
        grad_scale=max(float(g.abs().max()) for g in seq["grads"].values()),
        loss=(seq["step"]["loss"], grp["step"]["loss"]),
        grad_norm=(seq["step"]["grad_norm"], grp["step"]["grad_norm"]),
        same_tokens_per_expert=same_counts,
        expert_inputs=hidden,
        expert_calls=sum(len(v) for v in seq["inputs"].values()),
        kinds=[seq["kinds"], grp["kinds"]],
        moe_act_recompute=[seq["moe_act_recompute"], grp["moe_act_recompute"]],
    )


def reduce_max(d: dict) -> dict:
    """Floats: max over ranks; bools: all ranks; pairs and counts: rank 0's."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, d)
    out = dict(parts[0])
    for k, v in d.items():
        if isinstance(v, bool):
            out[k] = all(p[k] for p in parts)
        elif isinstance(v, float):
            out[k] = max(p[k] for p in parts)
        elif isinstance(v, dict):
            out[k] = reduce_max(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("checkpoint", "out", "plan", "workdir"):
        ap.add_argument(name)
    a = ap.parse_args()
    results = {}
    for layout in json.loads(open(a.plan).read()):
        dims = ParallelDims(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"],
                            world_size=world_size_from_env())  # fmt: skip
        init_distributed(dims)
        runs = {g: run_kind(a.checkpoint, dims, layout, g, a.workdir) for g in (False, True)}
        result = compare(runs[False], runs[True])
        if layout.get("cross_load"):
            result["cross_load"] = cross_load(a.checkpoint, dims, layout, runs)
            result["converted"] = from_converted(a.checkpoint, dims, layout, a.workdir, runs[True])
        results[layout["name"]] = reduce_max(result)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
