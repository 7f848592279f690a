"""Worker for the chunked LM head under tensor parallelism (gloo, 2 ranks).

torchrun --nproc-per-node 2 tests/distributed/lm_head_worker.py OUT.json CKPT_DENSE_TIED CKPT_MOE

1. The head alone: each rank holds half of a padded vocabulary's output weight; the hidden
   states enter it as megatron's output layer would take them (copied, or all-gathered along
   the sequence under sequence parallelism). Log-probs, entropy and the gradients w.r.t. the
   hidden states and the whole weight (gathered) against the single-rank computation of today:
   log_softmax of the whole logits h W^T (`vocab_parallel_logprobs`, one rank). The fused
   full-logits path under TP against today's TP path and the same reference.
2. Whole models (a dense model with tied embeddings, with and without sequence parallelism;
   an MoE model): the chunked head against the output layer's whole logits, log-probs,
   entropy and every parameter's gradient; and a logits window under sequence parallelism.
3. The actor (megatron DDP, distributed optimizer): two steps with the head on and off.
Rank 0 writes the largest differences as JSON.
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_gspo.model.builder import BuildOptions, set_logits_from
from megatron_gspo.model.forward import next_token_logprobs
from megatron_gspo.model.lm_head import head_input, lm_head_logprobs, lm_head_of
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import load_policy

S, B, H, V, VOCAB = 12, 3, 16, 128, 100  # sequence, batch, hidden, padded vocab, true vocab


def diff(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def reference(h_SBH, w_VH, targets_BS, g):
    """Today's single-rank computation: the whole logits, then the log-softmax; gradients."""
    h, w = h_SBH.clone().requires_grad_(), w_VH.clone().requires_grad_()
    logits = h.transpose(0, 1) @ w.t()
    lp, ent = vocab_parallel_logprobs(logits, targets_BS, vocab_size=VOCAB, with_entropy=True,
                                      fused=False)  # fmt: skip
    dh, dw = torch.autograd.grad((lp * g[0]).sum() + (ent * g[1]).sum(), (h, w))
    return lp, ent, dh, dw


def head_under_tp(sp: bool, data, ref) -> dict:
    from megatron.core import parallel_state as mpu

    h_full, w_full, targets, g = data
    r, group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
    v = V // 2
    h_in = (h_full[r * S // 2 : (r + 1) * S // 2] if sp else h_full).clone().requires_grad_()
    w = w_full[r * v : (r + 1) * v].clone().requires_grad_()
    hidden = head_input(h_in, sp)  # [b, s, H], as the output layer hands it
    lp, ent = lm_head_logprobs(hidden, w, targets, vocab_start=r * v, vocab_size=VOCAB,
                               tp_group=group, with_entropy=True, chunk_tokens=5)  # fmt: skip
    dh, dw = torch.autograd.grad((lp * g[0]).sum() + (ent * g[1]).sum(), (h_in, w))
    dw_all = [torch.empty_like(dw) for _ in range(2)]
    dist.all_gather(dw_all, dw, group=group)
    if sp:
        dh_all = [torch.empty_like(dh) for _ in range(2)]
        dist.all_gather(dh_all, dh, group=group)
        dh = torch.cat(dh_all)
    got = (lp, ent, dh, torch.cat(dw_all))
    return dict(zip(("logprobs", "entropy", "grad_h", "grad_w"), map(diff, got, ref)))


def fused_under_tp(data, ref) -> dict:
    """Full local logits under TP: the fused path against today's TP path and the reference."""
    from megatron.core import parallel_state as mpu

    h_full, w_full, targets, g = data
    r, group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
    v = V // 2
    local = (h_full.transpose(0, 1) @ w_full[r * v : (r + 1) * v].t()).detach()
    out = {}
    for fused in (True, False):
        x = local.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, targets, vocab_start=r * v, vocab_size=VOCAB,
                                          tp_group=group, with_entropy=True, fused=fused)  # fmt: skip
        (dx,) = torch.autograd.grad((lp * g[0]).sum() + (ent * g[1]).sum(), x)
        out[fused] = (lp, ent, dx)
    f, c = out[True], out[False]
    return {"logprobs": max(diff(f[0], c[0]), diff(f[0], ref[0])),
            "entropy": max(diff(f[1], c[1]), diff(f[1], ref[1])), "grad_logits": diff(f[2], c[2])}  # fmt: skip


def model_run(ckpt, opts: BuildOptions, tokens, g, window: int = 0):
    """Log-probs, entropy and every parameter's gradient of one forward/backward (None for a
    parameter that got none)."""
    (chunk,) = load_policy(ckpt, ParallelDims(tp=2, world_size=2), opts)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    set_logits_from(chunk, window)
    out = chunk(tokens, pos, None)
    lp, ent = next_token_logprobs(out, tokens, chunk.model_spec.vocab_size, True, lm_head_of(chunk))
    ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in chunk.named_parameters()}
    return lp.detach(), ent.detach(), grads


