"""The training phase with packed token-budget microbatches against padded ones, side by side.

The model and the update are the TRL comparison's `small` cycle (bench_rl_step.py: Qwen3-MoE
~90M params, 32 experts top-2, fp32; GSPO, clip 3e-4/4e-4; 64 samples = 8 prompts x 8, old
log-probs then 4 minibatch updates of 16, `train.micro_batch_size` 16). One training phase is
what the RL loop runs (`train_on`): old log-probs, then the 4 updates. Padded: 16 rows per
microbatch, padded to the step's longest sequence. Packed: whole sequences in microbatches of at
most `16 x (prompt + max answer)` tokens, the same budget a padded microbatch has.

Two length draws of the answers (prompts: 24 tokens; answers at most 128 new tokens):
  - cycle:     the small cycle's own: nearly every answer at the limit (the cycle measured 126.6
               of 128 tokens on average; drawn here as 95% at 128, the rest uniform in 64..128)
  - long-tail: one answer in ten at the maximum, the rest at a quarter of it (32)
The four (draw, variant) pairs run side by side `--reps` times (harness.measure: the order rotates
every rep; each run a fresh actor on the same weights, which trains two phases on the batch: the
first also makes the optimizer's state, once per run; the second is what every later step of a
run costs, and is the one reported, the first's seconds beside it); the median training-phase
seconds are reported as tokens/s (the batch's real tokens, prompt + answer, trained per second),
the padding fraction of the microbatches (padding / token slots), and the training phase's model
FLOP rate (the useful tokens' FLOPs: 6 x active params per token for each update, 2 x for the
old-log-prob forward over the rows it runs on, the minibatches after the first, whose old
log-probs come from its own on-policy update; plus causal attention) against a plain fp32 torch
matmul's rate (this CPU's practical ceiling) measured in the same run, 1 s just before and 1 s
just after each phase (this machine's speed drifts by +-10% within minutes, the matmul's
with it): each sample's ratio, their median reported. The count is MFU's (the LM head at every
token), while the step forms the head's logits only at the positions with a loss (the prompts'
are never formed, in forward or in the hidden states' gradient; the weight's gradient is taken
over every row): the executed FLOPs' rate, without the head's FLOPs at those positions, is
printed beside it.
`--quick`: the tiny model (a check that it runs).

Goals (issue 43): >= 1.5x tokens/s packed on the long tail, with padding fraction <= 5%; packed
FLOP rate >= 0.7x the matmul's.

    .venv/bin/python bench/bench_pack.py [--reps 3] [--threads 1] [--json OUT] [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

PROMPT, MAX_NEW, ROWS, MINIBATCHES, MBS = 24, 128, 64, 4, 16
KINDS = ("cycle", "long-tail")


def draw(kind: str, seed: int = 0) -> list[int]:
    """Answer lengths of the 64 samples."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(ROWS, generator=g)
    if kind == "cycle":
        short = torch.randint(64, MAX_NEW + 1, (ROWS,), generator=g)
        return [MAX_NEW if u[i] < 0.95 else int(short[i]) for i in range(ROWS)]
    return [MAX_NEW if i % 10 == 0 else MAX_NEW // 4 for i in range(ROWS)]


def make_batch(answers: list[int], vocab: int):
    from megatron_gspo.train.batch import StepBatch

    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(1, vocab, (PROMPT + n,), generator=g).tolist() for n in answers]
    mask = [[0] * PROMPT + [1] * n for n in answers]
    adv = torch.randn(ROWS, generator=g).tolist()
    roll = [[None] * PROMPT + [-2.0] * n for n in answers]
    return StepBatch.from_rows(tokens, mask, adv, rollout_logprobs=roll)


def config(budget: int | None):
    from bench_rl_step import CLIP_HIGH, CLIP_LOW, LR

    from megatron_gspo.config import load_config

    return load_config(ROOT / "configs" / "tiny_moe_gspo.yaml", [
        "algo.loss=gspo", f"algo.clip_low={CLIP_LOW}", f"algo.clip_high={CLIP_HIGH}",
        f"algo.minibatches={MINIBATCHES}", "algo.routing_replay=none", f"optim.lr={LR}",
        f"train.micro_batch_size={MBS}", f"train.pack={budget is not None}",
        f"train.max_tokens_per_microbatch={budget or 1}",
    ])  # fmt: skip


