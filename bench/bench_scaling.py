"""How the RL step's cost grows: step time and tokens/s of `megatron-gspo train` at 1, 2 and 4
ranks (gloo, torchrun) and at two model sizes.

Every run is the real loop on the same task as bench_rl_step.py (GSPO, 8 prompts x 8 completions,
4 minibatch updates per rollout batch, the built-in rollout server, weight sync every step), one
torch thread per rank. Ranks are data parallel (`--layout dp`) or expert parallel (`--layout ep`:
EP = ranks, the experts split across them). Sizes: `tiny` (~0.1M params, 16-token completions)
and `medium` (~7M params, 16 experts top-2, 32-token completions). The first `--warmup` steps of a
run are dropped; medians of the rest. With `--rounds` > 1 the whole grid is repeated, so the
configurations interleave. On a 2-core machine 4 ranks oversubscribe the cores: the table shows
that cost too.

Printed last: the tokens/s ratio of 2 and 4 ranks to 1 rank at each size, and the step-time ratio
medium / tiny at 1 rank next to their ratio of work (active parameters x tokens).

    .venv/bin/python bench/bench_scaling.py [--ranks 1,2,4] [--sizes tiny,medium] [--layout dp]
                                            [--steps 5] [--warmup 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_rl_step import GROUP, PROMPTS, Cycle, Size, make_inputs, run_ours

SIZES = {
    "tiny": Size({"seed": 0}, 16),
    "medium": Size(
        {"vocab_size": 1024, "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2,
         "head_dim": 64, "ffn": 512, "moe_ffn": 128, "experts": 16, "topk": 2, "seed": 0},
        32,
    ),
}  # fmt: skip


def active_params(spec: dict) -> float:
    """Parameters one token goes through (attention, top-k experts, embeddings, output)."""
    from megatron_gspo.hf.tiny import TinySpec

    s = TinySpec(**spec)
    attn = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)
    experts = s.topk * 3 * s.hidden * s.moe_ffn
    return s.layers * (attn + experts) + 2 * s.vocab_size * s.hidden


def median(cycles: list[Cycle], field: str) -> float:
    return statistics.median(getattr(c, field) for c in cycles)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--sizes", default="tiny,medium")
    p.add_argument("--layout", default="dp", choices=["dp", "ep"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if any(s not in SIZES for s in sizes) or args.steps <= args.warmup or 1 not in ranks:
        sys.exit(f"error: --sizes from {', '.join(SIZES)}, --ranks including 1, --steps > --warmup")
    kept: dict[tuple[str, int], list[Cycle]] = {(s, n): [] for s in sizes for n in ranks}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        work = Path(tmp)
        inputs = {s: make_inputs(s, SIZES[s], work) for s in sizes}
        for s in sizes:
            print(f"{s}: {inputs[s][2]:.2f}M params, {active_params(SIZES[s].spec) / 1e6:.2f}M "
                  f"active per token, <= {SIZES[s].new_tokens} new tokens", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            for s in sizes:
                for n in ranks:
                    got = _run(inputs[s], SIZES[s], n, args, work)
                    kept[s, n] += got[args.warmup :]
                    print(f"  round {rnd + 1} {s} x {n} rank(s): "
                          f"{median(got[args.warmup:], 'step_s'):.3f} s/step", flush=True)  # fmt: skip
    _table(kept, args.layout)
    _ratios(kept, sizes, ranks)


def _run(inputs, size: Size, n: int, args, work: Path) -> list[Cycle]:
    model, data, _ = inputs
    layout = [f"parallel.ep={n}"] if args.layout == "ep" else []
    micro = PROMPTS * GROUP // 4 // n  # each data-parallel rank's share of a minibatch
    extra = (*layout, f"train.micro_batch_size={max(micro, 1)}")
    return run_ours(model, data, size, args.steps, 1, work, nproc=n, extra=extra)


def _table(kept, layout: str) -> None:
    print(f"\n{'size':8s} {'ranks':>5s} {'layout':>6s} {'step s':>8s} {'rollout s':>10s} "
          f"{'train s':>8s} {'sync s':>8s} {'tokens/s':>9s}")  # fmt: skip
    for (s, n), cycles in kept.items():
        cells = [median(cycles, f) for f in ("step_s", "rollout_s", "train_s", "sync_s")]
        print(f"{s:8s} {n:5d} {layout if n > 1 else '-':>6s} {cells[0]:8.3f} {cells[1]:10.3f} "
              f"{cells[2]:8.3f} {cells[3]:8.3f} {median(cycles, 'tokens_per_s'):9.0f}")  # fmt: skip


def _ratios(kept, sizes: list[str], ranks: list[int]) -> None:
    parts = []
    for s in sizes:
        base = median(kept[s, 1], "tokens_per_s")
        parts += [f"{s} {n} ranks {median(kept[s, n], 'tokens_per_s') / base:.2f}x"
                  for n in ranks if n != 1]  # fmt: skip
    line = "ratio tokens/s vs 1 rank: " + ", ".join(parts)
    if "tiny" in sizes and "medium" in sizes:
        t = median(kept["medium", 1], "step_s") / median(kept["tiny", 1], "step_s")
        work = (active_params(SIZES["medium"].spec) * SIZES["medium"].new_tokens) / (
            active_params(SIZES["tiny"].spec) * SIZES["tiny"].new_tokens
        )
        line += f"; step time medium / tiny at 1 rank {t:.2f}x for {work:.0f}x the work"
    print(line)


if __name__ == "__main__":
    main()
