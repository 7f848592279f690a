"""Cost of routing replay: train-step time with and without R2 / R3, and the bytes it stores.

One actor (gloo, TP1) and one batch; the variant is switched on that actor between runs, so
every variant runs on the very same parameters, optimizer and memory (separate actors differ by a
few percent on their own, which is larger than the effect measured):
  - plain: no routing code at all (no routing object, no RouterReplay on the routers)
  - none:  natural routing; old log-probs record it and the step measures routing drift
  - r2:    the step replays the routing recorded with the old log-probs
  - r3:    the step replays rollout routing: the SGLang-format int32 payload [n - 1, layers, k]
           (dense layers zero) made from the natural routing with 10% of the (token, MoE layer)
           positions moved to other experts, as a different engine would route them
Each rep runs every variant once, in a rotating order (harness.measure, after a warm-up call each):
`logprobs` (recording) and `train_step` (replaying), timed as process CPU time and wall time, torch
on one thread (`--threads 1`) so that idle OpenMP workers spinning on a busy machine do not count as
work (lr 1e-7: the weights barely move). The overhead is measured two ways:
  - in-line: the routing code's own CPU time, timed at its entry points (ROUTING_ENTRIES: the
    calls the actor and megatron-core make into it) less the core's top-k inside them, over the
    rest of that rep's logprobs + train_step; mean over reps with a 95% bootstrap interval. Both
    parts come from the same run, so the machine's speed cancels out. A cProfile run checks that
    no routing function is called from outside those entry points (else a WARNING names it), and
    gives its own share beside it (an upper bound: profiling slows Python more than torch).
  - side by side: the median over reps of the per-rep ratio of the variant's CPU time to
    plain's, with a 95% bootstrap interval, and the ratio of the fastest reps. On a shared 2-core
    machine a rep's CPU time moves by about +-10% on its own, so this interval stays several
    percent wide even at 100 reps; it is the cross-check that nothing outside the routing code
    got slower.
The goal is shown when the in-line interval is under 3% and the side-by-side interval does not
lie above 3%.
Storage: the bytes the batch's routing holds on host memory per token (all stages) against the
int32 payload SGLang sends per token (every decoder layer x k x 4).

Goal (issue 6): under 3% step overhead; 4x smaller storage than the int32 payload.

    .venv/bin/python bench/bench_routing_replay.py [--hidden 256 --layers 4 --experts 64
        --topk 8 --batch 8 --seq 256 --reps 24 --json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import (  # (bench/ on the path)
    Result,
    Variant,
    bootstrap_ci,
    finish,
    markdown_table,
    measure,
    parser,
)

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import load_policy
from megatron_gspo.train.actor import Actor, AlgoConfig, OptimConfig
from megatron_gspo.train.batch import StepBatch

VARIANTS = ("plain", "none", "r2", "r3")
LOSS = AlgoConfig(loss="grpo", clip_low=0.2, clip_high=0.28)


def make_batch(n: int, seq: int, vocab: int, seed: int = 0) -> StepBatch:
    """n samples of lengths between seq/2 and seq, prompts of 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g).tolist()
    tokens = [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]
    masks = [[0] * 16 + [1] * (t - 16) for t in lengths]
    return StepBatch.from_rows(tokens, masks, torch.randn(n, generator=g).tolist())


def rollout_payload(recorded, spec, moved: float, seed: int = 0) -> list[np.ndarray]:
    """SGLang-format int32 [n - 1, layers, k] from recorded routing, `moved` of it re-routed."""
    rng = np.random.default_rng(seed)
    out = []
    for r in recorded:
        n = r.shape[0]
        every = np.zeros((n - 1, spec.num_layers, spec.topk), np.int32)
        every[:, spec.moe_layer_ids] = r[: n - 1]
        for t, layer in zip(*np.nonzero(rng.random((n - 1, spec.num_layers)) < moved)):
            if spec.moe_layers[layer]:
                every[t, layer] = rng.choice(spec.num_experts, spec.topk, replace=False)
        out.append(every)
    return out


