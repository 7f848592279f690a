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

import torch
import torch.distributed as dist

CHANGED = "routing/changed_fraction"
AGREEMENT = "routing/rollout_train_agreement"
BYTES_PER_TOKEN = "routing/bytes_per_token"
TOKENS_CHANGED = "routing/tokens_changed_any"

LayerCounts = dict[int, tuple[int, int]]  # layer -> (differing positions, positions seen)


def reduce_counts(
    local: LayerCounts, report: bool, layers: list[int] | tuple[int, ...], device="cpu"
) -> LayerCounts:
    """Per-layer (differing, seen) summed over the world (`report`: this rank's tokens count;
    `layers`: every MoE layer of the model), as one tensor all-reduce."""
    mine = local if report else {}
    if dist.get_world_size() == 1:
        return {int(layer): mine[layer] for layer in sorted(mine)}
    row = {int(layer): j for j, layer in enumerate(layers)}
    t = torch.zeros((len(layers), 2), dtype=torch.int64, device=device)
    for layer, (diff, seen) in mine.items():
        t[row[int(layer)]] += torch.tensor([diff, seen], device=device)
    dist.all_reduce(t)
    counts = t.cpu().tolist()
    return {int(layer): (counts[j][0], counts[j][1]) for j, layer in enumerate(layers)
            if counts[j][1] or int(layer) in mine}  # fmt: skip


def model_bytes(stage_bytes: int, tokens: int, sharded: bool, device="cpu") -> tuple[int, int]:
    """(bytes stored over the pipeline stages, the tokens they hold routing for): summed over
    the ranks that hold distinct rows and layers (TP rank 0, CP rank 0; of a whole batch,
    data-parallel rank 0 too), tokens over the first stage only, as one tensor all-reduce."""
    from megatron.core import parallel_state as mpu

    if dist.get_world_size() == 1:
        return stage_bytes, tokens
    holder = mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
    if not sharded:
        holder = holder and mpu.get_data_parallel_rank() == 0
    first = mpu.get_pipeline_model_parallel_rank() == 0
    values = [stage_bytes * holder, tokens * (holder and first)]
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t[0]), int(t[1])


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