def phase(model: Path, batch, budget: int | None, ref_s: float) -> dict[str, float]:
    """Two training phases on one fresh actor (made untimed): the first, which also makes the
    optimizer's state (its Adam moments: zero-filled, first touched here), and the second,
    as every later step of a run. Their seconds (`first_s`, `seconds`), padding fraction, and
    the matmul's rate next to each (`first_matmul`, `matmul`: the mean of the rates measured
    just before and just after it, `ref_s` seconds each: this machine's speed drifts by +-10%
    within minutes)."""
    from megatron_gspo.model.builder import BuildOptions
    from megatron_gspo.model.parallel import ParallelDims
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.train.actor import Actor, OptimConfig
    from megatron_gspo.train.loop import train_on

    cfg = config(budget)
    actor = Actor(load_policy(model, ParallelDims(), BuildOptions()), OptimConfig(lr=cfg.optim.lr),
                  max_tokens_per_microbatch=budget)  # fmt: skip
    seconds, rates = [], [matmul_rate(ref_s)]
    for _ in range(2):
        fresh = batch.without("old_logprobs")
        t0 = time.perf_counter()
        metrics, updates = train_on(actor, fresh, cfg, 1, len(fresh))
        seconds.append(time.perf_counter() - t0)
        rates.append(matmul_rate(ref_s))
        assert all(u.finite for u in updates)
    return {"seconds": seconds[1], "first_s": seconds[0],
            "matmul": (rates[1] + rates[2]) / 2, "first_matmul": (rates[0] + rates[1]) / 2,
            "padding": metrics["train/padding_fraction"]}  # fmt: skip


def active_params(spec) -> int:
    """Parameters one token passes through (attention, router, top-k experts, LM head)."""
    h, d = spec.hidden, spec.head_dim
    attn = h * d * (2 * spec.heads + 2 * spec.kv_heads)
    mlp = 3 * h * spec.moe_ffn * spec.topk + h * spec.experts
    return spec.layers * (attn + mlp) + h * spec.vocab_size


def model_flops(spec, lengths: list[int], old_lp_rows: list[int]) -> float:
    """The phase's useful FLOPs: 4 updates (forward + backward, 6 per active param and token)
    over the batch once and the old-log-prob forward (2) over `old_lp_rows`; causal attention
    2 x 2 x (heads x head_dim) per key a query sees, times 3 for forward + backward."""

    def flops(rows: list[int], per_token: int, attn_passes: int) -> float:
        dense = per_token * active_params(spec) * sum(lengths[i] for i in rows)
        keys = sum(lengths[i] * (lengths[i] + 1) / 2 for i in rows)
        return dense + 4 * spec.heads * spec.head_dim * keys * spec.layers * attn_passes

    return flops(list(range(len(lengths))), 6, 3) + flops(old_lp_rows, 2, 1)


def head_flops_skipped(spec, lengths: list[int], old_lp_rows: list[int]) -> float:
    """The head's FLOPs of `model_flops` the step does not execute: at the positions without a
    loss (each sequence's prompt tokens but the last, and its last token: `PROMPT` per
    sequence), the forward and the hidden states' gradient of each update (4 per weight and
    position) and the old-log-prob forward (2)."""
    per_position = spec.hidden * spec.vocab_size
    return per_position * PROMPT * (4 * len(lengths) + 2 * len(old_lp_rows))


def old_logprob_rows() -> list[int]:
    """The rows the phase's old-log-prob forward runs on (loop.train_on at step 1): every
    minibatch's but the first, which trains on policy."""
    from megatron_gspo.train.shard import minibatch_parts

    cfg = config(None)
    assert cfg.algo.on_policy_first_update
    return [i for p in minibatch_parts(ROWS, MINIBATCHES, cfg.seed, 1)[1:] for i in p]


