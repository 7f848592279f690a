"""Worker for the sharded-batch tests: the RL loop's training step (`loop.train_on`: rank 0's
batch sharded to every rank, old log-probs, minibatch updates, metrics) on a fixed batch with
rollout routing and log-probs, under one parallel layout, for each replay mode.

torchrun --nproc-per-node N tests/distributed/shard_worker.py CKPT OUT.json [--tp --pp --ep]

Every object collective the step makes is recorded (its pickled size) through a counting wrapper
around torch.distributed's object collectives; rank 0 writes the metrics and those sizes as JSON.
"""

import argparse
import json
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.config import load_config
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, OptimConfig
from megatron_gspo.train.batch import StepBatch
from megatron_gspo.train.loop import train_on

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_grpo.yaml"
MODES = ("none", "r2", "r3")


def whole_batch(num_layers: int, num_experts: int, topk: int, n: int = 12) -> StepBatch:
    """Samples of different lengths; rollout log-probs near the policy's scale; the server's
    routing as it sends it: every decoder layer, distinct top-k ids per token (int32)."""
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    tokens, masks, lps, experts = [], [], [], []
    for _ in range(n):
        prompt = int(torch.randint(2, 6, (1,), generator=g))
        length = prompt + int(torch.randint(3, 12, (1,), generator=g))
        tokens.append(torch.randint(3, 100, (length,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
        lps.append([None] * prompt + (-torch.rand(length - prompt, generator=g) * 4).tolist())
        ids = np.argsort(rng.random((length - 1, num_layers, num_experts)), axis=-1)[..., :topk]
        experts.append(ids.astype(np.int32))
    adv = torch.randn(n, generator=g).tolist()
    return StepBatch.from_rows(tokens, masks, adv, rollout_logprobs=lps, rollout_experts=experts)


class ObjectCollectives:
    """Records what every object broadcast or all-gathered while it is on was: its kind
    ("names": a list of strings; else its type) and pickled size."""

    def __init__(self):
        self.sizes: list[tuple[str, int]] = []
        self.saved = (dist.broadcast_object_list, dist.all_gather_object)

    def __enter__(self):
        bcast, gather = self.saved

        def broadcast_object_list(objs, *a, **k):
            self.sizes.append((_kind(objs), len(pickle.dumps(objs))))
            return bcast(objs, *a, **k)

        def all_gather_object(out, obj, *a, **k):
            self.sizes.append((_kind(obj), len(pickle.dumps(obj))))
            return gather(out, obj, *a, **k)

        dist.broadcast_object_list, dist.all_gather_object = (
            broadcast_object_list,
            all_gather_object,
        )
        return self

    def __exit__(self, *exc):
        dist.broadcast_object_list, dist.all_gather_object = self.saved


def _kind(obj) -> str:
    if isinstance(obj, list) and all(isinstance(x, str) for x in obj):
        return "names"
    return type(obj).__name__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    for name in ("tp", "pp", "ep"):
        ap.add_argument("--" + name, type=int, default=1)
    a = ap.parse_args()
    dims = ParallelDims(tp=a.tp, pp=a.pp, ep=a.ep, world_size=world_size_from_env())
    init_distributed(dims)
    results = {}
    for mode in MODES:
        cfg = load_config(
            CONFIG,
            [f"algo.routing_replay={mode}", "algo.minibatches=4", "train.micro_batch_size=2",
             "train.steps=4", "optim.lr=1e-3", "seed=5"],
        )  # fmt: skip
        actor = Actor(load_policy(a.checkpoint, dims), OptimConfig(lr=1e-3), routing_replay=mode)
        spec = actor.spec
        whole = whole_batch(spec.num_layers, spec.num_experts, spec.topk)
        with ObjectCollectives() as seen:
            metrics, _ = train_on(actor, whole if dist.get_rank() == 0 else None, cfg, 1,
                                  len(whole))  # fmt: skip
        per_token_bytes = whole.num_tokens * (4 + 1 + 4)  # tokens, mask, rollout log-probs
        per_token_bytes += sum(e.nbytes for e in whole.rollout_experts or [])
        results[mode] = {
            "metrics": metrics,
            "objects": seen.sizes,
            "batch_bytes": per_token_bytes,
        }
        del actor
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
