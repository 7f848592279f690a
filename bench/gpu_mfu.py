"""MFU of the product's bf16 MoE train step on layers shaped like Qwen3-30B-A3B, on one GPU; beside
it a plain bf16 matmul's TFLOP/s measured in the same run (the practical ceiling).

The step is the product's, with no patching: `Actor.train_step` (megatron DDP, distributed
optimizer, GSPO loss, routing recorded) on a model from `model.builder.build_model`, random
weights, random tokens, every token trained on. The expert implementation is chosen the way a
config chooses it (`model.moe_grouped_gemm` -> `BuildOptions.moe_grouped_gemm`): "grouped"
(GroupedExperts over torch's grouped GEMM, the default on a GPU) and "sequential" (megatron's
SequentialMLP, one matmul pair per expert). The first implementation named is the judged one.

Each configuration (experts x layer count) builds its model, takes the first micro batch of
`--micro-batch` that fits in memory (the largest of them that fits), runs `--warmup` steps and
times `--steps` more, and prints:
- tokens/s and MFU (achieved FLOP/s over `--peak-tflops`);
- the step's split: forward (the forward-only log-prob pass over the same batch), optimizer
  (gradient norm, clipping and the update, timed inside the step) and backward-and-loss (the rest);
- the fixed per-step cost: the intercept of step time against tokens, from the full step and a
  step of one microbatch (half the tokens);
- memory: the static state by kind (parameters, gradient buffers, optimizer state: fp32 master
  weights and Adam moments) and the peak, with their ratio;
- with `--profile N`, the N most expensive kernels of one profiled step (torch.profiler).

FLOPs (the MFU numerator), per step of T tokens in sequences of s: 6 T N_active, the matmul
FLOPs of forward + backward, with N_active the parameters a token goes through (attention
q/k/v/o, router, top-k of the experts, the LM head; not the embedding lookup), plus causal
attention 6 b s^2 n_heads d_head per layer. With few layers the LM head (151936 x 2048) is a large
share of the FLOPs, which a 48-layer model does not have; so with two layer counts the per-layer
time is also taken from their difference, giving the decoder layers' own MFU and an estimate for
all 48 layers.

    python bench/gpu_mfu.py [--layers 6,2] [--experts grouped,sequential] [--profile 20] [--json OUT]
    python bench/gpu_mfu.py --tiny      # CPU: tiny shapes, 2 steps (the set-up only)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpu_meters import (  # noqa: E402
    OptimizerClock,
    gb,
    matmul_tflops,
    profile_step,
    static_memory,
    timed,
)
from harness import median  # noqa: E402 - bench/ is on the path: run as a script

from megatron_gspo.hf.config import ModelSpec  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
GOAL_MFU = 0.30
EXPERTS = {"grouped": True, "sequential": False}  # -> BuildOptions.moe_grouped_gemm


@dataclass(frozen=True)
class Shape:
    """One transformer layer's sizes (Qwen3-30B-A3B by default) and the vocabulary."""

    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    topk: int = 8
    moe_ffn: int = 768
    vocab: int = 151936
    full_layers: int = 48  # the real model's, for the extrapolation


TINY = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, topk=2, moe_ffn=32,
             vocab=256, full_layers=4)  # fmt: skip


def model_spec(shape: Shape, layers: int, seq: int) -> ModelSpec:
    return ModelSpec(
        arch="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=shape.vocab,
        hidden_size=shape.hidden, num_layers=layers, num_heads=shape.heads,
        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn_hidden_size=6144,
        moe_ffn_hidden_size=shape.moe_ffn, num_experts=shape.experts, topk=shape.topk,
        norm_topk_prob=True, moe_layers=(True,) * layers, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=False, qkv_bias=False, qk_norm=True,
        max_position_embeddings=max(seq, 4096), dtype=torch.bfloat16,
    )  # fmt: skip


