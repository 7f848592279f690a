"""Worker for the LoRA tests: the tiny MoE with adapters on every target (B set to seeded
random values, so the adapters matter), whole-batch log-probs, one on-policy GSPO step's adapter
gradients, and the merged HF weights the weight sync sends; rank 0 saves them (torch.save).

torchrun --nproc-per-node N tests/distributed/lora_worker.py CKPT OUT.pt [--tp ..] [--ep ..]
    [--experts shared] [--grouped]
"""

import argparse
import dataclasses
import os
import sys
import zlib

import torch
import torch.distributed as dist

from megatron_gspo.model.builder import BuildOptions
from megatron_gspo.model.lora import Kind, is_lora_param
from megatron_gspo.model.lora_apply import adapters
from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig
from megatron_gspo.model.lora_peft import all_factors, peft_tensors
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.model.weights import iter_hf
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import RLBatch
from megatron_gspo.weight_sync.gather import iter_stage

LORA = LoraConfig(rank=4, alpha=8.0)


def fixed_batch(n: int = 8, vocab: int = 100) -> RLBatch:
    """Eight seeded sequences of 6-19 tokens, 2-4 of them prompt, with random advantages."""
    g = torch.Generator().manual_seed(0)
    tokens, masks = [], []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        tokens.append(torch.randint(0, vocab, (length,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
    return RLBatch(tokens, masks, torch.randn(n, generator=g).tolist())


@torch.no_grad()
def set_b(chunks) -> None:
    """B = seeded N(0, 0.05^2) (full tensor, then this rank's rows): a layout-free nonzero start."""
    for ad in adapters(chunks):
        column = ad.site.kind in (Kind.COLUMN, Kind.EXPERT_COLUMN)
        for i, ((_, out), b) in enumerate(zip(ad.site.parts, ad.B)):
            g = torch.Generator().manual_seed(zlib.crc32(f"{ad.site.name}.B{i}".encode()))
            full = torch.randn(out, LORA.rank, generator=g) * 0.05
            b.copy_(full.chunk(ad.tp, dim=0)[ad.tp_rank] if column else full)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    for axis in ("tp", "pp", "ep"):
        ap.add_argument(f"--{axis}", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--resume", default=None, help="check save + resume in this directory")
    ap.add_argument("--experts", default="per_expert", help="lora.experts")
    ap.add_argument("--grouped", action="store_true", help="grouped experts (model/experts.py)")
    a = ap.parse_args(argv)
    dims = ParallelDims(tp=a.tp, pp=a.pp, ep=a.ep, vpp=a.vpp, world_size=world_size_from_env())
    init_distributed(dims)
    lora = dataclasses.replace(LORA, experts=ExpertAdapters(a.experts))
    a.opts = BuildOptions(moe_grouped_gemm=a.grouped)
    if a.resume:
        resume(a, dims, lora)
    else:
        compare(a, dims, lora)
    dist.barrier()
    dist.destroy_process_group()


def resume(a, dims, lora: LoraConfig) -> None:
    """Three steps straight vs two, a checkpoint, a fresh actor loading it, the third: the same
    log-probs after (exact); the checkpoint holds no base weight."""
    batch = fixed_batch()
    loss_cfg = AlgoConfig(loss="gspo", clip_low=0.2, clip_high=0.28)
    runs = []
    for fresh in (False, True):
        actor = Actor(load_policy(a.checkpoint, dims, a.opts, lora=lora), OptimConfig(lr=1e-2))
        for i in range(3):
            if fresh and i == 2:
                actor = Actor(
                    load_policy(a.checkpoint, dims, a.opts, lora=lora), OptimConfig(lr=1e-2)
                )
                actor.load(a.resume)
            elif not fresh and i == 2:
                if dist.get_rank() == 0:
                    os.makedirs(a.resume)
                dist.barrier()
                actor.save(a.resume)
                at_save = batch.to_rows(actor.logprobs(batch, 4)[0])
            actor.train_step(batch, loss_cfg, 4, on_policy=True)
        runs.append(batch.to_rows(actor.logprobs(batch, 4)[0]))
    if dist.get_rank() == 0:
        torch.save(dict(straight=runs[0], resumed=runs[1], at_save=at_save), a.out)


def compare(a, dims, lora: LoraConfig) -> None:
    chunks = load_policy(a.checkpoint, dims, a.opts, lora=lora)
    set_b(chunks)
    trainable = [n for c in chunks for n, p in c.named_parameters() if p.requires_grad]
    assert trainable and all(is_lora_param(n) for n in trainable), trainable  # the base is frozen
    merged = {}
    for name, t in iter_hf(chunks):
        merged[name] = t.clone()
    changed = [name for name, _ in iter_stage(chunks, changed_only=True)]  # a LoRA sync's
    actor = Actor(chunks, OptimConfig(lr=1e-30, clip_grad=0.0, distributed=False))
    batch = fixed_batch()
    flat, _ = actor.logprobs(batch, 4)  # [T]: each row's at cu_seqlens[i]:cu_seqlens[i + 1]
    cu = batch.cu_seqlens.tolist()
    logprobs = [flat[a:b].tolist() for a, b in zip(cu[:-1], cu[1:], strict=True)]
    loss_cfg = AlgoConfig(loss="gspo", clip_low=0.2, clip_high=0.28)
    metrics = actor.train_step(batch, loss_cfg, 4, on_policy=True)
    values = peft_tensors(all_factors(actor.chunks), lora)
    grads = peft_tensors(all_factors(actor.chunks, grads=True), lora)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (merged, changed))
    if dist.get_rank() == 0:
        merged_all = {k: v for p in parts for k, v in p[0].items()}
        changed_all = sorted(n for p in parts for n in p[1])
        torch.save(dict(logprobs=logprobs, values=values, grads=grads, merged=merged_all, changed=changed_all,
                        grad_norm=metrics.grad_norm), a.out)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
