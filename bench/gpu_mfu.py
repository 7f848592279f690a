"""MFU of a bf16 Megatron MoE train step on layers shaped like Qwen3-30B-A3B, on one GPU, without
Transformer Engine; beside it a plain bf16 matmul's TFLOP/s measured in the same run (the ceiling).

The step is the product's: `Actor.train_step` (megatron DDP, distributed optimizer, GSPO loss,
routing recorded) on a model from `model.builder.build_model` (the local layer spec, our RMSNorm
and SDPA attention), random weights, random tokens, all of them trained on. Each configuration
(expert implementation x layer count) builds its model, takes the first micro batch from
`--micro-batch` that fits in memory, runs `--warmup` steps and times `--steps` more.

Expert implementations. megatron-core 0.16.1 without TE offers two: SequentialMLP (one matmul
pair per expert, 128 a layer: what `build_model` builds today) and the legacy GroupedMLP, which
needs the `grouped_gemm` package (a CUDA build from source; TEGroupedMLP needs TE). Neither of
those is on the GPU machine, so "sequential" is the product's path and "grouped" is GroupedMLP
with grouped_gemm's one function, `gmm`, supplied by torch's own grouped GEMM (`torch._grouped_mm`,
CUTLASS on sm90): a measurement of what grouped experts would give, not a product path.

FLOPs (the MFU numerator), per step of T tokens in sequences of s: 6 T N_active, the matmul
FLOPs of forward + backward, with N_active the parameters a token goes through (attention
q/k/v/o, router, top-k of the experts, the LM head; not the embedding lookup), plus causal
attention 6 b s^2 n_heads d_head per layer (QK^T and PV over half the square, x3 for backward).
MFU is achieved FLOP/s over `--peak-tflops` (989: H100/H200 dense bf16). With few layers the LM
head (151936 x 2048) is a large share of the FLOPs, which a 48-layer model does not have; so with
two layer counts the per-layer time is also taken from their difference, giving the decoder
layers' own MFU and an estimate for all 48 layers.

    python bench/gpu_mfu.py [--layers 6,2] [--experts sequential,grouped] [--json OUT]
    python bench/gpu_mfu.py --tiny      # CPU: tiny shapes, 2 steps (the set-up only)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_gspo.hf.config import ModelSpec  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
GOAL_MFU = 0.40


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


# ---- the matmul ceiling --------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(n: int, device: torch.device, iters: int = 20) -> float:
    """A plain n x n x n bf16 matmul's achieved TFLOP/s (torch.matmul, cuBLAS on a GPU)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - t) / 1e12


# ---- expert implementations ----------------------------------------------------------------


def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False):
    """grouped_gemm.ops.gmm: rows of `a` [T, K] in groups of `batch_sizes`, group e times b[e]
    ([E, K, N], or [E, N, K] with trans_b) -> [T, N]; one torch._grouped_mm call."""
    if trans_b:
        b = b.transpose(-2, -1)
    offs = torch.cumsum(batch_sizes.to(a.device), 0, dtype=torch.int32)
    return torch._grouped_mm(a, b, offs=offs)


