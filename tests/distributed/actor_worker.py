"""Worker for the actor tests: two optimizer steps on a fixed batch, metrics as JSON on rank 0.
Rank 0 sends every rank its replica's rows (the RL loop's shard, train/shard.py); the scoring
after the steps uses the whole batch on every rank (the actor's other way).

torchrun --nproc-per-node N tests/distributed/actor_worker.py CKPT OUT.json KIND MBS [--tp ..]
torchrun --nproc-per-node N tests/distributed/actor_worker.py --jobs JOBS.json

With --jobs, the file lists several such argument lists, all of one parallel layout; they run one
after another in this one launch (each with its own model and optimizer), which saves a launch
(a few seconds of process start and imports) per job.
"""

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_gspo.model.forward import score
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import StepBatch


def fixed_batch(n: int = 8, vocab: int = 100) -> StepBatch:
    g = torch.Generator().manual_seed(0)
    tokens, masks = [], []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        tokens.append(torch.randint(0, vocab, (length,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
    return StepBatch.from_rows(tokens, masks, torch.randn(n, generator=g).tolist())


def _row_shift(batch: StepBatch, a: int, scale: float) -> torch.Tensor:
    """[T]: scale * ((i * a + j) % 5 - 2) at token j + 1 of the whole batch's row i."""
    i = torch.repeat_interleave(torch.tensor(batch.global_index()), batch.lengths)
    t = torch.arange(batch.num_tokens) - torch.repeat_interleave(batch.cu_seqlens[:-1],
                                                                 batch.lengths)  # fmt: skip
    return scale * ((i * a + t - 1) % 5 - 2).float()


def off_policy(old: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Shift the old log-probs a little so ratios differ from 1 and some tokens clip (row i of
    the whole batch by its own amounts; NaN stays: another pipeline stage's)."""
    return old + _row_shift(batch, 7, 0.15)


def rollout_of(old: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Rollout log-probs that differ from the old ones by log rho = 0.3 * k, k in -2..2."""
    return old - _row_shift(batch, 3, 0.3)


def this_ranks_shard(actor: Actor, whole: StepBatch) -> StepBatch:
    """The RL loop's way: rank 0 sends every rank its replica's rows (one minibatch of all 8);
    each checks that what came is the whole batch's rows it names."""
    shard = actor.shard(whole if dist.get_rank() == 0 else None, [list(range(len(whole)))])
    if dist.get_world_size() > 1:
        assert shard.sharded and shard.total == len(whole)
        assert shard.index == list(range(actor.dp_rank, len(whole), actor.dp)), shard.index
        for name in ("tokens", "loss_mask", "advantages"):
            assert shard.row_values(name) == [whole.row_values(name)[i] for i in shard.index]
    return shard


def whole_rows(batch: StepBatch, field: str) -> list | None:
    """A shard's `field` gathered (here, for the test's output) into the whole batch's rows,
    from the ranks that hold values (the last pipeline stage)."""
    if field not in batch.fields:
        return None
    rows = batch.row_values(field)
    if not batch.sharded:
        return rows
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(zip(batch.index, rows)))
    out: list = [None] * batch.global_size
    for part in parts:
        for i, r in part:
            if any(v is not None for v in r):  # (a stage before the last holds none)
                out[i] = r
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("kind")
    ap.add_argument("mbs", type=int)
    for name in ("tp", "pp", "ep", "vpp"):
        ap.add_argument("--" + name, type=int, default=None if name == "vpp" else 1)
    ap.add_argument("--no-dist-opt", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--save-after", type=int, default=None, help="save after this many steps")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--load", default=None, help="resume from this checkpoint first")
    ap.add_argument("--tis", default="none", help="truncated IS: none | token | sequence")
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--on-policy", action="store_true", help="old log-probs as computed")
    ap.add_argument("--fit-logits", action="store_true", help="logprobs(fit_logits=True)")
    ap.add_argument(
        "--pack", type=int, default=None, help="packed: this many tokens per microbatch"
    )
    ap.add_argument("--own-forward", action="store_true",
                    help="no logprobs pass: the first step is train_step(on_policy=True)")  # fmt: skip
    return ap.parse_args(argv)


def run(a: argparse.Namespace, dims: ParallelDims) -> None:
    actor = Actor(
        load_policy(a.checkpoint, dims),
        OptimConfig(lr=1e-3, distributed=not a.no_dist_opt),
        max_tokens_per_microbatch=a.pack,
    )
    whole = fixed_batch()
    batch = this_ranks_shard(actor, whole)
    if not a.own_forward:
        old, _ = actor.logprobs(batch, a.mbs, fit_logits=a.fit_logits)
        batch.set("old_logprobs", old if a.on_policy else off_policy(old, batch))
    if a.tis != "none":
        batch.set("rollout_logprobs", rollout_of(batch["old_logprobs"], batch))
    tis = {} if a.tis == "none" else {"mismatch": "tis", "mismatch_level": a.tis}
    loss_cfg = AlgoConfig(loss=a.kind, clip_low=0.2, clip_high=0.28, tis_cap=a.tis_cap, **tis)
    if a.load:
        actor.load(a.load)
    steps = []
    for i in range(a.steps):
        if a.save_after == i:
            if dist.get_rank() == 0:
                os.makedirs(a.save_dir)
            dist.barrier()
            actor.save(a.save_dir)
        own = a.own_forward and i == 0
        update = actor.train_step(batch, loss_cfg, a.mbs, on_policy=own)
        assert update.finite and update.applied and update.grad_norm == update.stats["grad_norm"]
        steps.append(update.stats)
    # After training (whose forward skips the prompts' logits): every position, both ways.
    # (the whole batch on every rank: the actor's other way, gathering to every rank)
    seqs = whole.row_values("tokens")
    after = {"score": score([c.module for c in actor.chunks], seqs, micro_batch_size=a.mbs),
             "logprobs": whole.to_rows(actor.logprobs(whole, a.mbs)[0])}  # fmt: skip
    old, rollout = whole_rows(batch, "old_logprobs"), whole_rows(batch, "rollout_logprobs")
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"steps": steps, "old": old, "rollout": rollout,
                       "mask": [[int(v) for v in r] for r in whole.row_values("loss_mask")], "adv": whole.row_values("advantages"), "after": after}, f)  # fmt: skip
    dist.barrier()


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--jobs"]:
        with open(argv[1]) as f:
            jobs = [parse(job) for job in json.load(f)]
    else:
        jobs = [parse(argv)]
    layouts = {(a.tp, a.pp, a.ep, a.vpp) for a in jobs}
    assert len(layouts) == 1, f"one launch runs one layout, not {layouts}"
    a = jobs[0]
    dims = ParallelDims(tp=a.tp, pp=a.pp, ep=a.ep, vpp=a.vpp, world_size=world_size_from_env())
    init_distributed(dims)
    for a in jobs:
        run(a, dims)
        gc.collect()


if __name__ == "__main__":
    main()