def compare_models(ckpt, sp: bool, tokens, g) -> dict:
    on = model_run(ckpt, BuildOptions(sequence_parallel=sp, lm_head_chunk_tokens=5), tokens, g)
    off = model_run(ckpt, BuildOptions(sequence_parallel=sp, lm_head_chunk_tokens=0), tokens, g)
    assert on[2].keys() == off[2].keys()
    have = [n for n in off[2] if off[2][n] is not None and on[2][n] is not None]
    rel = max(diff(on[2][n], off[2][n]) / max(off[2][n].abs().max().item(), 1e-12) for n in have)
    out = {"logprobs": diff(on[0], off[0]), "entropy": diff(on[1], off[1]), "grad_rel": rel,
           "n_grads": len(have), "n_params": len(off[2]),
           "lp_scale": off[0].abs().max().item()}  # fmt: skip
    if sp:  # a window (prompt positions without logits) under sequence parallelism
        start = 3
        win = model_run(ckpt, BuildOptions(sequence_parallel=True, lm_head_chunk_tokens=5),
                        tokens, g, window=start)  # fmt: skip
        out["window"] = max(diff(win[0][:, start:], on[0][:, start:]),
                            win[0][:, :start].abs().max().item())  # fmt: skip
    return out


def actor_steps(ckpt, chunk_tokens: int) -> dict:
    """Two GRPO steps of the actor (megatron DDP, distributed optimizer; the head's weight
    gradient into DDP's main_grad): the metrics of each, and the output weight after."""
    from megatron_gspo.algo.config import AlgoConfig
    from megatron_gspo.train.actor import Actor, OptimConfig
    from megatron_gspo.train.batch import RLBatch

    chunks = load_policy(ckpt, ParallelDims(tp=2, world_size=2),
                         BuildOptions(lm_head_chunk_tokens=chunk_tokens))  # fmt: skip
    actor = Actor(chunks, OptimConfig(lr=1e-3))
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (9, 14, 6, 11)]
    masks = [[0] * 3 + [1] * (len(t) - 3) for t in tokens]
    batch = RLBatch(tokens, masks, torch.randn(4, generator=g).tolist())
    loss = AlgoConfig(loss="grpo", clip_low=3e-4, clip_high=4e-4)
    steps = [actor.train_step(batch, loss, 2, on_policy=True).stats for _ in range(2)]
    weight = actor.chunks[0].module.output_layer.weight.detach().float().clone()
    return {"steps": steps, "weight": weight, "head": lm_head_of(actor.chunks[0]) is not None}


def compare_actors(ckpt) -> dict:
    on, off = actor_steps(ckpt, 5), actor_steps(ckpt, 0)
    keys = ("grad_norm", "loss", "entropy")
    rel = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12)
              for a, b in zip(on["steps"], off["steps"]) for k in keys)  # fmt: skip
    moved = diff(off["weight"], actor_steps_start(ckpt))
    assert on["head"] and not off["head"]
    return {"metrics_rel": rel, "weight": diff(on["weight"], off["weight"]), "moved": moved,
            "grad_norm": off["steps"][0]["grad_norm"]}  # fmt: skip


def actor_steps_start(ckpt):
    (chunk,) = load_policy(ckpt, ParallelDims(tp=2, world_size=2), BuildOptions())
    return chunk.output_layer.weight.detach().float()


def main() -> None:
    out_path, dense_ckpt, moe_ckpt = sys.argv[1:4]
    init_distributed(ParallelDims(tp=2, world_size=2))
    gen = torch.Generator().manual_seed(0)  # the same data on every rank
    data = (torch.randn(S, B, H, generator=gen), torch.randn(V, H, generator=gen) / 2,
            torch.randint(0, VOCAB, (B, S), generator=gen),
            (torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)))  # fmt: skip
    ref = reference(*data)
    result = {f"head_sp{int(sp)}": head_under_tp(sp, data, ref) for sp in (False, True)}
    result["fused_tp"] = fused_under_tp(data, ref)
    tokens = torch.randint(3, 100, (2, 8), generator=gen)
    g = (torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen))
    result["dense_tied_sp0"] = compare_models(dense_ckpt, False, tokens, g)
    result["dense_tied_sp1"] = compare_models(dense_ckpt, True, tokens, g)
    result["moe_sp1"] = compare_models(moe_ckpt, True, tokens, g)
    result["actor_moe"] = compare_actors(moe_ckpt)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