def matmul_rate(seconds: float = 2.0) -> float:
    """FLOP/s of a plain fp32 torch matmul of this model's shapes (tokens x hidden x ffn)."""
    a, b = torch.randn(2048, 512), torch.randn(512, 1024)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n * 2 * 2048 * 512 * 1024 / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    from harness import parser

    p = parser(__doc__, reps=3, warmup=None, quick="the tiny model (a check that it runs)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from bench_rl_step import SIZES

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
    from megatron_gspo.model.parallel import ParallelDims, init_distributed

    size = "tiny" if a.quick else "small"
    spec = TinySpec(**SIZES[size].spec)
    init_distributed(ParallelDims())
    with tempfile.TemporaryDirectory(prefix="bench-pack-") as tmp:  # the model: 355 MB
        return run(make_tiny_model(spec, Path(tmp) / size), spec, size, a)


def run(model: Path, spec, size: str, a) -> dict:
    """Both length draws' four variants side by side; their tables and the goals' line."""
    from harness import Variant, finish, measure

    budget = MBS * (PROMPT + MAX_NEW)
    ref_s = 0.1 if a.quick else 1.0  # seconds of matmul before and after each phase
    print(f"{size} model: {active_params(spec) / 1e6:.1f}M active params per token; 64 samples, "
          f"prompts {PROMPT}, answers <= {MAX_NEW}; packed budget {budget} tokens; "
          f"{a.threads} thread(s)")  # fmt: skip
    batches = {k: make_batch(draw(k), spec.vocab_size) for k in KINDS}
    variants = [Variant(f"{k}/{name}", lambda k=k, b=b: phase(model, batches[k], b, ref_s))
                for k in KINDS for name, b in (("padded", None), ("packed", budget))]  # fmt: skip
    res = measure(variants, a.reps, name="pack")
    for k in KINDS:
        report(res, k, spec, batches[k])
    tail = res.extra["long-tail"]
    print(f"\ngoals: long tail >= 1.5x: {tail['speedup']:.2f}x; padding <= 5%: "
          f"{res.median('long-tail/packed', 'padding'):.1%}; packed FLOP rate >= 0.7x matmul: "
          f"{tail['packed_vs_matmul']:.3f}x (a fresh actor's first phase: "
          f"{tail['packed_first_vs_matmul']:.3f}x; executed FLOPs: "
          f"{tail['packed_executed_vs_matmul']:.3f}x)")  # fmt: skip
    return finish(res, a)


def vs_matmul(res, variant: str, flops: float, first: bool = False) -> list[float]:
    """Per sample, the phase's model FLOP rate over the matmul's measured next to it."""
    secs, rates = ("first_s", "first_matmul") if first else ("seconds", "matmul")
    return [flops / s / r for s, r in zip(res.values(variant, secs), res.values(variant, rates))]


def report(res, kind: str, spec, batch) -> None:
    """One draw's table: tokens/s, padding and FLOP rate of the median phase of each variant;
    the FLOP rate over the matmul's is the median of the samples' own ratios."""
    from harness import markdown_table, median

    lengths = batch.lengths.tolist()
    old_lp_rows = old_logprob_rows()
    tokens, flops = sum(lengths), model_flops(spec, lengths, old_lp_rows)
    executed = flops - head_flops_skipped(spec, lengths, old_lp_rows)
    answers = [n - PROMPT for n in lengths]
    print(f"\n{kind}: answers mean {sum(answers) / len(answers):.1f} tokens, {tokens} tokens in "
          "the batch")  # fmt: skip
    rows, ratio = [], {}
    for name in ("padded", "packed"):
        v = f"{kind}/{name}"
        s, first = res.median(v), res.median(v, "first_s")
        ratio[name] = median(vs_matmul(res, v, flops))
        ratio[f"{name}_first"] = median(vs_matmul(res, v, flops, first=True))
        ratio[f"{name}_executed"] = median(vs_matmul(res, v, executed))
        rows.append([name, f"{s:.2f}", f"{tokens / s:.0f}", f"{res.median(v, 'padding'):.3f}",
                     f"{flops / s / 1e9:.2f}", f"{res.median(v, 'matmul') / 1e9:.1f}",
                     f"{ratio[name]:.2f}x", f"{first:.2f}", f"{ratio[name + '_first']:.2f}x"])  # fmt: skip
    print(markdown_table(["variant", "phase s (median)", "tokens/s", "padding fraction",
                          "model GFLOP/s", "matmul GFLOP/s", "/ matmul", "first phase s",
                          "first / matmul"], rows))  # fmt: skip
    speedup = res.ratio(f"{kind}/padded", f"{kind}/packed")  # tokens/s packed / padded
    res.extra[kind] = {"speedup": speedup, "tokens": tokens, "flops": flops,
                       "packed_vs_matmul": ratio["packed"],
                       "packed_first_vs_matmul": ratio["packed_first"],
                       "padded_vs_matmul": ratio["padded"], "executed_flops": executed,
                       "packed_executed_vs_matmul": ratio["packed_executed"]}  # fmt: skip
    print(f"packed / padded tokens/s: {speedup:.2f}x; the FLOPs executed (the LM head at the "
          f"positions with a loss only: {executed / flops:.1%} of the count) at "
          f"{ratio['padded_executed']:.3f}x / {ratio['packed_executed']:.3f}x the matmul's, "
          "padded / packed")  # fmt: skip


if __name__ == "__main__":
    main()
