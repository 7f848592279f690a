"""Moving one RL step's batch to the ranks: today's whole-batch broadcast against the sharded
batch (train/shard.py), per parallel layout, on 4 gloo ranks.

The batch has the shapes of `configs/qwen3_30b_a3b_gspo.yaml`'s step scaled to this machine:
64 prompts x 8 samples, prompt + response averaging 8k tokens cut by `--scale` (default 1/64:
about 65k tokens), and the model's real routing: 48 MoE layers x top-8 of 128 experts, as SGLang
sends it (int32, every layer). Rank 0 makes it; then, side by side in one run (harness.measure;
each method and layout in a fresh launch, so that peak memory is its own):
  - broadcast: `broadcast_object_list` of the whole batch, as the loop did before the shards
  - sharded:   `shard.distribute`: each rank gets its replica's rows and its stage's layers
Per layout it prints, for the receiving ranks (1-3): bytes received, against what the layout
needs (its rows' token ids, loss mask and rollout log-probs, and its stage's routing ids at one
byte each: bytes_needed) and against the broadcast; the receivers' peak RSS growth; and the time
from rank 0 holding the batch to every rank holding its part. Layouts: DP4 (a quarter of the rows,
every layer), PP2xDP2 (half the rows, half the layers), PP4 (every row, a quarter of the layers).

Goal (issue 27): bytes within 1.1x of the need; at least 4x fewer than the broadcast in PP4 and
DP4.

    .venv/bin/python bench/bench_batch.py [--scale 64 --layouts DP4,PP2xDP2,PP4 --json out.json]
                                          [--reps 1]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # (harness, when this file is imported by path)
    sys.path.insert(0, str(ROOT / "bench"))
LAYERS, TOPK, EXPERTS = 48, 8, 128
PROMPTS, GROUP, TOKENS = 64, 8, 8192
LAYOUTS = {"DP4": (4, 1), "PP2xDP2": (2, 2), "PP4": (1, 4)}  # name: (dp, pp)
WORLD = 4


def make_batch(scale: int, seed: int = 0):
    import numpy as np

    from megatron_gspo.train.batch import StepBatch

    rng = np.random.default_rng(seed)
    n = PROMPTS * GROUP
    mean = TOKENS // scale
    tokens, masks, lps, experts, adv = [], [], [], [], []
    for _ in range(n):
        length = int(rng.integers(mean // 2, mean * 3 // 2 + 1))
        prompt = max(1, length // 8)
        tokens.append(rng.integers(0, 151_000, length).tolist())
        masks.append([0] * prompt + [1] * (length - prompt))
        lps.append([None] * prompt + (-rng.random(length - prompt)).tolist())
        experts.append(rng.integers(0, EXPERTS, (length - 1, LAYERS, TOPK), dtype=np.int32))
        adv.append(float(rng.standard_normal()))
    return StepBatch.from_rows(tokens, masks, adv, rollout_logprobs=lps, rollout_experts=experts)


def table(dp: int, pp: int):
    """Each rank's needs in megatron's rank order (tp-cp-ep-dp-pp: rank = dp_rank + dp * stage)."""
    from megatron_gspo.train.shard import RankNeeds

    per_stage = LAYERS // pp
    ids = tuple(range(LAYERS))
    return [
        RankNeeds(r % dp, dp, ids[(r // dp) * per_stage : (r // dp + 1) * per_stage], LAYERS, ids,
                  EXPERTS)
        for r in range(WORLD)
    ]  # fmt: skip


def needed_bytes(batch, rows: list[int], layers: int) -> int:
    """What a rank must receive: its rows' token ids (4 B), loss mask (1 B) and rollout log-probs
    (4 B) per token, one advantage per row, and its layers' routing ids at one byte each."""
    tokens = int(batch.lengths[rows].sum())
    routing = (tokens - len(rows)) * layers * TOPK
    return tokens * 9 + 4 * len(rows) + routing


# ---- one launch: one method, one layout ----------------------------------------------------