def layer_flops(shape: Shape, tokens: int, rows: int, seq: int) -> float:
    """Forward + backward FLOPs of one MoE layer over `tokens` = rows x seq."""
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    active = h * qd + 2 * h * kvd + qd * h + h * shape.experts + shape.topk * 3 * h * shape.moe_ffn
    attention = 6 * rows * seq * seq * shape.heads * shape.head_dim  # causal: half of 12 b s^2
    return 6.0 * tokens * active + attention


def head_flops(shape: Shape, tokens: int) -> float:
    return 6.0 * tokens * shape.vocab * shape.hidden


# ---- the step ----------------------------------------------------------------------------------


def random_batch(rows: int, seq: int, vocab: int, seed: int):
    from megatron_gspo.train.batch import StepBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g).tolist()
    advantages = torch.randn(rows, generator=g).tolist()
    return StepBatch.from_rows(tokens, [[0] + [1] * (seq - 1) for _ in range(rows)], advantages)


def one_step(actor, batch, mbs: int) -> tuple[float, float]:
    """One product train step; returns (loss, grad norm)."""
    from megatron_gspo.train.actor import AlgoConfig

    step = actor.train_step(batch, AlgoConfig(loss="gspo"), mbs, on_policy=True)
    return step.loss, step.grad_norm


def forward_only(actor, batch, mbs: int) -> None:
    actor.logprobs(batch, mbs)


def time_steps(actor, a, shape: Shape, mbs: int, device, micro_batches: int) -> list[float]:
    rows = mbs * micro_batches
    times = []
    for i in range(a.warmup + a.steps):
        batch = random_batch(rows, a.seq, shape.vocab, seed=i)
        out: list = []
        t = timed(lambda b=batch, o=out: o.extend(one_step(actor, b, mbs)), device)
        if i >= a.warmup:
            times.append(t)
        print(f"  step {i} ({rows} x {a.seq}): {t:.3f} s  loss {out[0]:.4g}  "
              f"grad norm {out[1]:.4g}", flush=True)  # fmt: skip
        if not all(map(math.isfinite, out)):
            raise FloatingPointError(f"a non-finite step: loss {out[0]}, grad norm {out[1]}")
    return times


@dataclass
class Result:
    experts: str
    layers: int
    micro_batch: int = 0
    micro_batches: int = 0
    seq: int = 0
    tokens_per_step: int = 0
    step_s: float = 0.0
    step_s_range: tuple[float, float] = (0.0, 0.0)
    tokens_per_s: float = 0.0
    tflops_per_step: float = 0.0
    achieved_tflops: float = 0.0
    mfu: float = 0.0
    lm_head_flop_share: float = 0.0
    split_s: dict = field(default_factory=dict)
    fixed_cost_s: float | None = None
    memory: dict = field(default_factory=dict)
    profile: list = field(default_factory=list)
    error: str | None = None