def use_experts(impl: str) -> None:
    """Make `build_model` build "sequential" (SequentialMLP, as it does) or "grouped" experts
    (GroupedMLP over `_gmm`). Patches this process's megatron-core and builder only."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from megatron_gspo.model import builder

    if not hasattr(builder, "_bench_transformer_config"):
        builder._bench_transformer_config = builder.transformer_config
    base = builder._bench_transformer_config
    if impl == "sequential":
        builder.transformer_config = base
        return
    if impl != "grouped":
        raise SystemExit(f"--experts: sequential or grouped, not {impl!r}")
    ops = types.SimpleNamespace(gmm=_gmm)
    gg.grouped_gemm, gg.ops = types.SimpleNamespace(ops=ops), ops

    def grouped_config(spec, dims, opts):
        config = base(spec, dims, opts)
        config.moe_grouped_gemm = True  # the layer spec then picks GroupedMLP (no TE)
        return config

    builder.transformer_config = grouped_config


# ---- one configuration ---------------------------------------------------------------------


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
    peak_memory_gb: float = 0.0
    error: str | None = None


def random_batch(rows: int, seq: int, vocab: int, seed: int):
    from megatron_gspo.train.batch import RLBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g).tolist()
    advantages = (torch.randn(rows, generator=g)).tolist()
    return RLBatch(tokens, [[0] + [1] * (seq - 1) for _ in range(rows)], advantages)


def time_steps(actor, a, shape: Shape, mbs: int, device: torch.device) -> list[float]:
    from megatron_gspo.train.actor import LossConfig

    rows = mbs * a.micro_batches
    times = []
    for i in range(a.warmup + a.steps):
        batch = random_batch(rows, a.seq, shape.vocab, seed=i)
        sync(device)
        t = time.perf_counter()
        metrics = actor.train_step(batch, LossConfig(kind="gspo"), mbs, on_policy=True).stats
        sync(device)
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
        print(f"  step {i}: {time.perf_counter() - t:.3f} s  loss {metrics['loss']:.4g}  "
              f"grad norm {metrics['grad_norm']:.4g}", flush=True)  # fmt: skip
    if not all(map(math.isfinite, (metrics["loss"], metrics["grad_norm"]))):
        raise FloatingPointError(f"a non-finite step: {metrics}")
    return times


def run_config(impl, layers, a, shape: Shape, device, candidates: list[int]) -> Result:
    from megatron_gspo.model.builder import BuildOptions, build_model
    from megatron_gspo.model.parallel import ParallelDims
    from megatron_gspo.train.actor import Actor, OptimConfig

    res = Result(impl, layers, micro_batches=a.micro_batches, seq=a.seq)
    use_experts(impl)
    torch.manual_seed(0)
    spec = model_spec(shape, layers, a.seq)
    opts = BuildOptions(params_dtype=torch.bfloat16, init_weights=True)
    actor = Actor(build_model(spec, ParallelDims(), opts), OptimConfig(lr=1e-6))
    for mbs in candidates:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            times = time_steps(actor, a, shape, mbs, device)
        except torch.OutOfMemoryError:
            res.error = f"out of memory at micro batch {mbs}"
            print(f"  {res.error}; trying a smaller one", flush=True)
            times = None
        if times is None:
            gc.collect()
            torch.cuda.empty_cache()
            continue
        res.error, res.micro_batch = None, mbs
        res.tokens_per_step = mbs * a.micro_batches * a.seq
        res.step_s = statistics.median(times)
        res.step_s_range = (min(times), max(times))
        rows = mbs * a.micro_batches
        flops = layers * layer_flops(shape, res.tokens_per_step, rows, a.seq)
        flops += head_flops(shape, res.tokens_per_step)
        res.tflops_per_step = flops / 1e12
        res.tokens_per_s = res.tokens_per_step / res.step_s
        res.achieved_tflops = res.tflops_per_step / res.step_s
        res.mfu = res.achieved_tflops / a.peak_tflops
        res.lm_head_flop_share = head_flops(shape, res.tokens_per_step) / flops
        if device.type == "cuda":
            res.peak_memory_gb = torch.cuda.max_memory_allocated(device) / 1e9
        break
    del actor
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


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
        "layer_mfu": f_layer / t_layer / 1e12 / a.peak_tflops,
        f"mfu_{n}_layers_est": full_flops / (n * t_layer + rest) / 1e12 / a.peak_tflops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="6,2", help="layer counts, comma-separated")
    ap.add_argument("--experts", default="sequential,grouped", help="sequential,grouped")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", default="4,2,1", help="rows per microbatch: first that fits")
    ap.add_argument("--micro-batches", type=int, default=2, help="microbatches per step")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--matmul", type=int, default=8192, help="n of the n^3 matmul (0: skip)")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the set-up)")
    ap.add_argument("--json", default=None, help="write the results here (after each config)")
    a = ap.parse_args()
    a.micro_batch = [int(x) for x in a.micro_batch.split(",")]
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
    impls = a.experts.split(",")
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
            summarize(out, a)
            write(a.json, out)
    print(json.dumps(out, indent=1))


def summarize(out: dict, a) -> None:
    """The judged number: the product's path (sequential experts) at the most layers run."""
    ok = [c for c in out["configs"] if c["error"] is None]
    product = [c for c in ok if c["experts"] == "sequential"] or ok
    best = max(product, key=lambda c: c["layers"], default=None)
    out["mfu"] = best["mfu"] if best else None
    out["tokens_per_s"] = best["tokens_per_s"] if best else None
    out["judged"] = f"{best['experts']} experts, {best['layers']} layers" if best else None
    if best and out.get("matmul_tflops"):
        out["matmul_fraction"] = best["achieved_tflops"] / out["matmul_tflops"]
    out["goal"] = {"what": f"MoE train-step MFU >= {GOAL_MFU}", "value": out["mfu"],
                   "met": out["mfu"] is not None and out["mfu"] >= GOAL_MFU}  # fmt: skip


def write(path: str | None, obj: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1) + "\n")


if __name__ == "__main__":
    main()
