"""Cost of the policy loss next to the log-probs it is computed from, at a 150k vocabulary.

Three variants, each forward AND backward from a leaf logits tensor [B, T, V] (V = 151,936, the
Qwen3 vocabulary):
  - logprobs: `vocab_parallel_logprobs` (with the entropy as a detached metric, as the actor step
              reports it) and a plain masked mean of the log-probs as the loss
  - gspo:     the same log-probs into `policy_loss(kind="gspo")` (per-sequence advantages)
  - grpo:     the same log-probs into `policy_loss(kind="grpo")`

Time: all three in one process, interleaved (harness.measure: one warm-up call each, then the
order rotates every rep, so a noisy neighbour on a shared machine hits all of them alike), median
over the reps of the process CPU time (all
threads) and of the wall time. The headline ratio uses CPU time: on a shared machine the wall time
also counts the waits for other processes' CPU and swings by 2x from rep to rep; on a quiet
machine the ratios agree. Because the loss works on [B, T] tensors, its own cost is far below the
run-to-run noise of a full-vocabulary step, so the loss is also timed alone (forward + backward
from detached log-probs, median of many reps) and printed as a share of the log-probs step.

Peak memory: each variant runs once in a fresh subprocess that builds the inputs and runs a tiny
warm-up, then resets the kernel's resident-memory high-water mark (`echo 5 >
/proc/self/clear_refs`, Linux) and reads the current RSS, runs one step, and reads the high-water
mark (`getrusage(RUSAGE_SELF).ru_maxrss`). The difference is the step's peak memory beyond the
logits and its other inputs, given in units of the logits' size. It is an OS-level upper bound
(allocator slack counts; pages allocated but never written do not). One unit of it is the
gradient w.r.t. the logits, which backward has to produce whatever the implementation.

Goal (issue 3): the loss adds under 5% time and no full-vocabulary copy beyond the logits. The
chunked log-probs keep the whole step at about 1.0-1.3x logits (the gradient plus 32 MiB chunk
temporaries); the plain-autograd version they replaced measured 5.0x.

    .venv/bin/python bench/bench_loss.py [--batch 2] [--seq 256] [--vocab 151936] [--reps 9]
                                        [--dtype fp32|bf16] [--no-entropy] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys

import torch
from harness import WALL_AND_CPU, Result, Variant, finish, markdown_table, measure, parser

from megatron_gspo.algo.policy_loss import policy_loss
from megatron_gspo.model.logprobs import vocab_parallel_logprobs

VARIANTS = ("logprobs", "gspo", "grpo")
CLIP = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.28)}  # the papers' (GSPO, DAPO) clip ranges
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(batch: int, seq: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Leaf logits [B, T, V], targets, a ragged mask, old log-probs near the new, advantages [B]."""
    g = torch.Generator().manual_seed(seed)
    logits_BTV = torch.empty(batch, seq, vocab, dtype=dtype).normal_(0.0, 2.0, generator=g)
    logits_BTV.requires_grad_()
    targets_BT = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths_B = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask_BT = torch.arange(seq) < lengths_B.unsqueeze(-1)
    with torch.no_grad():
        lp_BT, _ = vocab_parallel_logprobs(logits_BTV, targets_BT, vocab_size=vocab)
    old_BT = lp_BT + 1e-3 * torch.randn(batch, seq, generator=g)
    adv_B = torch.randn(batch, generator=g)
    return dict(logits=logits_BTV, targets=targets_BT, mask=mask_BT, old=old_BT, adv=adv_B)


def loss_of(variant: str, lp_BT: torch.Tensor, x: dict) -> torch.Tensor:
    if variant == "logprobs":
        return -(lp_BT * x["mask"]).sum() / x["mask"].sum()
    low, high = CLIP[variant]
    loss, _ = policy_loss(lp_BT, x["old"], x["adv"], x["mask"], kind=variant, clip_low=low,
                          clip_high=high)  # fmt: skip
    return loss


def step(variant: str, x: dict, with_entropy: bool) -> None:
    """Forward and backward of one variant from the logits; the gradient is dropped after."""
    vocab = x["logits"].shape[-1]
    lp_BT, ent_BT = vocab_parallel_logprobs(x["logits"], x["targets"], vocab_size=vocab,
                                            with_entropy=with_entropy)  # fmt: skip
    if ent_BT is not None:  # a metric: detached, and its graph dropped before backward
        ent_BT = ent_BT.detach()[x["mask"]].mean()
    loss_of(variant, lp_BT, x).backward()
    x["logits"].grad = None


def time_interleaved(x: dict, reps: int, with_entropy: bool) -> Result:
    """Wall and process CPU seconds of each variant's step, side by side."""
    steps = [Variant(v, lambda v=v: step(v, x, with_entropy)) for v in VARIANTS]
    return measure(steps, reps, warmup=1, name="loss", clocks=WALL_AND_CPU)


