"""LoRA (rank 16 on every target) vs full-weight training on the TRL comparison's `small` model
(bench_rl_step.py: Qwen3-MoE 88.7M params, hidden 512, 6 layers, 32 experts top-2), side by side
in one run: gradient and Adam-state memory, peak RSS and the training phase of one RL step
(one on-policy GSPO optimizer step over 32 sequences of 144 tokens, micro batch 8). LoRA runs
twice: an adapter per expert (`lora.experts: per_expert`) and one per layer shared by its experts
(`lora.experts: shared`).

Each mode runs in its own process (one torch thread, fp32, megatron's distributed optimizer at
world size 1), so peak RSS is that mode's alone. Gradient memory is megatron DDP's gradient
buffers; optimizer memory is Adam's state tensors (exp_avg, exp_avg_sq). The goal: LoRA's
gradient + optimizer memory <= 5% of full training's.

The modes run side by side `--rounds` times (harness.measure: alternating which goes first); the
step time is the median over every timed step of every run, peak RSS the largest of the runs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lora.py [--steps 3] [--rank 16] [--rounds 2]
                                                           [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = {"vocab_size": 8192, "hidden": 512, "layers": 6, "heads": 8, "kv_heads": 4,
         "head_dim": 64, "ffn": 1024, "moe_ffn": 256, "experts": 32, "topk": 2, "seed": 0}  # fmt: skip
ROWS, LENGTH, PROMPT, MICRO = 32, 144, 16, 8


def batch():
    import torch

    from megatron_gspo.train.batch import RLBatch

    g = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(0, SMALL["vocab_size"], (LENGTH,), generator=g).tolist() for _ in range(ROWS)
    ]
    masks = [[0] * PROMPT + [1] * (LENGTH - PROMPT) for _ in range(ROWS)]
    return RLBatch(tokens, masks, torch.randn(ROWS, generator=g).tolist())


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def child(model: str, rank: int, steps: int, experts: str) -> dict:
    import torch

    from megatron_gspo.algo.config import AlgoConfig
    from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig
    from megatron_gspo.model.optim import OptimConfig
    from megatron_gspo.model.parallel import ParallelDims, init_distributed
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.train.actor import Actor

    torch.set_num_threads(1)
    dims = ParallelDims(world_size=1)
    init_distributed(dims)
    lora = (
        LoraConfig(rank=rank, alpha=2.0 * rank, experts=ExpertAdapters(experts)) if rank else None
    )
    actor = Actor(load_policy(model, dims, lora=lora), OptimConfig(lr=1e-5))
    b, loss = batch(), AlgoConfig(loss="gspo", clip_low=3e-4, clip_high=4e-4)
    times = []
    for _ in range(steps + 1):  # the first step is warm-up (lazy Adam state, first allocations)
        t0 = time.perf_counter()
        actor.train_step(b, loss, MICRO, on_policy=True)
        times.append(time.perf_counter() - t0)
    grads = [
        buf.grad_data for c in actor.chunks for buf in (*c.buffers, *c.expert_parallel_buffers)
    ]
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    states = [t for o in opts for s in o.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t) and t.dim() > 0]  # fmt: skip
    params = [p for c in actor.chunks for p in c.parameters()]
    return {
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "grad_mb": _bytes(grads) / 2**20,
        "adam_mb": _bytes(states) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "times": times[1:],
    }


# hidden, layers, heads, kv heads, head dim, experts, expert ffn, vocab (its config.json)
QWEN3_30B_A3B = dict(h=2048, layers=48, nq=32, nkv=4, d=128, experts=128, f=768, vocab=151936)


def trainable_share(m: dict, r: int, shared: bool = False) -> float:
    """Adapter parameters / all parameters of an all-MoE Qwen3 with rank-r LoRA on every target
    (gradients and Adam state scale with it: the same bytes per trainable parameter); `shared`:
    one expert adapter per layer (lora.experts: shared)."""
    h, q, kv = m["h"], m["nq"] * m["d"], m["nkv"] * m["d"]
    attn = h * (q + 2 * kv) + q * h
    attn_lora = r * 3 * h + r * (q + 2 * kv) + r * (q + h)  # q/k/v have an A each
    expert = 3 * h * m["f"]
    expert_lora = r * (h + 2 * m["f"]) + r * (m["f"] + h)  # gate_up: one A, B [2F, r]
    layer = attn + m["experts"] * expert + m["experts"] * h  # + router
    lora = m["layers"] * (attn_lora + (1 if shared else m["experts"]) * expert_lora)
    return lora / (m["layers"] * layer + 2 * m["vocab"] * h)


def run_child(model: Path, rank: int, steps: int, experts: str = "per_expert") -> list[dict]:
    """One mode in its own process: a sample per timed step (train_s) with the run's memory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))  # fmt: skip
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(model),
        "--rank",
        str(rank),
        "--steps",
        str(steps),
        "--experts",
        experts,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    times = got.pop("times")
    return [{**got, "train_s": t} for t in times]


def _port() -> int:
    from megatron_gspo.comm import free_port

    return free_port()


def main() -> None:
    from harness import Variant, finish, markdown_table, measure, parser  # (bench/ on the path)

    p = parser(__doc__, reps=2, warmup=None, reps_flags=("--rounds", "--reps"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--experts", default="per_expert", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rank, a.steps, a.experts)))
        return
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    with tempfile.TemporaryDirectory() as work:
        model = make_tiny_model(TinySpec(**SMALL), Path(work) / "small")
        full, per, shared = "full", f"lora_r{a.rank}", f"lora_r{a.rank}_shared"
        runs = ((full, 0, "per_expert"), (per, a.rank, "per_expert"), (shared, a.rank, "shared"))
        modes = [Variant(n, lambda r=r, e=e: run_child(model, r, a.steps, e)) for n, r, e in runs]
        res = measure(modes, a.reps, name="lora")
    print(f"small model, {ROWS} x {LENGTH} tokens, micro batch {MICRO}, {a.reps} runs x "
          f"{a.steps} steps per mode (train_s: median; peak_rss_mb: the largest run's)")  # fmt: skip
    rows = []
    for key in ("params", "trainable", "grad_mb", "adam_mb", "peak_rss_mb", "train_s"):
        f, lo, sh = (res.spread(m, key)[1] if key == "peak_rss_mb" else res.median(m, key)
                     for m in (full, per, shared))  # fmt: skip
        rows.append([key, f"{f:.4g}", f"{lo:.4g}", f"{sh:.4g}", f"{lo / f:.4f}", f"{sh / f:.4f}"])
    head = ["", "full", f"LoRA r{a.rank}", "shared", "LoRA / full", "shared / full"]
    print(markdown_table(head, rows))
    mem = {m: res.median(m, "grad_mb") + res.median(m, "adam_mb") for m in (full, per, shared)}
    for m, key in ((per, "grad_adam_lora_over_full"), (shared, "grad_adam_shared_over_full")):
        ratio = res.extra[key] = mem[m] / mem[full]
        print(f"gradient + optimizer memory, {m} / full: {ratio:.4f} (goal <= 0.05: "
              f"{'met' if ratio <= 0.05 else 'missed'})")  # fmt: skip
    share = res.extra["qwen3_30b_a3b_trainable_share"] = trainable_share(QWEN3_30B_A3B, a.rank)
    tied = trainable_share(QWEN3_30B_A3B, a.rank, shared=True)
    res.extra["qwen3_30b_a3b_trainable_share_shared"] = tied
    print(f"the same share computed for Qwen3-30B-A3B's shapes: {share:.4f} (shared: {tied:.4f})")
    finish(res, a)


if __name__ == "__main__":
    main()
