"""How the RL step's cost grows: step time and tokens/s of `megatron-gspo train` at 1, 2 and 4
ranks (gloo, torchrun) and at two model sizes.

Every run is the real loop on the same task as bench_rl_step.py (GSPO, 8 prompts x 8 completions,
4 minibatch updates per rollout batch, the built-in rollout server, weight sync every step), one
torch thread per rank. Ranks are data parallel (`--layout dp`) or expert parallel (`--layout ep`:
EP = ranks, the experts split across them). Sizes: `tiny` (~0.1M params, 16-token completions)
and `medium` (~7M params, 16 experts top-2, 32-token completions). The first `--warmup` steps of a
run are dropped; medians of the rest (pooled over the runs of a configuration). The grid's
configurations run side by side (harness.measure: with `--rounds` > 1 the grid is repeated, the
order rotating each round). On a 2-core machine 4 ranks oversubscribe the cores: the table shows
that cost too.

Printed last: the tokens/s ratio of 2 and 4 ranks to 1 rank at each size, and the step-time ratio
medium / tiny at 1 rank next to their ratio of work (active parameters x tokens).

    .venv/bin/python bench/bench_scaling.py [--ranks 1,2,4] [--sizes tiny,medium] [--layout dp]
                                            [--steps 5] [--warmup 2] [--rounds 1] [--json OUT]
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench_rl_step import GROUP, PROMPTS, Size, make_inputs, run_ours
from harness import Result, Variant, finish, markdown_table, measure, median, parser

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


def main() -> None:
    p = parser(__doc__, reps=1, warmup=None, reps_flags=("--rounds", "--reps"))
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--sizes", default="tiny,medium")
    p.add_argument("--layout", default="dp", choices=["dp", "ep"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of a run")
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if any(s not in SIZES for s in sizes) or args.steps <= args.warmup or 1 not in ranks:
        sys.exit(f"error: --sizes from {', '.join(SIZES)}, --ranks including 1, --steps > --warmup")
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        work = Path(tmp)
        inputs = {s: make_inputs(s, SIZES[s], work) for s in sizes}
        for s in sizes:
            print(f"{s}: {inputs[s][2]:.2f}M params, {active_params(SIZES[s].spec) / 1e6:.2f}M "
                  f"active per token, <= {SIZES[s].new_tokens} new tokens", flush=True)  # fmt: skip
        grid = [Variant(f"{s} x{n}", lambda s=s, n=n: _run(inputs[s], SIZES[s], n, args, work))
                for s in sizes for n in ranks]  # fmt: skip
        res = measure(grid, args.reps, name="scaling", on_sample=_show)
    _table(res, args.layout)
    _ratios(res, sizes, ranks)
    finish(res, args)


def _show(name: str, rnd: int, got: list[dict]) -> None:
    step = median(c["step_s"] for c in got)
    print(f"  round {rnd + 1} {name} rank(s): {step:.3f} s/step", flush=True)


def _run(inputs, size: Size, n: int, args, work: Path) -> list[dict]:
    """One run's steps after the first `--warmup`, each a sample."""
    model, data, _ = inputs
    layout = [f"parallel.ep={n}"] if args.layout == "ep" else []
    micro = PROMPTS * GROUP // 4 // n  # each data-parallel rank's share of a minibatch
    extra = (*layout, f"train.micro_batch_size={max(micro, 1)}")
    got = run_ours(model, data, size, args.steps, 1, work, nproc=n, extra=extra)
    return [asdict(c) for c in got[args.warmup :]]


def _table(res: Result, layout: str) -> None:
    rows = []
    for name in res.variants:
        s, n = name.split(" x")
        cells = [f"{res.median(name, f):.3f}" for f in ("step_s", "rollout_s", "train_s", "sync_s")]
        rows.append([s, n, layout if n != "1" else "-", *cells,
                     f"{res.median(name, 'tokens_per_s'):.0f}"])  # fmt: skip
    heads = ["size", "ranks", "layout", "step s", "rollout s", "train s", "sync s", "tokens/s"]
    print("\n" + markdown_table(heads, rows))


def _ratios(res: Result, sizes: list[str], ranks: list[int]) -> None:
    parts = []
    for s in sizes:
        parts += [f"{s} {n} ranks {res.ratio(f'{s} x{n}', f'{s} x1', 'tokens_per_s'):.2f}x"
                  for n in ranks if n != 1]  # fmt: skip
    line = "ratio tokens/s vs 1 rank: " + ", ".join(parts)
    if "tiny" in sizes and "medium" in sizes:
        t = res.ratio("medium x1", "tiny x1", "step_s")
        work = (active_params(SIZES["medium"].spec) * SIZES["medium"].new_tokens) / (
            active_params(SIZES["tiny"].spec) * SIZES["tiny"].new_tokens
        )
        line += f"; step time medium / tiny at 1 rank {t:.2f}x for {work:.0f}x the work"
    print(line)


if __name__ == "__main__":
    main()
