"""The actor's helpers that need no actor: how moved weights split, a microbatch's TIS weights,
the checks of a step, its padding, the fused Adam, gathering log-probs and reducing step
statistics over ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_gspo.algo.config import AlgoConfig, Mismatch
from megatron_gspo.algo.loss_stats import (
    combine_stats,
    log_ratio_split_stats,
    stat_reduce_op,
    summarize_stats,
)
from megatron_gspo.algo.mismatch import correction_weights
from megatron_gspo.algo.policy_loss import KLPenalty
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.train.batch import scatter_token_logprobs


def moved_split(split: list, moved: list) -> list[dict]:
    """log_ratio_split_stats of each microbatch the loss saw, `moved[i]` ([n] bool per position
    of sample i) placed on its columns: column j is position j, which produced token j + 1."""
    out = []
    for index_b, log_ratio_BS, mask_BS in split:
        moved_BS = torch.zeros(mask_BS.shape, dtype=torch.bool)
        for r, i in enumerate(index_b.tolist()):
            if i >= 0:
                n = min(len(moved[i]), mask_BS.shape[1])
                moved_BS[r, :n] = torch.from_numpy(moved[i][:n])
        out.append(log_ratio_split_stats(log_ratio_BS, mask_BS, moved_BS.to(mask_BS.device)))
    return out


def check_step(batch, loss_cfg: AlgoConfig, on_policy: bool, routing_mode) -> None:
    """What `Actor.train_step` needs of its batch, checked before anything runs."""
    if on_policy and routing_mode == ReplayMode.R3:
        raise ValueError("on_policy train_step cannot replay rollout routing (r3)")
    if "old_logprobs" not in batch.fields and not on_policy:
        raise ValueError("train_step needs old_logprobs (Actor.logprobs computes them)")
    if loss_cfg.correction[0] != Mismatch.NONE and "rollout_logprobs" not in batch.fields:
        raise ValueError(f"{loss_cfg.correction[0]} needs the batch's rollout_logprobs")
    if loss_cfg.kl_in_loss and "ref_logprobs" not in batch.fields:
        raise ValueError("kl_coef > 0 needs the batch's ref_logprobs (Actor.reference_logprobs)")


def kl_penalty(mb, loss_cfg: AlgoConfig) -> KLPenalty | None:
    """The microbatch's KL penalty to the reference policy (algo.kl_coef > 0, kl_in: loss), or
    None."""
    if not loss_cfg.kl_in_loss:
        return None
    assert mb.ref_logprobs is not None, "checked by check_step"
    return KLPenalty(mb.ref_logprobs, loss_cfg.kl_coef, loss_cfg.kl_estimator)


def padding_stats(mbs) -> dict[str, float]:
    """This replica's microbatches: the share of their token slots that are padding, and their
    real tokens per microbatch (for logging)."""
    real = sum(int(mb.lengths.sum()) for mb in mbs)
    slots = sum(mb.tokens.numel() for mb in mbs)  # (padded: b * seq_len each)
    return {
        "padding_fraction": 1.0 - real / max(slots, 1),
        "tokens_per_microbatch": real / len(mbs),
    }


def correction_weights_of(mb, loss_cfg: AlgoConfig) -> torch.Tensor | None:
    """The microbatch's mismatch-correction weights (tis, mis, icepop; algo/mismatch.py)."""
    return correction_weights(loss_cfg, mb.old_logprobs, mb.rollout_logprobs, mb.mask)


