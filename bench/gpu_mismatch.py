"""Trainer vs rollout numerics on one GPU: the bf16 Megatron trainer's per-token log-probs and
routing against the fp32 rollout model's, over the same weights and sequences.

The trainer: `Actor.logprobs` (the forward the RL loop computes old log-probs with; the natural
routing of every token recorded) on a model loaded by `load_policy` in bf16 on the GPU. The
rollout side: the built-in server's model (`RolloutModel`, what it serves and what it returns
with --enable-return-routed-experts) in fp32 on the CPU. The checkpoint is bf16, so both hold the
same values and only the arithmetic differs. A control runs the same trainer in fp32 (the
mismatch then is kernel rounding alone, ~1e-5).

Reported per trainer dtype: mean / max |logp_trainer - logp_rollout| over every next-token
position and the mean signed difference; the share of (token, MoE layer) pairs whose top-k expert
SETS agree (the quantity routing replay R3 removes), overall and per layer.

The weights are random (no checkpoint can be downloaded there), with Qwen3-30B-A3B's layer shapes
by default: an untrained router's margins between the k-th and (k+1)-th expert are not a trained
model's, so the agreement is indicative, not Qwen3's.

    python bench/gpu_mismatch.py [--layers 2] [--seqs 8 --len 256] [--model DIR] [--json OUT]
    python bench/gpu_mismatch.py --tiny     # a tiny model (a check that it starts, on CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model  # noqa: E402

QWEN3_30B_A3B_LAYERS = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                            moe_ffn=768, experts=128, topk=8, rope_theta=1e6)  # fmt: skip


def rollout_side(model: Path, seqs: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sequence: fp32 next-token log-probs [n - 1] and routed experts [n, layers, k]."""
    from megatron_gspo.server.model import RolloutModel

    rm = RolloutModel.from_pretrained(model, torch.float32)
    logprobs, routed = [], []
    with torch.no_grad():
        for s in seqs:
            out = rm.full_logits(s, record_routing=True)
            lp = out.logits[0].float().log_softmax(-1)[:-1]
            logprobs.append(lp.gather(-1, torch.tensor(s[1:]).unsqueeze(-1)).squeeze(-1).numpy())
            routed.append(out.routed[0].numpy())
    return logprobs, routed


def trainer_side(model: Path, seqs: list[list[int]], dtype: torch.dtype, mbs: int):
    """Per sequence: the trainer's next-token log-probs [n - 1] and its natural routing
    [n, MoE layers, k]; and the MoE layer ids."""
    from megatron_gspo.model.builder import BuildOptions
    from megatron_gspo.model.parallel import ParallelDims
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.train.actor import Actor, OptimConfig
    from megatron_gspo.train.batch import StepBatch

    chunks = load_policy(model, ParallelDims(), BuildOptions(params_dtype=dtype))
    actor = Actor(chunks, OptimConfig(lr=0.0))
    batch = StepBatch.from_rows(seqs, [[0] + [1] * (len(s) - 1) for s in seqs], [0.0] * len(seqs))
    rows = batch.to_rows(actor.logprobs(batch, mbs)[0])
    logprobs = [np.array(r[1:], dtype=np.float64) for r in rows]
    routing = [s.recorded for s in batch.routing]
    layers = batch.routing[0].layers
    del actor, chunks, batch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return logprobs, routing, layers


def agreement(trainer_routing, rollout_routed, spec, layers) -> dict:
    """Share of (token, MoE layer) whose top-k sets agree, overall and per layer."""
    from megatron_gspo.routing.align import align_rollout_experts

    same, total = np.zeros(len(layers)), 0
    for i, (rec, routed) in enumerate(zip(trainer_routing, rollout_routed)):
        ours = align_rollout_experts(
            routed, len(rec), spec.num_layers, spec.moe_layer_ids, layers, spec.topk,
            spec.num_experts, sample=i,
        )  # fmt: skip
        rec = rec[: len(ours)]
        agree = (np.sort(rec, axis=-1) == np.sort(ours, axis=-1)).all(-1)  # [tokens, layers]
        same += agree.sum(0)
        total += agree.shape[0]
    return {
        "routing_agreement": float(same.sum() / (total * len(layers))),
        "routing_agreement_per_layer": {
            str(layer): float(s / total) for layer, s in zip(layers, same)
        },
        "routed_tokens": total,
    }


def mismatch(trainer_lp, rollout_lp) -> dict:
    diff = np.concatenate([t - r for t, r in zip(trainer_lp, rollout_lp)])
    return {
        "logprob_abs_diff_mean": float(np.abs(diff).mean()),
        "logprob_abs_diff_max": float(np.abs(diff).max()),
        "logprob_diff_mean": float(diff.mean()),
        "tokens": int(diff.size),
    }


def make_model(a, path: Path) -> Path:
    """A random bf16 checkpoint at `path` (left there for other benches to reuse)."""
    if a.tiny:
        spec = TinySpec(layers=2, dtype="bfloat16", seed=0)
    else:
        spec = TinySpec(vocab_size=a.vocab, layers=a.layers, kv_heads=4, dtype="bfloat16",
                        max_position_embeddings=max(4096, a.len), seed=0,
                        **{k: v for k, v in QWEN3_30B_A3B_LAYERS.items() if k != "kv_heads"})  # fmt: skip
    t = time.perf_counter()
    path = make_tiny_model(spec, path)
    print(f"made a {spec.layers}-layer bf16 model in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the trainer's, in turn")
    ap.add_argument("--model", default=None, help="this HF checkpoint, made here if missing")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a start-up check)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tiny:
        a.seqs, a.len = min(a.seqs, 4), min(a.len, 32)

    from megatron_gspo.hf.config import load_hf_config, model_spec
    from megatron_gspo.model.parallel import ParallelDims, device_type, init_distributed

    init_distributed(ParallelDims())
    with tempfile.TemporaryDirectory(prefix="gpu-mismatch-") as tmp:
        model = Path(a.model or Path(tmp) / "model")
        if not model.exists():
            make_model(a, model)
        spec = model_spec(load_hf_config(model))
        g = torch.Generator().manual_seed(0)
        seqs = torch.randint(0, spec.vocab_size, (a.seqs, a.len), generator=g).tolist()
        t = time.perf_counter()
        rollout_lp, rollout_routed = rollout_side(model, seqs)
        print(f"rollout side (fp32, CPU): {time.perf_counter() - t:.1f} s", flush=True)
        out = {"device": device_type(), "model": str(a.model or "random"),
               "dtype": str(spec.dtype).removeprefix("torch."),
               "layers": spec.num_layers, "experts": spec.num_experts, "topk": spec.topk,
               "seqs": a.seqs, "len": a.len, "trainer": {}}  # fmt: skip
        for name in a.dtypes.split(","):
            t = time.perf_counter()
            lp, routing, layers = trainer_side(model, seqs, getattr(torch, name), a.micro_batch)
            res = mismatch(lp, rollout_lp) | agreement(routing, rollout_routed, spec, layers)
            out["trainer"][name] = res
            print(f"trainer {name} on {device_type()}: {time.perf_counter() - t:.1f} s  {res}",
                  flush=True)  # fmt: skip
            out.update(out["trainer"].get("bfloat16", {}))  # the headline: the bf16 trainer's
            if a.json:  # after each trainer: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
