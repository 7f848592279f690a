"""The actor's helpers that need no actor: how moved weights split, a microbatch's TIS weights,
the fused CPU Adam, gathering rows and reducing step statistics over ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.algo import (
    combine_stats,
    log_ratio_split_stats,
    sequence_tis_weights,
    stat_reduce_op,
    summarize_stats,
    token_tis_weights,
)
from megatron_gspo.algo.config import LossConfig, Tis


def _moved_split(split: list, moved: list) -> list[dict]:
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


def _tis_weights(mb, loss_cfg: LossConfig) -> torch.Tensor | None:
    if loss_cfg.tis == Tis.NONE:
        return None
    fn = token_tis_weights if loss_cfg.tis == Tis.TOKEN else sequence_tis_weights
    return fn(mb.old_logprobs, mb.rollout_logprobs, mb.mask, cap=loss_cfg.tis_cap)


def _fused_cpu_adam(optimizer) -> None:
    """torch's Adam/AdamW off CUDA defaults to its per-tensor loop: seven passes over memory per
    parameter (its foreach path is no faster on a CPU). On a CPU its fused kernel does the same
    update in one pass, 3-4x faster for the whole step (within float rounding of the loop). GPUs
    keep torch's default (foreach) or the fused optimizer megatron picked (Transformer Engine,
    apex)."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if params and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
                group["foreach"], group["fused"] = False, True


def _gather_rows(mine: list, n: int, world: int) -> list:
    """Every rank gets every row: gather (row, value) pairs over the whole world."""
    parts: list[Any] = [mine]  # every rank's list, once all_gather_object filled it
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    out = [None] * n
    for part in parts:
        for i, v in part:
            out[i] = v
    return out


def _reduce_stats(outputs: list[dict], world: int, tp: int) -> dict:
    """Sum/min/max the microbatch stats over the data-parallel replicas (on the last pipeline
    stage), then share them with every rank."""
    local = combine_stats(outputs) if outputs else {}
    mine = {k: float(v) for k, v in local.items()}
    parts: list[dict[str, float] | None] = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    total: dict[str, float] = {}
    for part in parts:
        if not part:
            continue
        for k, v in part.items():
            op = stat_reduce_op(k)
            if k not in total:
                total[k] = v
            elif op == "min":
                total[k] = min(total[k], v)
            elif op == "max":
                total[k] = max(total[k], v)
            else:
                total[k] += v
    # Every TP rank of a replica reports the same numbers: count one TP rank per replica.
    sums = {k: v / tp for k, v in total.items() if stat_reduce_op(k) == "sum"}
    total.update(sums)
    metrics = summarize_stats({k: torch.tensor(v) for k, v in total.items()})
    metrics["loss"] = total.get("loss_sum", 0.0)
    metrics["entropy"] = total.get("entropy_sum", 0.0) / max(total.get("num_tokens", 0.0), 1.0)
    return metrics
