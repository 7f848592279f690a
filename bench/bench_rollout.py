"""Rollout throughput: the built-in server (over HTTP, the async client) vs HF transformers
`generate`, on the same tiny Qwen3-MoE, prompts and lengths, measured side by side in one run.

Each repetition runs both (harness.measure: after a warm-up call each, alternating which goes
first): 8 prompts x 8 samples, NEW tokens each (ignore_eos / min_new_tokens, temperature 1), the
server also returning log-probs. Prints
generated tokens/s of each (median over repetitions) and the ratio server / HF last (goal >= 2).
Both use the same number of torch threads; the server is idle while HF runs.

On a shared machine wall-clock rates swing with the load, so each repetition also reports tokens
per CPU-second: the server process's CPU time (all its threads, HTTP included; the client's is
not counted) against the CPU time of the process running HF `generate`. The server's is summed
over its threads' schedstat (ns; /proc's clock ticks of 10 ms would not resolve a short run); a
repetition in which one of its threads ended has none ("n/a").

    .venv/bin/python bench/bench_rollout.py [--reps 5] [--new-tokens 64] [--threads 1]
                                            [--decode-kernel auto|c|torch] [--json OUT]
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import torch
from harness import (  # (bench/ is on the path)
    CpuRead,
    Variant,
    finish,
    measure,
    median,
    parser,
    workdir,
)

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup

SPEC = TinySpec(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                ffn=256, moe_ffn=64, experts=8, topk=2, init_std=0.05, seed=0)  # fmt: skip


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 25, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (k,), generator=g).tolist() for k in lens]


def run_server(url: str, pid: int, batch: list[list[int]], samples: int, new: int) -> dict:
    """tokens/s, and tokens per CPU-second of the server process."""
    sp = {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}

    async def go():
        async with RolloutClient([url], max_concurrency=256) as c:
            t, cpu = time.perf_counter(), CpuRead.of(pid)
            out = await c.generate(batch, n=samples, sampling_params=sp, return_logprob=True)
            dt, dcpu = time.perf_counter() - t, cpu.seconds_to(CpuRead.of(pid))
        tokens = sum(len(s.tokens) for g in out for s in g)
        assert tokens == len(batch) * samples * new, tokens
        rates = {"tokens_per_s": tokens / dt}
        if dcpu:  # (None: a thread ended between the reads)
            rates["tokens_per_cpu_s"] = tokens / dcpu
        return rates

    return asyncio.run(go())


def run_hf(model, batch: list[list[int]], samples: int, new: int) -> dict:
    """tokens/s, and tokens per CPU-second of this process."""
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
    return {"tokens_per_s": tokens / dt, "tokens_per_cpu_s": tokens / max(dcpu, 1e-9)}


def main() -> None:
    ap = parser(__doc__, reps=5, warmup=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, each side")
    ap.add_argument("--workdir", default=None,
                    help="keep the model and the server's log here (default: a temporary "
                         "directory, removed after the run)")  # fmt: skip
    ap.add_argument("--decode-kernel", default="auto", choices=["auto", "c", "torch"],
                    help="the server's decode path (torch: the plain-torch fallback)")  # fmt: skip
    args = ap.parse_args()
    with workdir(args.workdir, "bench-rollout-") as work:
        run(work, args)


def run(work: Path, args) -> None:
    """The model in `work` (made unless there), a server on it, and the side-by-side run."""
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
    with ServerGroup([cfg], work / "logs") as servers:
        url, pid = servers.urls[0], servers.servers[0].pid
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            print(f"built-in server decode steps: {json.load(r).get('decode_kernel', 'torch')}")
        pair = [Variant("server", lambda: run_server(url, pid, batch, n, new)),
                Variant("hf", lambda: run_hf(hf, batch, n, new))]  # fmt: skip
        res = measure(pair, args.reps, args.warmup, name="rollout", on_sample=_print_rep)
    print(res.table({"tokens_per_s": "tokens/s", "tokens_per_cpu_s": "tokens per CPU-second"},
                    fmt=".0f"))  # fmt: skip
    a, b = res.median("server", "tokens_per_s"), res.median("hf", "tokens_per_s")
    paired = median(res.paired("server", "hf", "tokens_per_s"))
    if res.values("server", "tokens_per_cpu_s"):
        a_cpu = res.median("server", "tokens_per_cpu_s")
        b_cpu = res.median("hf", "tokens_per_cpu_s")
        cpu_ratio = res.ratio("server", "hf", "tokens_per_cpu_s")
        print(f"median tokens per CPU-second: built-in server {a_cpu:.0f}, HF generate "
              f"{b_cpu:.0f} (ratio {cpu_ratio:.2f}x)")  # fmt: skip
    else:
        print("tokens per CPU-second: n/a (a server thread ended within every repetition; "
              "its time is in /proc's clock ticks only)")  # fmt: skip
    print(f"median of per-repetition ratios of tokens/s: {paired:.2f}x")
    print(f"median generated tokens/s: built-in server {a:.0f}, HF transformers generate {b:.0f}")
    print(f"ratio built-in server / HF generate: {res.ratio('server', 'hf', 'tokens_per_s'):.2f}x "
          "(goal >= 2x)")  # fmt: skip
    finish(res, args)


def _print_rep(variant: str, rep: int, samples: list[dict]) -> None:
    s = samples[0]
    cpu = s.get("tokens_per_cpu_s")
    per_cpu = "n/a" if cpu is None else f"{cpu:.0f}"
    print(f"rep {rep}: {variant:6s} {s['tokens_per_s']:8.0f} tok/s, {per_cpu} per CPU-second",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
