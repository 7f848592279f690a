"""Worker for the KL in the reward (algo.kl_in: reward; gloo; 1 rank, or 2 under DP2, TP2, PP2).

torchrun --nproc-per-node N tests/distributed/reward_kl_worker.py CKPT OUT.json [--tp 2] [--pp 2]

An actor keeps the starting weights as its reference and takes one GRPO step (the weights move).
Rank 0 then makes a batch of 3 groups of 4 with 0/1 rewards; every rank takes its shard of it as
the loop does (`Actor.shard` over the step's minibatch split), the reference's and its own
(old) log-probs, and the KL-penalized advantages (`apply_reward_kl`, k1, beta 0.5). Rank 0 writes
the whole batch, every rank's (row, advantage) pairs, the old log-probs of each row from the
last pipeline stage, and the metrics, as JSON (NaN as null).
"""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, OptimConfig
from megatron_gspo.train.batch import StepBatch
from megatron_gspo.train.reward_kl import apply_reward_kl
from megatron_gspo.train.shard import minibatch_parts

PLAIN = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)
IN_REWARD = AlgoConfig(loss="grpo", kl_coef=0.5, kl_estimator="k1", kl_in="reward")
G = 4


def batch(seed: int, vocab: int, rows: int) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, 15, (rows,), generator=g).tolist()
    tokens = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    masks = [[0] * 3 + [1] * (len(t) - 3) for t in tokens]
    out = StepBatch.from_rows(tokens, masks, torch.randn(rows, generator=g).tolist())
    out.set("rewards", torch.randint(0, 2, (rows,), generator=g).double())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    a = ap.parse_args()
    dims = ParallelDims(tp=a.tp, pp=a.pp, world_size=world_size_from_env())
    init_distributed(dims)
    actor = Actor(load_policy(a.checkpoint, dims), OptimConfig(lr=5e-2, clip_grad=0.0))
    vocab = actor.spec.vocab_size
    actor.keep_reference()
    actor.train_step(batch(1, vocab, 4), PLAIN, 2, on_policy=True)  # the policy moves on
    whole = batch(2, vocab, 3 * G)
    parts = minibatch_parts(len(whole), 2, seed=0, step=0)
    shard = actor.shard(whole if dist.get_rank() == 0 else None, parts)
    shard.set("ref_logprobs", actor.reference_logprobs(shard, 2))
    old, _ = actor.logprobs(shard, 2)
    shard.set("old_logprobs", old)
    metrics = apply_reward_kl(shard, IN_REWARD, G)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    rows = shard.global_index()
    mine = {"adv": list(zip(rows, shard["advantages"].tolist(), strict=True)),
            "old": list(zip(rows, shard.to_rows(old), strict=True)) if last else [],
            "metrics": metrics}  # fmt: skip
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out = {"tokens": whole["tokens"].tolist(), "cu": whole.cu_seqlens.tolist(),
               "mask": whole["loss_mask"].tolist(), "rewards": whole["rewards"].tolist(),
               "ranks": every}  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()


if __name__ == "__main__":
    main()
