"""Drift metrics from per-layer counts, summed over every rank.

Each rank counts its own router tokens for the MoE layers of its pipeline stage; ranks of other
stages hold other layers, data-parallel / expert-parallel / context-parallel ranks and (with
sequence parallelism) tensor-parallel ranks hold other tokens, so per layer the counts add up.
Without sequence parallelism the TP ranks of a replica route the same tokens and only TP rank 0
reports.

    routing/changed_fraction          = sum_l changed_l / sum_l seen_l      (and per layer l)
    routing/rollout_train_agreement   = 1 - sum_l differ_l / sum_l seen_l   (and per layer l)
    routing/bytes_per_token           = host bytes of the batch's stored routing (all stages)
                                        / the batch's tokens
    routing/tokens_changed_any        = share of loss tokens whose routing (at the position that
                                        produced them) moved in at least one MoE layer
"""

from __future__ import annotations

import torch.distributed as dist

CHANGED = "routing/changed_fraction"
AGREEMENT = "routing/rollout_train_agreement"
BYTES_PER_TOKEN = "routing/bytes_per_token"
TOKENS_CHANGED = "routing/tokens_changed_any"

LayerCounts = dict[int, tuple[int, int]]  # layer -> (differing positions, positions seen)


def reduce_counts(local: LayerCounts, report: bool) -> LayerCounts:
    """Per-layer (differing, seen) summed over the world (`report`: this rank's tokens count)."""
    mine = local if report else {}
    parts: list = [None] * dist.get_world_size()
    if len(parts) == 1:
        parts = [mine]  # nothing to gather (and no pickling) on one process
    else:
        dist.all_gather_object(parts, mine)
    total: dict[int, list[int]] = {}
    for part in parts:
        for layer, (diff, seen) in part.items():
            acc = total.setdefault(int(layer), [0, 0])
            acc[0] += diff
            acc[1] += seen
    return {layer: (d, s) for layer, (d, s) in sorted(total.items())}


def model_bytes(stage_bytes: int) -> int:
    """The bytes this rank's stage stores, summed over the pipeline stages (the ranks of one
    stage hold the same)."""
    from megatron.core import parallel_state as mpu

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (mpu.get_pipeline_model_parallel_rank(), stage_bytes))
    return sum(dict(parts).values())


def fraction_metrics(name: str, counts: LayerCounts, agreement: bool = False) -> dict[str, float]:
    """`name` over all layers and `name/layer_<i>` per layer; absent where nothing was seen."""
    out: dict[str, float] = {}
    diff = sum(d for d, _ in counts.values())
    seen = sum(s for _, s in counts.values())
    if seen == 0:
        return out
    out[name] = _value(diff, seen, agreement)
    for layer, (d, s) in counts.items():
        if s:
            out[f"{name}/layer_{layer}"] = _value(d, s, agreement)
    return out


def _value(diff: int, seen: int, agreement: bool) -> float:
    frac = diff / seen
    return 1.0 - frac if agreement else frac
