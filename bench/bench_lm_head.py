"""Peak memory and time of the LM head's log-probs: today's whole logits against the chunked head.

One training step of the head as the actor runs it, forward and backward, from leaf hidden
states h [T, H] and a leaf output weight W [V, H] (V = 151,936 and H = 2048: Qwen3-30B-A3B),
log-probs of T target tokens with the entropy as a detached metric, loss sum_t g_t log p_t:

  - whole:       logits = h W^T (the output layer), then `vocab_parallel_logprobs` over them
                 (its elementwise chunked passes, today's CPU path and until now the GPU's)
  - whole_fused: the same logits through the few-pass path (`fused=True`, the GPU default)
  - chunked:     `lm_head_logprobs`: a chunk of tokens' logits at a time, never all of them

Each variant runs once in a fresh subprocess that builds the inputs and then measures the step:
on a CPU the resident-memory high-water mark beyond the inputs (Linux: reset through
/proc/self/clear_refs after glibc's malloc_trim; an OS-level upper bound), on a GPU
torch.cuda.max_memory_allocated beyond the inputs. Time: the wall time of that step (a GPU's
after a warm-up step and synchronized). Both include W's gradient (V x H), which any head forms.

    .venv/bin/python bench/bench_lm_head.py [--tokens 2048] [--chunk 1024] [--dtype fp32|bf16]
                                            [--variants whole,whole_fused,chunked] [--reps 1]
                                            [--json OUT]

With `--reps` > 1 each variant runs that many times (a fresh subprocess each, in rotating order),
and the medians are shown.

On a CPU use fp32 (this torch's bf16 GEMM on a CPU without bf16 instructions is ~300x slower).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import time

import torch

# (bench/ on the path)
from harness import Variant, finish, markdown_table, measure, parser

from megatron_gspo.model.lm_head import lm_head_logprobs
from megatron_gspo.model.logprobs import vocab_parallel_logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("whole", "whole_fused", "chunked")


def make_inputs(a, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = DTYPES[a.dtype]
    h = torch.randn(a.tokens, a.hidden, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g, device=device) * a.hidden**-0.5).to(dtype)
    targets = torch.randint(0, a.vocab, (a.tokens,), generator=g, device=device)
    g_lp = torch.randn(a.tokens, generator=g, device=device)
    return dict(h=h, w=w.requires_grad_(), targets=targets, g=g_lp)


def step(variant: str, x: dict, a) -> None:
    """Forward and backward of one variant; the gradients are dropped after."""
    if variant == "chunked":
        lp, ent = lm_head_logprobs(x["h"], x["w"], x["targets"], with_entropy=True,
                                   chunk_tokens=a.chunk)  # fmt: skip
    else:
        logits = x["h"] @ x["w"].t()
        lp, ent = vocab_parallel_logprobs(logits, x["targets"], with_entropy=True,
                                          fused=variant == "whole_fused")  # fmt: skip
    assert ent is not None
    ent.detach()  # a metric, as the actor reports it
    (lp * x["g"]).sum().backward()
    x["h"].grad = x["w"].grad = None


def probe(a) -> None:
    """One variant in this process: prints {peak_bytes, seconds} as JSON."""
    device = torch.device(a.device)
    x = make_inputs(a, device)
    if device.type == "cuda":
        step(a.probe, x, a)  # warm-up (kernels, cuBLAS workspace)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _reset_peak_rss()
    t = time.perf_counter()
    step(a.probe, x, a)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_bytes": peak - base, "seconds": time.perf_counter() - t}))


def _reset_peak_rss() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def run_variant(variant: str, a) -> dict:
    cmd = [sys.executable, __file__, "--probe", variant, "--tokens", str(a.tokens),
           "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--chunk", str(a.chunk),
           "--dtype", a.dtype, "--device", a.device]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__, reps=1, warmup=None)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--probe", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.probe:
        probe(a)
        return
    logits = a.tokens * a.vocab * torch.empty((), dtype=DTYPES[a.dtype]).element_size()
    print(f"LM head step: {a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab}, {a.dtype}, "
          f"{a.device}; chunk {a.chunk} tokens; the logits are {logits / 2**30:.2f} GiB")  # fmt: skip

    def row(v: str, rep: int, s: list[dict]) -> None:  # each row as soon as it is measured
        r = s[0]
        print(f"{v} (rep {rep}): peak beyond inputs {r['peak_bytes'] / 2**30:.2f} GiB, "
              f"{r['peak_bytes'] / logits:.2f}x logits, {r['seconds']:.2f} s", flush=True)  # fmt: skip

    variants = [Variant(v, lambda v=v: run_variant(v, a)) for v in a.variants.split(",")]
    res = measure(variants, a.reps, name="lm_head", on_sample=row)
    res.extra["logits_bytes"] = logits
    rows = [[v, f"{res.median(v, 'peak_bytes') / 2**30:.2f} GiB",
             f"{res.median(v, 'peak_bytes') / logits:.2f}", f"{res.median(v):.2f}"]
            for v in res.variants]  # fmt: skip
    print(markdown_table(["variant", "peak beyond inputs", "x logits", "seconds"], rows))
    if "whole" in res.samples and "chunked" in res.samples:
        print(f"chunked / whole peak: {res.ratio('chunked', 'whole', 'peak_bytes'):.2f}")
    finish(res, a)


if __name__ == "__main__":
    main()