def time_loss_alone(x: dict, reps: int = 200) -> Result:
    """Forward + backward of each loss from detached log-probs [B, T] (a fresh leaf per call,
    made untimed)."""
    lp0_BT = x["old"] + 1e-3 * torch.randn_like(x["old"])
    leaf: list[torch.Tensor] = []

    def fresh() -> None:
        leaf[:] = [lp0_BT.clone().requires_grad_()]

    losses = [Variant(v, lambda v=v: loss_of(v, leaf[0], x).backward(), fresh) for v in VARIANTS]
    return measure(losses, reps, name="loss alone")


def reset_peak_rss() -> int:
    """Resets this process's resident-memory high-water mark (Linux); returns the current RSS.

    Free heap memory is first handed back to the OS (glibc `malloc_trim`), so that the step
    cannot reuse set-up leftovers already counted in the baseline.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """The high-water mark since the reset (getrusage's ru_maxrss reads the same counter)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def probe_peak(args: argparse.Namespace) -> None:
    """(Subprocess) Peak resident memory of one step of one variant beyond its inputs, as JSON."""
    dtype = DTYPES[args.dtype]
    step(args.probe, make_inputs(1, 4, args.vocab, dtype, seed=1), not args.no_entropy)  # warm-up
    x = make_inputs(args.batch, args.seq, args.vocab, dtype)
    before = reset_peak_rss()  # set-up transients (e.g. old log-probs) must not hide the step's
    step(args.probe, x, not args.no_entropy)
    print(json.dumps({"extra": peak_rss() - before}))


def measure_peak(variant: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, __file__, "--probe", variant, "--batch", str(args.batch), "--seq",
           str(args.seq), "--vocab", str(args.vocab), "--dtype", args.dtype]  # fmt: skip
    cmd += ["--no-entropy"] if args.no_entropy else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["extra"]


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, reps=9, warmup=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--no-entropy", action="store_true", help="log-probs without the entropy")
    ap.add_argument("--alone-reps", type=int, default=200, help="reps of the loss timed alone")
    ap.add_argument("--probe", choices=VARIANTS, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.probe:
        return probe_peak(args)
    x = make_inputs(args.batch, args.seq, args.vocab, DTYPES[args.dtype])
    logits_bytes = x["logits"].numel() * x["logits"].element_size()
    print(f"logits [{args.batch}, {args.seq}, {args.vocab}] {args.dtype}: "
          f"{logits_bytes / 1e9:.2f} GB; entropy {'off' if args.no_entropy else 'on'}; "
          f"{torch.get_num_threads()} threads; {args.reps} reps")  # fmt: skip
    res = time_interleaved(x, args.reps, not args.no_entropy)
    alone = time_loss_alone(x, args.alone_reps)
    del x
    peak = {v: measure_peak(v, args) / logits_bytes for v in VARIANTS}
    res.extra.update(logits_bytes=logits_bytes, peak_x_logits=peak,
                     loss_alone_s={v: alone.median(v) for v in VARIANTS})  # fmt: skip
    report(res, peak, logits_bytes)
    finish(res, args)


def report(res: Result, peak: dict, logits_bytes: int) -> None:
    alone = res.extra["loss_alone_s"]
    rows = [[v, res.cell(v, "seconds", ".3f"), f"{res.median(v, 'cpu_s'):.3f}",
             f"{alone[v] * 1e3:.3f}", f"{peak[v] * logits_bytes / 1e9:.2f}", f"{peak[v]:.2f}"]
            for v in VARIANTS]  # fmt: skip
    heads = ["variant", "wall s (min-max)", "cpu s", "loss alone ms", "peak extra GB", "x logits"]
    print(markdown_table(heads, rows))
    print(
        "(wall and cpu: medians of the full step; peak extra includes the logits gradient, "
        "1.00x logits, which backward must produce)"
    )

    def adds(kind: str, clock: str) -> float:
        return 100 * (res.ratio(kind, "logprobs", clock) - 1)

    base = res.median("logprobs", "seconds")
    print(f"peak extra memory: log-probs {peak['logprobs']:.2f}x logits, "
          f"+GSPO {peak['gspo']:.2f}x, +GRPO {peak['grpo']:.2f}x")  # fmt: skip
    print(
        f"GSPO adds {adds('gspo', 'cpu_s'):+.1f}% time, GRPO adds {adds('grpo', 'cpu_s'):+.1f}% "
        f"(median process cpu; wall {adds('gspo', 'seconds'):+.1f}%, "
        f"{adds('grpo', 'seconds'):+.1f}%; the loss alone {100 * alone['gspo'] / base:.3f}%, "
        f"{100 * alone['grpo'] / base:.3f}%)"
    )


if __name__ == "__main__":
    main()
