"""Worker for the routing-replay tests: every layout and mode of a list in one launch.

torchrun --nproc-per-node N tests/distributed/routing_worker.py CKPT BATCH.json OUT.json PLAN.json

BATCH.json: tokens, loss_mask, advantages, rollout_experts (int lists [n - 1, layers, k]).
PLAN.json: [{"name", "tp", "pp", "ep", "vpp", "mbs", "recompute", "grouped", "modes": [...]}, ...].
For each layout and mode, on fresh weights: old log-probs (recording), a step on the whole batch
(weights unchanged: ratios must be 1), log-probs with the batch's routing replayed under the
changed weights while forward hooks on every router collect the experts it really used, then a
step on a reordered minibatch. Mode "none" also records, before that step, the natural routing
and log-probs under the changed weights (the independent side of the drift split: that step
routes naturally too). Rank 0 writes everything as JSON.
"""

import argparse
import json

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.model.builder import BuildOptions
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import StepBatch

LOSS = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)
MINIBATCH = [5, 2, 7, 0]


def load_batch(path: str) -> StepBatch:
    d = json.loads(open(path).read())
    experts = [np.array(e, dtype=np.int32) for e in d["rollout_experts"]]
    return StepBatch.from_rows(d["tokens"], d["loss_mask"], d["advantages"],
                               rollout_experts=experts)  # fmt: skip


class UsedExperts:
    """Forward hooks on every router: the experts each router token really went to."""

    def __init__(self, chunks):
        from megatron.core.transformer.moe.router import TopKRouter

        self.maps: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for c in chunks:
            for m in c.modules():
                if isinstance(m, TopKRouter):
                    self.handles.append(m.register_forward_hook(self._hook(m.layer_number - 1)))

    def _hook(self, layer):
        def hook(module, args, output):
            self.maps.setdefault(layer, []).append(output[1].detach().clone())  # [N, E] bool

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def expert_mismatches(used: UsedExperts, batch: StepBatch, source: str, mbs, sp: bool) -> dict:
    """Per layer: (positions with a stored id, positions whose used experts differ from it).
    Router token j of a microbatch is the (sample, position) routing.layout.token_map names:
    padded [b, s], row j % b at this rank's position j // b; packed [1, t], its sequences'."""
    from megatron_gspo.routing.layout import current_layout, token_map

    layout = current_layout(sp)
    out = {}
    for layer, maps in used.maps.items():
        checked = wrong = 0
        for mb, used_NE in zip(mbs, maps):
            rows, pos = token_map(mb, layout)
            for j in range(used_NE.shape[0]):
                i, t = int(rows[j]), int(pos[j])
                if i < 0:
                    continue
                store = getattr(batch.routing[i], source)
                col = batch.routing[i].layers.index(layer)
                if t >= store.shape[0]:
                    continue
                want = set(store[t, col].tolist())
                got = set(torch.nonzero(used_NE[j]).flatten().tolist())
                checked += 1
                wrong += want != got
        out[layer] = (checked, wrong)
    return out


def full_recorded(batch: StepBatch) -> list:
    """Every sample's recorded routing over all MoE layers, gathered from every stage."""
    mine = {}
    for i, s in enumerate(batch.routing):
        for col, layer in enumerate(s.layers):
            mine[(i, layer)] = s.recorded[:, col].tolist()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged = {}
    for p in parts:
        merged.update(p)
    layers = sorted({layer for _, layer in merged})
    return [[merged[(i, layer)] for layer in layers] for i in range(len(batch))]


def run_mode(checkpoint, batch_path, layout, mode) -> dict:
    dims = ParallelDims(
        tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], vpp=layout.get("vpp"),
        world_size=world_size_from_env(),
    )  # fmt: skip
    init_distributed(dims)
    opts = BuildOptions(
        routing_replay=True,
        recompute="full" if layout.get("recompute") else None,
        moe_grouped_gemm=layout.get("grouped", False),
    )
    chunks = load_policy(checkpoint, dims, opts)
    actor = Actor(chunks, OptimConfig(lr=layout.get("lr", 1e-3)), routing_replay=mode,
                  max_tokens_per_microbatch=layout.get("pack"))  # fmt: skip
    mbs = layout["mbs"]
    batch = load_batch(batch_path)
    old, record_metrics = actor.logprobs(batch, mbs)
    batch.set("old_logprobs", old)
    step1 = actor.train_step(batch, LOSS, mbs).stats
    used = UsedExperts(chunks)
    replayed, replay_metrics = actor.replayed_logprobs(batch, mbs)
    used.close()
    source = "rollout" if mode == "r3" else "recorded"
    layout_mbs, _, _ = actor._layout(batch, mbs)
    sp = bool(chunks[0].config.sequence_parallel)
    local = expert_mismatches(used, batch, source, layout_mbs, sp)
    natural = {}
    if mode == "none":
        probe = batch.without("old_logprobs", "routing")
        probe.rollout_experts = None
        natural["natural_logprobs"] = probe.to_rows(actor.logprobs(probe, mbs)[0])
        natural["natural_recorded"] = full_recorded(probe)
    step2 = actor.train_step(batch.rows(MINIBATCH), LOSS, mbs).stats
    checks = [None] * dist.get_world_size()
    dist.all_gather_object(checks, {str(k): v for k, v in local.items()})
    result = {
        "old": batch.to_rows(old),
        "record_metrics": record_metrics,
        "step1": step1,
        "replayed": batch.to_rows(replayed),
        "replay_metrics": replay_metrics,
        "step2": step2,
        "experts": checks,
        "recorded": full_recorded(batch),
        **natural,
    }
    if mode == "r3":
        result["rollout_differs"] = [s.rollout_differs.tolist() for s in batch.routing]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("batch")
    ap.add_argument("out")
    ap.add_argument("plan")
    a = ap.parse_args()
    results = {}
    for layout in json.loads(open(a.plan).read()):
        for mode in layout["modes"]:
            results[f"{layout['name']}/{mode}"] = run_mode(a.checkpoint, a.batch, layout, mode)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
