"""Rollout throughput: the built-in server (over HTTP, the async client) vs HF transformers
`generate`, on the same tiny Qwen3-MoE, prompts and lengths, measured side by side in one run.

Each repetition runs both (alternating which goes first): 8 prompts x 8 samples, NEW tokens each
(ignore_eos / min_new_tokens, temperature 1), the server also returning log-probs. Prints
generated tokens/s of each (median over repetitions) and the ratio server / HF last (goal >= 2).
Both use the same number of torch threads; the server is idle while HF runs.

On a shared machine wall-clock rates swing with the load, so each repetition also reports tokens
per CPU-second: the server process's CPU time (all its threads, HTTP included; the client's is
not counted) against the CPU time of the process running HF `generate`.

    .venv/bin/python bench/bench_rollout.py [--reps 5] [--new-tokens 64] [--threads 1]
                                            [--decode-kernel auto|c|torch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from transfer_floors import cpu_seconds  # (bench/ is on the path: run as a script)

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup

SPEC = TinySpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                ffn=256, moe_ffn=64, experts=8, topk=2, init_std=0.05, seed=0)  # fmt: skip


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 25, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (k,), generator=g).tolist() for k in lens]


def run_server(
    url: str, pid: int, batch: list[list[int]], samples: int, new: int
) -> tuple[float, float]:
    """(tokens/s, tokens per CPU-second of the server process)."""
    sp = {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}

    async def go():
        async with RolloutClient([url], max_concurrency=256) as c:
            t, cpu = time.perf_counter(), cpu_seconds(pid)
            out = await c.generate(batch, n=samples, sampling_params=sp, return_logprob=True)
            dt, dcpu = time.perf_counter() - t, cpu_seconds(pid) - cpu
        tokens = sum(len(s.tokens) for g in out for s in g)
        assert tokens == len(batch) * samples * new, tokens
        return tokens / dt, tokens / max(dcpu, 1e-9)

    return asyncio.run(go())


def run_hf(model, batch: list[list[int]], samples: int, new: int) -> tuple[float, float]:
    """(tokens/s, tokens per CPU-second of this process)."""
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            max_new_tokens=new, min_new_tokens=new, num_return_sequences=samples, pad_token_id=0,
        )  # fmt: skip
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = (out.shape[1] - width) * out.shape[0]
    assert tokens == len(batch) * samples * new, tokens
    return tokens / dt, tokens / max(dcpu, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, each side")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--decode-kernel", default="auto", choices=["auto", "c", "torch"],
                    help="the server's decode path (torch: the plain-torch fallback)")  # fmt: skip
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-rollout-"))
    ckpt = work / "tiny-moe"
    if not ckpt.exists():
        make_tiny_model(SPEC, ckpt)
    torch.set_num_threads(args.threads)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    batch = prompts(args.prompts, SPEC.vocab_size)
    cfg = ServerConfig(
        model_path=str(ckpt), threads=args.threads, max_running_requests=256,
        env={"OMP_NUM_THREADS": str(args.threads),
             "MEGATRON_GSPO_DECODE_KERNEL": args.decode_kernel},
    )  # fmt: skip
    n, new = args.samples, args.new_tokens
    print(f"model: {ckpt} ({sum(p.numel() for p in hf.parameters()) / 1e6:.2f}M params), "
          f"{len(batch)} prompts x {n} samples x {new} new tokens, {args.threads} thread(s)")  # fmt: skip
    ours, theirs = [], []
    with ServerGroup([cfg], work / "logs") as servers:
        url, pid = servers.urls[0], servers.servers[0].pid
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            print(f"built-in server decode steps: {json.load(r).get('decode_kernel', 'torch')}")
        run_server(url, pid, batch, n, new)  # warm-up, both sides
        run_hf(hf, batch, n, new)
        for rep in range(args.reps):
            pair = [("server", lambda: run_server(url, pid, batch, n, new)),
                    ("hf", lambda: run_hf(hf, batch, n, new))]  # fmt: skip
            for name, fn in pair if rep % 2 == 0 else pair[::-1]:
                (ours if name == "server" else theirs).append(fn())
            (a, a_cpu), (b, b_cpu) = ours[-1], theirs[-1]
            print(f"rep {rep}: built-in server {a:8.0f} tok/s   HF generate {b:8.0f} tok/s   "
                  f"ratio {a / b:.2f}x | per CPU-second: server {a_cpu:.0f}, HF {b_cpu:.0f}, "
                  f"ratio {a_cpu / b_cpu:.2f}x")  # fmt: skip
    med = statistics.median
    a, b = med(x for x, _ in ours), med(x for x, _ in theirs)
    a_cpu, b_cpu = med(x for _, x in ours), med(x for _, x in theirs)
    paired = med(x / y for (x, _), (y, _) in zip(ours, theirs))
    print(f"median tokens per CPU-second: built-in server {a_cpu:.0f}, HF generate {b_cpu:.0f} "
          f"(ratio {a_cpu / b_cpu:.2f}x); median of per-repetition ratios {paired:.2f}x")  # fmt: skip
    print(f"median generated tokens/s: built-in server {a:.0f}, HF transformers generate {b:.0f}")
    print(f"ratio built-in server / HF generate: {a / b:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
