"""Assemble the routing captured during a forward sweep into per-sample host arrays.

Every rank captured, for each of its microbatches, its own router tokens (its data-parallel
rows, its sequence-parallel / context-parallel positions) for the MoE layers of its pipeline
stage: a [M, L, N, k] tensor. The ranks of one stage hold the same layers. With a whole batch
on every rank (tests, tools) all of them need every sample (a later minibatch may put any sample
on any replica), so they all-gather within the stage's tensor x data x context parallel group;
with the RL loop's shard (train/shard.py) a replica keeps its own rows for every update, so only
its tensor x context parallel peers, which hold other positions of the same rows, gather. The
layers of other stages never reach them. Equal shapes on every member: a plain all_gather.

Legend: M microbatches, L MoE layers of this stage, N router tokens per microbatch (the most
of any), k top-k, n tokens of a sample.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_stage(
    captured_MLNk: torch.Tensor,
    maps_M2N: torch.Tensor,
    lengths: list[int],
    within_replica: bool = False,
) -> dict[int, np.ndarray]:
    """{sample: [n, L, k]} for every sample any rank of this stage captured (`within_replica`:
    of this data-parallel replica). `maps_M2N`: each router token's (sample row, position),
    -1 where none (layout.token_map)."""
    from megatron.core import parallel_state as mpu

    if within_replica:
        group = mpu.get_tensor_and_context_parallel_group()
    else:
        group = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
    size = dist.get_world_size(group)
    maps_M2N = maps_M2N.to(captured_MLNk.device)
    if size > 1:  # packed microbatches: members may hold more or fewer tokens; pad to the most
        n = torch.tensor([captured_MLNk.shape[2]], device=captured_MLNk.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        grow = int(n) - captured_MLNk.shape[2]
        captured_MLNk = F.pad(captured_MLNk, (0, 0, 0, grow))
        maps_M2N = F.pad(maps_M2N, (0, grow), value=-1)
    parts = [_all_gather(t, group, size) for t in (captured_MLNk, maps_M2N)]
    out: dict[int, np.ndarray] = {}
    for data, maps in zip(*parts):
        _scatter(out, data.cpu().numpy(), maps.cpu().numpy(), lengths)
    return out


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _scatter(out: dict, data_MLNk, maps_M2N, lengths) -> None:
    _, n_layers, _, k = data_MLNk.shape
    for m in range(data_MLNk.shape[0]):
        rows, pos = maps_M2N[m]
        for i in np.unique(rows[rows >= 0]).tolist():
            n = lengths[i]
            arr = out.get(i)
            if arr is None:
                arr = out[i] = np.zeros((n, n_layers, k), dtype=data_MLNk.dtype)
            sel = (rows == i) & (pos < n)
            arr[pos[sel]] = data_MLNk[m][:, sel].transpose(1, 0, 2)