def fused_adam(optimizer) -> None:
    """Have torch's Adam/AdamW (megatron's optimizer without Transformer Engine or apex) update
    every parameter of a group in one fused kernel.

    Left to its default, torch's Adam loops over the parameters on a CPU: seven passes over
    memory per parameter (its foreach path is no faster there), where the fused kernel does the
    same update in one pass, 3-4x faster for the whole step (within float rounding of the
    loop). On CUDA its default is the multi-tensor (foreach) path, a few kernels per group of
    tensors; the fused kernel is one per group: the per-tensor launches are a fixed cost of
    every step, paid per parameter tensor. Fused optimizers megatron picked (Transformer
    Engine's, apex's) are kept."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            params = group["params"]
            devices = {p.device.type for p in params}
            if params and len(devices) == 1 and devices <= {"cpu", "cuda"}:
                if all(p.is_floating_point() for p in params):
                    group["foreach"], group["fused"] = False, True


def flat_logprobs(pieces, batch, world: int, device="cpu") -> torch.Tensor:
    """(microbatch, its log-probs [b, S]) pairs -> the batch's token-aligned field [T] (NaN
    where none); of a whole batch (not a shard), gathered from every rank."""
    flat = torch.full((batch.num_tokens,), float("nan"))
    for mb, lp in pieces:
        scatter_token_logprobs(flat, batch.cu_seqlens, mb, lp)
    return flat if batch.sharded else _gather_flat(flat, world, device)


def _gather_flat(flat_T: torch.Tensor, world: int, device="cpu") -> torch.Tensor:
    """A whole batch's token field [T] from every rank's (NaN where a rank computed none: its
    replica's other rows, a stage before the last): each position from a rank that has it."""
    if world == 1:
        return flat_T
    parts = [torch.empty_like(flat_T, device=device) for _ in range(world)]
    dist.all_gather(parts, flat_T.to(device))
    out = flat_T.clone()
    for part in parts:
        part = part.cpu()
        out = torch.where(out.isnan(), part, out)
    return out


_IDENTITY = {"sum": 0.0, "min": float("inf"), "max": float("-inf")}
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def reduce_stats(outputs: list[dict], world: int, tp: int, device="cpu") -> dict:
    """Sum/min/max the microbatch stats over the data-parallel replicas (on the last pipeline
    stage), then share them with every rank: three tensor all-reduces over the keys (which the
    ranks agree on first: those of the last stage's loss)."""
    local = combine_stats(outputs) if outputs else {}
    mine = {k: float(v) for k, v in local.items()}
    total: dict[str, float] = dict(mine)
    if world > 1:
        names: list = [None] * world
        dist.all_gather_object(names, sorted(mine))  # (the stat names: a few short strings)
        keys = sorted({k for part in names for k in part})
        for op in ("sum", "min", "max"):
            mine_op = [k for k in keys if stat_reduce_op(k) == op]
            if not mine_op:
                continue
            t = torch.tensor([mine.get(k, _IDENTITY[op]) for k in mine_op],
                             dtype=torch.float64, device=device)  # fmt: skip
            dist.all_reduce(t, op=_OPS[op])
            total.update(zip(mine_op, t.cpu().tolist()))
    # Every TP rank of a replica reports the same numbers: count one TP rank per replica.
    sums = {k: v / tp for k, v in total.items() if stat_reduce_op(k) == "sum"}
    total.update(sums)
    metrics = summarize_stats({k: torch.tensor(v) for k, v in total.items()})
    metrics["loss"] = total.get("loss_sum", 0.0)
    metrics["entropy"] = total.get("entropy_sum", 0.0) / max(total.get("num_tokens", 0.0), 1.0)
    return metrics


def optimizer_step(opt) -> tuple[bool, float | None, bool]:
    """The optimizer step, unless the gradient norm is not finite (a NaN/Inf loss, an
    overflow): then the gradients are dropped and the weights stay as they were. The norm
    is reduced over the model-parallel (and, with the distributed optimizer, data-parallel)
    ranks, so every rank takes the same branch. Returns (updated, grad norm, finite).

    The step is megatron's own (`MixedPrecisionOptimizer.step`, `ChainedOptimizer.step`) with
    the norm taken once: megatron's step would take it again to clip, a second pass over every
    gradient (and its all-reduce) that gives the same number."""
    if opt.prepare_grads():  # a loss scaler found an overflow: megatron skips the step
        return False, None, True
    norm = opt.get_grad_norm()
    if not math.isfinite(float(norm)):
        opt.zero_grad()
        return False, float(norm), False
    clip_to_norm(opt, norm)
    ok = opt.step_with_ready_grads()
    # the norm before clipping, as megatron's own
    return bool(ok), float(norm), True


def clip_to_norm(opt, norm) -> None:
    """Megatron's step's clipping (each optimizer of a chain by its own `clip_grad`) to a total
    norm already taken."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for o in getattr(opt, "chained_optimizers", [opt]):
        if getattr(o, "is_stub_optimizer", False) or o.config.clip_grad <= 0.0:
            continue
        params = o.get_parameters()
        if params:
            decoupled = o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            clip_grad_by_total_norm_fp32(params, o.config.clip_grad, norm, decoupled)