def fits(actor, a, shape, device, candidates: list[int]) -> tuple[int, list[float]] | None:
    """The first micro batch of `candidates` whose steps fit in memory, with its step times."""
    for mbs in candidates:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            return mbs, time_steps(actor, a, shape, mbs, device, a.micro_batches)
        except torch.OutOfMemoryError:
            print(f"  out of memory at micro batch {mbs}; trying a smaller one", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return None


def measure_parts(res: Result, actor, a, shape: Shape, device) -> None:
    """Split, fixed cost and memory of the configuration at its micro batch."""
    mbs, seq = res.micro_batch, a.seq
    if device.type == "cuda":
        res.memory["peak_gb"] = gb(torch.cuda.max_memory_allocated(device))
    res.memory.update(static_memory(actor))
    if "static_gb" in res.memory:
        res.memory["peak_x_static"] = res.memory["peak_gb"] / res.memory["static_gb"]
    batch = random_batch(mbs * a.micro_batches, seq, shape.vocab, seed=99)
    clock = OptimizerClock(actor.optimizer, device)
    step = timed(lambda: one_step(actor, batch, mbs), device)
    fwd = timed(lambda: forward_only(actor, batch, mbs), device)
    res.split_s = {"step": step, "forward": fwd, "optimizer": clock.seconds,
                   "backward_and_loss": step - fwd - clock.seconds}  # fmt: skip
    if a.micro_batches > 1:  # t = fixed + c * tokens, from this and a one-microbatch step
        small = time_steps(actor, a, shape, mbs, device, 1)
        t1, n1, t2 = median(small), mbs * seq, res.step_s
        n2 = res.tokens_per_step
        res.fixed_cost_s = t1 - (t2 - t1) / (n2 - n1) * n1
    if a.profile:
        res.profile = profile_step(lambda: one_step(actor, batch, mbs), device, a.profile)


def run_config(impl, layers, a, shape: Shape, device, candidates: list[int]) -> Result:
    from megatron_gspo.model.builder import BuildOptions, build_model
    from megatron_gspo.model.parallel import ParallelDims
    from megatron_gspo.train.actor import Actor, OptimConfig

    res = Result(impl, layers, micro_batches=a.micro_batches, seq=a.seq)
    torch.manual_seed(0)
    spec = model_spec(shape, layers, a.seq)
    opts = BuildOptions(params_dtype=torch.bfloat16, init_weights=True,
                        moe_grouped_gemm=EXPERTS[impl])  # fmt: skip
    actor = Actor(build_model(spec, ParallelDims(), opts), OptimConfig(lr=1e-6))
    try:
        found = fits(actor, a, shape, device, candidates)
        if found is None:
            res.error = f"out of memory at every micro batch of {candidates}"
            return res
        res.micro_batch, times = found
        fill(res, times, shape, a)
        measure_parts(res, actor, a, shape, device)
    finally:
        release(actor)
    return res


def fill(res: Result, times: list[float], shape: Shape, a) -> None:
    res.tokens_per_step = res.micro_batch * a.micro_batches * a.seq
    res.step_s = median(times)
    res.step_s_range = (min(times), max(times))
    rows = res.micro_batch * a.micro_batches
    flops = res.layers * layer_flops(shape, res.tokens_per_step, rows, a.seq)
    flops += head_flops(shape, res.tokens_per_step)
    res.tflops_per_step = flops / 1e12
    res.tokens_per_s = res.tokens_per_step / res.step_s
    res.achieved_tflops = res.tflops_per_step / res.step_s
    res.mfu = res.achieved_tflops / a.peak_tflops
    res.lm_head_flop_share = head_flops(shape, res.tokens_per_step) / flops


def release(actor) -> None:
    """Free one configuration's model before the next (routing replay keeps global handles)."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.global_router_replay_instances.clear()
    except (ImportError, AttributeError):
        pass
    actor.chunks.clear()
    actor.optimizer = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def per_layer(results: list[Result], shape: Shape, a) -> dict:
    """The decoder layers' own MFU from two layer counts at the same micro batch, and an
    estimate of the whole step for the real model's layer count."""
    ok = [r for r in results if r.error is None]
    if len({r.layers for r in ok}) < 2 or len({r.micro_batch for r in ok}) != 1:
        return {}
    lo, hi = min(ok, key=lambda r: r.layers), max(ok, key=lambda r: r.layers)
    t_layer = (hi.step_s - lo.step_s) / (hi.layers - lo.layers)
    rows = hi.micro_batch * a.micro_batches
    f_layer = layer_flops(shape, hi.tokens_per_step, rows, a.seq)
    if t_layer <= 0:
        return {"error": "the step did not get slower with more layers"}
    rest = lo.step_s - lo.layers * t_layer  # embedding, LM head, loss, optimizer of the rest
    n = shape.full_layers
    full_flops = n * f_layer + head_flops(shape, hi.tokens_per_step)
    return {
        "layer_s": t_layer,
        "rest_s": rest,
        "layer_mfu": f_layer / t_layer / 1e12 / a.peak_tflops,
        f"mfu_{n}_layers_est": full_flops / (n * t_layer + rest) / 1e12 / a.peak_tflops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="6,2", help="layer counts, comma-separated")
    ap.add_argument("--experts", default="grouped,sequential", help="the first is judged")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", default="4,2,1", help="rows per microbatch: first that fits")
    ap.add_argument("--micro-batches", type=int, default=2, help="microbatches per step")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--matmul", type=int, default=8192, help="n of the n^3 matmul (0: skip)")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest kernels")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the set-up)")
    ap.add_argument("--json", default=None, help="write the results here (after each config)")
    a = ap.parse_args()
    a.micro_batch = [int(x) for x in a.micro_batch.split(",")]
    impls = a.experts.split(",")
    if bad := [i for i in impls if i not in EXPERTS]:
        raise SystemExit(f"--experts: {bad[0]!r} is not one of {', '.join(EXPERTS)}")
    shape = TINY if a.tiny else Shape()

    from megatron_gspo.model.parallel import ParallelDims, device_type, init_distributed

    device = torch.device(device_type())
    init_distributed(ParallelDims())
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "shape": asdict(shape), "seq": a.seq,
                 "peak_tflops": a.peak_tflops, "configs": [], "per_layer": {}}  # fmt: skip
    if a.matmul:
        out["matmul_tflops"] = matmul_tflops(a.matmul, device, 50 if device.type == "cuda" else 5)
        out["matmul_n"] = a.matmul
        print(f"bf16 matmul {a.matmul}^3: {out['matmul_tflops']:.1f} TFLOP/s", flush=True)
    results: dict[str, list[Result]] = {impl: [] for impl in impls}
    candidates = {impl: a.micro_batch for impl in impls}
    # The most layers first, each implementation in turn: a run cut short has the headline.
    for layers in (int(x) for x in a.layers.split(",")):
        for impl in impls:
            print(f"{impl} experts, {layers} layers:", flush=True)
            try:
                r = run_config(impl, layers, a, shape, device, candidates[impl])
            except Exception as e:  # noqa: BLE001 - one configuration's failure is a result
                r = Result(impl, layers, error=f"{type(e).__name__}: {e}"[:500])
            if r.error is None:  # the other layer counts at the same micro batch (per_layer)
                candidates[impl] = [r.micro_batch]
            print(f"  -> {r}", flush=True)
            results[impl].append(r)
            out["configs"].append(asdict(r))
            out["per_layer"][impl] = per_layer(results[impl], shape, a)
            summarize(out, impls[0])
            write(a.json, out)
    print(json.dumps(out, indent=1))


def summarize(out: dict, judged: str) -> None:
    """The judged number: the first implementation named, at the most layers run."""
    ok = [c for c in out["configs"] if c["error"] is None]
    mine = [c for c in ok if c["experts"] == judged]
    best = max(mine, key=lambda c: c["layers"], default=None)
    out["mfu"] = best["mfu"] if best else None
    out["tokens_per_s"] = best["tokens_per_s"] if best else None
    out["judged"] = f"{best['experts']} experts, {best['layers']} layers" if best else None
    out["fixed_cost_s"] = best["fixed_cost_s"] if best else None
    out["split_s"] = best["split_s"] if best else None
    out["memory"] = best["memory"] if best else None
    if best and out.get("matmul_tflops"):
        out["matmul_fraction"] = best["achieved_tflops"] / out["matmul_tflops"]
    out["goal"] = {"what": f"MoE train-step MFU >= {GOAL_MFU}", "value": out["mfu"],
                   "met": out["mfu"] is not None and out["mfu"] >= GOAL_MFU}  # fmt: skip


def write(path: str | None, obj: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1) + "\n")


if __name__ == "__main__":
    main()