def worker(method: str, layout: str, scale: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_gspo.train.shard import distribute, minibatch_parts, owners

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp, pp = LAYOUTS[layout]
    needs = table(dp, pp)
    batch = make_batch(scale) if rank == 0 else None
    n = PROMPTS * GROUP
    parts = minibatch_parts(n, 4, seed=0, step=1)
    dist.barrier()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    stats: dict = {}
    if method == "broadcast":
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
        import pickle

        stats["bytes"] = 0 if rank == 0 else len(pickle.dumps(got, protocol=5))
    else:
        got = distribute(batch, parts, needs, stats=stats)
    dist.barrier()
    seconds = time.perf_counter() - t0
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    own = owners(parts, n, dp)
    mine = [i for i in range(n) if own[i] == needs[rank].dp_rank]
    whole = got if method == "broadcast" else None
    need = needed_bytes(whole or _LengthsOnly(got, n), mine, len(needs[rank].layers))
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, {"rank": rank, "bytes": stats["bytes"], "need": need,
                                  "rss": rss, "seconds": seconds})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


class _LengthsOnly:
    """A shard's lengths placed at their rows of the whole batch (for bytes_needed)."""

    def __init__(self, shard, n):
        self.lengths = torch.zeros(n, dtype=torch.int64)
        self.lengths[shard.index] = shard.lengths


def launch(method: str, layout: str, scale: int, tmp: Path) -> list[dict]:
    out = tmp / f"{method}-{layout}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD), __file__, "--worker", method, layout, str(scale),
           str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    from harness import Variant, finish, measure, parser  # (bench/ is on the path)

    ap = parser(__doc__, reps=1, warmup=None)
    ap.add_argument("--scale", type=int, default=64, help="tokens per sample: 8192 / scale")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    a = ap.parse_args(argv)
    layouts = a.layouts.split(",")
    with tempfile.TemporaryDirectory() as tmp:  # a sample per rank and launch
        runs = [Variant(f"{layout} {m}", lambda m=m, lay=layout: launch(m, lay, a.scale, Path(tmp)))
                for layout in layouts for m in ("broadcast", "sharded")]  # fmt: skip
        res = measure(runs, a.reps, name="batch")
    tokens = PROMPTS * GROUP * (TOKENS // a.scale)
    print(f"batch: {PROMPTS}x{GROUP} samples, ~{tokens} tokens, routing {LAYERS} layers x top-"
          f"{TOPK} of {EXPERTS} (int32 from the server); 4 gloo ranks; receivers are ranks 1-3")  # fmt: skip
    res.extra["summary"] = {layout: summary(res, layout) for layout in layouts}
    print(report_table(res, layouts))
    return finish(res, a)


def summary(res, layout: str) -> dict:
    """Receivers (ranks 1-3) of each launch: the worst bytes / need, the fewest broadcast bytes
    / sharded bytes of one rank, the largest RSS growth; rank 0's seconds (medians over reps)."""
    sh, bc = (
        [r for r in res.samples[f"{layout} {m}"] if r["rank"] > 0] for m in ("sharded", "broadcast")
    )
    worst = max(sh, key=lambda r: r["bytes"] / r["need"])
    return {"recv_over_need": worst["bytes"] / worst["need"], "recv_mb": worst["bytes"] / 1e6,
            "need_mb": worst["need"] / 1e6, "broadcast_mb": max(r["bytes"] for r in bc) / 1e6,
            "broadcast_over_recv": min(b["bytes"] / s["bytes"] for b, s in zip(bc, sh)),
            "rss_mb": [max(r["rss"] for r in rows) / 1e6 for rows in (sh, bc)],
            "seconds": [_rank0_seconds(res, f"{layout} {m}") for m in ("sharded", "broadcast")]}  # fmt: skip


def _rank0_seconds(res, variant: str) -> float:
    from harness import median

    return median(r["seconds"] for r in res.samples[variant] if r["rank"] == 0)


def report_table(res, layouts: list[str]) -> str:
    from harness import markdown_table

    head = ("layout", "MB recv (max rank)", "need MB", "recv/need", "broadcast MB",
            "broadcast/recv", "RSS MB sharded/broadcast", "time s sharded/broadcast")  # fmt: skip
    rows = []
    for layout in layouts:
        s = res.extra["summary"][layout]
        rows.append([layout, f"{s['recv_mb']:.1f}", f"{s['need_mb']:.1f}",
                     f"{s['recv_over_need']:.3f}", f"{s['broadcast_mb']:.1f}",
                     f"{s['broadcast_over_recv']:.1f}x",
                     f"{s['rss_mb'][0]:.0f} / {s['rss_mb'][1]:.0f}",
                     f"{s['seconds'][0]:.2f} / {s['seconds'][1]:.2f}"])  # fmt: skip
    return markdown_table(head, rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4], int(sys.argv[4]), sys.argv[5])
    else:
        main()
