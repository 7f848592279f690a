"""Worker for the KL reference (gloo; 1 rank, or 2 under TP2 or EP2).

torchrun --nproc-per-node N tests/distributed/reference_worker.py CKPT OUT.json [--tp 2] [--ep 2]

An actor keeps the starting weights as its reference (`keep_reference`), takes one GRPO step
(the weights move), then on another batch: its own log-probs, the reference's
(`reference_logprobs`) and a GRPO step with the KL penalty (algo.kl_coef 0.1, k3), whose
kl_ref statistic is what the run logs as kl/ref. A first step with the penalty on a fresh
actor gives kl_ref at the first update. Rank 0 writes them as JSON (flat lists, NaN as null).
"""

import argparse
import json
import math

import torch
import torch.distributed as dist

from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, OptimConfig
from megatron_gspo.train.batch import StepBatch

PLAIN = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)
WITH_KL = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28, kl_coef=0.1)


def batch(seed: int, vocab: int) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    masks = [[0] * 3 + [1] * (len(t) - 3) for t in tokens]
    return StepBatch.from_rows(tokens, masks, torch.randn(4, generator=g).tolist())


def plain(t: torch.Tensor) -> list:
    return [None if math.isnan(v) else v for v in t.tolist()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    a = ap.parse_args()
    init_distributed(ParallelDims(tp=a.tp, ep=a.ep, world_size=world_size_from_env()))
    optim = OptimConfig(lr=5e-2, clip_grad=0.0)
    actor = Actor(
        load_policy(a.checkpoint, ParallelDims(tp=a.tp, ep=a.ep, world_size=world_size_from_env())),
        optim,
    )
    vocab = actor.spec.vocab_size
    actor.keep_reference()
    first = batch(0, vocab)
    first.set("ref_logprobs", actor.reference_logprobs(first, 2))
    kl_first = actor.train_step(first, WITH_KL, 2, on_policy=True).stats["kl_ref"]
    actor.train_step(batch(1, vocab), PLAIN, 2, on_policy=True)  # the policy moves on
    later = batch(2, vocab)
    own, _ = actor.logprobs(later, 2)
    ref = actor.reference_logprobs(later, 2)
    later.set("ref_logprobs", ref)
    step = actor.train_step(later, WITH_KL, 2, on_policy=True)
    out = {"kl_first": kl_first, "kl_later": step.stats["kl_ref"], "own": plain(own),
           "ref": plain(ref), "tokens": later["tokens"].tolist(),
           "cu": later.cu_seqlens.tolist(), "mask": later["loss_mask"].tolist(),
           "reference_bytes": actor.reference.nbytes if actor.reference else 0}  # fmt: skip
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    main()