class Variants:
    """Switches one actor between the variants: each has its own routing object (whose taps are
    bound to the routers while it is in use); plain has none, and no RouterReplay either."""

    def __init__(self, actor):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_gspo.routing.replay import RoutingReplay

        self.actor = actor
        self.routers = [m for c in actor.chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.routing = {v: RoutingReplay(actor.chunks, v) for v in VARIANTS[1:]}

    def use(self, variant: str) -> None:
        routing = self.routing.get(variant)
        self.actor.routing = routing
        if routing is None:
            for router in self.routers:
                router.router_replay = None
            return
        for router, tap in zip(self.routers, routing.all_taps(), strict=True):
            router.router_replay = tap.replay
            tap.replay.get_replay_topk = tap._get_replay_topk
            tap.replay._tap = tap


def record(actor, batch, mbs: int, out: dict | None = None) -> None:
    old, metrics = actor.logprobs(batch, mbs)
    batch.set("old_logprobs", old)
    if out is not None:
        out.update(metrics)


ROUTING_ENTRIES = {  # (file suffix, function): the routing code's entry points in a step
    ("routing/replay.py", "record_sweep"), ("routing/replay.py", "train_sweep"),
    ("routing/replay.py", "finish_record"), ("routing/replay.py", "finish_train"),
    ("routing/sweep.py", "enter"), ("routing/sweep.py", "leave"),
    ("routing/sweep.py", "_to_recompute"), ("routing/taps.py", "_get_replay_topk"),
}  # fmt: skip


class RoutingClock:
    """CPU time spent in the routing code, timed in-line: each entry point of ROUTING_ENTRIES is
    wrapped (outermost calls only, so nested entries count once), less the time of the core's
    own `get_replay_topk` called from inside them (every routing mode runs the core's top-k;
    plain runs it without us). In replay modes the extra natural top-k for the drift metrics
    stays counted, so this is an upper bound of the added work. Install before any tap exists."""

    def __init__(self):
        from megatron_gspo.routing import replay, sweep, taps

        self.ours = self.core = 0.0
        self.depth = 0
        owners = {"routing/replay.py": replay.RoutingReplay, "routing/sweep.py": sweep.Sweep,
                  "routing/taps.py": taps.RouterTap}  # fmt: skip
        for path, name in ROUTING_ENTRIES:
            owner = owners[path]
            if not hasattr(owner, name):  # a module function (sweep._to_recompute)
                owner = sweep
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def reset(self) -> float:
        """The routing time since the last reset (ours less the core's)."""
        spent, self.ours, self.core = self.ours - self.core, 0.0, 0.0
        return spent

    def _wrap(self, fn):
        clock = self

        def timed_entry(*args, **kwargs):
            if clock.depth:
                return fn(*args, **kwargs)
            clock.depth += 1
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.ours += time.process_time() - start
                clock.depth -= 1

        return timed_entry

    def time_core(self, tap) -> None:
        """Time this tap's call into the core's `get_replay_topk` as the core's."""
        core = tap._default
        if getattr(core, "_timed", False):
            return
        clock = self

        def timed_core(*args, **kwargs):
            start = time.process_time()
            try:
                return core(*args, **kwargs)
            finally:
                clock.core += time.process_time() - start

        timed_core._timed = True
        tap._default = timed_core


def routing_share(actor, batch, mbs: int) -> tuple[float, list[str]]:
    """Share of one logprobs + train_step spent in the routing code, from a cProfile run: the
    cumulative time of its entry points, less the core's own top-k inside the router wrapper
    (which every routing mode runs). Profiling slows pure-Python code more than torch kernels,
    so this overstates the share somewhat. Also returns the routing functions called from
    outside the routing package that are not in ROUTING_ENTRIES (the in-line clock would miss
    their time): the check that the clock sees all of it (calls through builtins such as
    getattr cannot be traced to their caller and are not checked)."""
    prof = cProfile.Profile(time.process_time)
    start = time.process_time()
    prof.enable()
    record(actor, batch, mbs)
    actor.train_step(batch, LOSS, mbs)
    prof.disable()
    total = time.process_time() - start
    stats = pstats.Stats(prof).stats
    ours = core = 0.0
    missed = []
    for (path, _, func), (_, _, _, ct, callers) in stats.items():
        if func == "timed_entry":
            continue
        if any(path.endswith(f) and func == name for f, name in ROUTING_ENTRIES):
            ours += ct
        elif path.endswith("moe/router_replay.py") and func == "get_replay_topk":
            core += ct
        elif "megatron_gspo/routing/" in path.replace("\\", "/"):
            # Builtins (getattr, sum over a generator) appear as callers with path "~".
            outside = [c for c in callers if c[0] != "~"
                       and "megatron_gspo/routing/" not in c[0].replace("\\", "/")
                       and c[2] not in ("timed_entry", "timed_core")]  # fmt: skip
            if outside:
                missed.append(f"{Path(path).name}:{func}")
    return (ours - core) / total, missed


def timed(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def one_rep(variants, clock, actor, batch, v: str, mbs: int, metrics: dict) -> dict[str, float]:
    """One variant's logprobs + train_step: process CPU and wall seconds of each, and the routing
    code's own CPU time (the in-line clock)."""
    variants.use(v)
    clock.reset()
    metrics[v] = {}
    c, w = timed(lambda: record(actor, batch, mbs, metrics[v]))
    c2, w2 = timed(lambda: actor.train_step(batch, LOSS, mbs))
    return {"logprobs_cpu": c, "logprobs_wall": w, "step_cpu": c2, "step_wall": w2,
            "total_cpu": c + c2, "routing_s": clock.reset()}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, reps=24, warmup=1)
    ap.formatter_class = argparse.RawTextHelpFormatter
    ap.description = __doc__
    for name, default in [("hidden", 256), ("layers", 4), ("experts", 64), ("topk", 8)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in [("batch", 8), ("seq", 256), ("mbs", 4), ("threads", 1)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    spec = TinySpec(
        hidden=a.hidden, layers=a.layers, heads=8, kv_heads=4, head_dim=a.hidden // 8,
        ffn=2 * a.hidden, moe_ffn=a.hidden // 2, experts=a.experts, topk=a.topk,
        dense_layers=[0], vocab_size=1024, init_std=0.2,
    )  # fmt: skip
    clock = RoutingClock()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_model(spec, Path(tmp) / "model")
        init_distributed(ParallelDims(world_size=1))
        actor = Actor(load_policy(ckpt, ParallelDims()), OptimConfig(lr=1e-7), "none")
    variants = Variants(actor)
    for routing in variants.routing.values():
        for tap in routing.all_taps():
            clock.time_core(tap)
    model_spec = actor.spec
    base = make_batch(a.batch, a.seq, vocab=1000)
    batches = {v: base.rows(list(range(len(base)))) for v in VARIANTS}
    variants.use("none")
    record(actor, batches["none"], a.mbs)
    payload = rollout_payload([s.recorded for s in batches["none"].routing], model_spec, 0.10)
    batches["r3"].rollout_experts = payload
    metrics: dict = {}
    steps = [Variant(v, lambda v=v: one_rep(variants, clock, actor, batches[v], v, a.mbs, metrics))
             for v in VARIANTS]  # fmt: skip
    res = measure(steps, a.reps, a.warmup, name="routing_replay")
    shares, missed = {}, set()
    for v in VARIANTS[1:]:
        variants.use(v)
        shares[v], m = routing_share(actor, batches[v], a.mbs)
        missed.update(m)
    report(a, metrics, batches, res, model_spec, shares, sorted(missed))
    finish(res, a)


def paired_overhead(res: Result, variant: str, metric: str) -> tuple[float, float, float]:
    """Per-rep ratios variant / plain - 1 in percent: their median and a 95% bootstrap
    confidence interval of that median (resampling the reps, seeded)."""
    return bootstrap_ci([100 * (r - 1) for r in res.paired(variant, "plain", metric)])


def min_overhead(res: Result, variant: str, metric: str) -> float:
    """Fastest rep against fastest rep, in percent."""
    return 100 * (res.spread(variant, metric)[0] / res.spread("plain", metric)[0] - 1)


def timed_overhead(res: Result, variant: str) -> tuple[float, float, float]:
    """Per rep: the routing code's CPU time (in-line clock) over the rest of the variant's
    logprobs + train_step, in percent; their mean and a 95% bootstrap interval of the mean. Both
    parts come from the same run of the same rep, so the machine's speed cancels out."""
    rows = res.samples[variant]
    return bootstrap_ci([100 * r["routing_s"] / (r["total_cpu"] - r["routing_s"]) for r in rows],
                        stat="mean")  # fmt: skip


def fmt(q: tuple[float, float, float]) -> str:
    return f"{q[0]:+.1f}% [{q[1]:+.1f}, {q[2]:+.1f}]"


def report(a, metrics, batches, res: Result, spec, shares, missed) -> None:
    n_tok = batches["r2"].num_tokens
    print(
        f"model: hidden {a.hidden}, {spec.num_layers} layers ({len(spec.moe_layer_ids)} MoE), "
        f"{spec.num_experts} experts top-{spec.topk}; batch {a.batch} x <= {a.seq} tokens "
        f"({n_tok}), microbatch {a.mbs}, {a.reps} reps"
    )
    rows = []
    for v in VARIANTS:
        m = {k: 1e3 * res.median(v, k) for k in res.metrics(v)}
        rows.append([v, f"{m['logprobs_cpu']:.1f} / {m['logprobs_wall']:.1f}",
                     f"{m['step_cpu']:.1f} / {m['step_wall']:.1f}"])  # fmt: skip
    print(markdown_table(["variant", "logprobs cpu/wall ms", "train_step cpu/wall ms"], rows))
    r3 = metrics["r3"]
    print(f"r3 rollout/train agreement: {r3['routing/rollout_train_agreement']:.3f}")
    payload = spec.num_layers * spec.topk * 4
    stored = {v: sum(s.nbytes for s in batches[v].routing) / n_tok for v in ("r2", "r3")}
    print(
        f"bytes per token: SGLang int32 payload {payload}, r2 stored {stored['r2']:.1f}, "
        f"r3 stored {stored['r3']:.1f} (rollout ids + the recorded ones as a patch)"
    )
    print(f"side by side vs plain, {a.threads} thread(s), CPU time: median of per-rep ratios "
          "[95% confidence interval] (fastest rep vs fastest rep)")  # fmt: skip
    side, inline = {}, {}
    for v in ("none", "r2", "r3"):
        over = {p: paired_overhead(res, v, f"{p}_cpu") for p in ("logprobs", "step")}
        side[v] = paired_overhead(res, v, "total_cpu")
        inline[v] = timed_overhead(res, v)
        print(
            f"  {v:4}: train_step {fmt(over['step'])}, logprobs {fmt(over['logprobs'])}, "
            f"both {fmt(side[v])} ({min_overhead(res, v, 'total_cpu'):+.1f}%)"
        )
    spread = np.std([100 * (r - 1) for r in res.paired("r2", "plain", "step_cpu")])
    print(f"  (per-rep spread of the side-by-side ratio: {spread:.1f}%, the machine's noise)")
    res.extra.update(side_by_side_pct=side, inline_pct=inline, profiled_share=shares)
    print("routing code's own CPU time, timed in-line at its entry points, over the rest of the "
          "step: mean over reps [95% confidence interval]; cProfile's share beside it")  # fmt: skip
    for v in ("none", "r2", "r3"):
        print(f"  {v:4}: {fmt(inline[v])} (profiled {100 * shares[v]:.1f}%)")
    if missed:
        print(f"  WARNING: routing functions called from outside its entry points, not timed: "
              f"{', '.join(missed)}; add them to ROUTING_ENTRIES")  # fmt: skip
    # Shown: the in-line interval is under 3% and the side-by-side interval does not lie above.
    shown = {v: not missed and inline[v][2] < 3 and side[v][1] < 3 for v in ("r2", "r3")}
    verdict = {v: "under 3%" if shown[v] else "not shown" for v in ("r2", "r3")}
    print(
        "step overhead (logprobs + train_step; in-line, side-by-side median): "
        f"r2 {fmt(inline['r2'])}, {fmt(side['r2'])} {verdict['r2']}; "
        f"r3 {fmt(inline['r3'])}, {fmt(side['r3'])} {verdict['r3']} (goal < 3%)"
    )
    print(
        f"storage ratio (int32 payload / stored): r2 {payload / stored['r2']:.2f}x, "
        f"r3 {payload / stored['r3']:.2f}x"
    )


if __name__ == "__main__":
    main()
