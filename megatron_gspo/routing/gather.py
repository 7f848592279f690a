"""Assemble the routing captured during a forward sweep into per-sample host arrays.

Every rank captured, for each of its microbatches, its own router tokens (its data-parallel
rows, its sequence-parallel / context-parallel positions) for the MoE layers of its pipeline
stage: a [M, L, N, k] tensor. The ranks of one stage hold the same layers. With a whole batch
on every rank (tests, tools) all of them need every sample (a later minibatch may put any sample
on any replica), so they all-gather within the stage's tensor x data x context parallel group;
with the RL loop's shard (train/shard.py) a replica keeps its own rows for every update, so only
its tensor x context parallel peers, which hold other positions of the same rows, gather. The
layers of other stages never reach them. Equal shapes on every member: a plain all_gather.

Legend: M microbatches, L MoE layers of this stage, N router tokens per microbatch, b rows,
k top-k, n tokens of a sample.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.routing.layout import TokenLayout


def gather_stage(
    captured_MLNk: torch.Tensor,
    rows_Mb: torch.Tensor,
    layout: TokenLayout,
    seq_len: int,
    lengths: list[int],
    within_replica: bool = False,
) -> dict[int, np.ndarray]:
    """{sample: [n, L, k]} for every sample any rank of this stage captured (`within_replica`:
    of this data-parallel replica)."""
    from megatron.core import parallel_state as mpu

    if within_replica:
        group = mpu.get_tensor_and_context_parallel_group()
    else:
        group = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
    size = dist.get_world_size(group)
    header = torch.tensor([layout.tp_rank, layout.cp_rank], device=captured_MLNk.device)
    rows_Mb = rows_Mb.to(captured_MLNk.device)
    parts = [_all_gather(t, group, size) for t in (captured_MLNk, rows_Mb, header)]
    out: dict[int, np.ndarray] = {}
    for data, rows, head in zip(*parts):
        member = TokenLayout(
            tp_rank=int(head[0]),
            tp=layout.tp,
            sequence_parallel=layout.sequence_parallel,
            cp_rank=int(head[1]),
            cp=layout.cp,
        )
        _scatter(out, data.cpu().numpy(), rows.cpu().numpy(), member.positions(seq_len), lengths)
    return out


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _scatter(out: dict, data_MLNk, rows_Mb, positions, lengths) -> None:
    m_count, n_layers, _, k = data_MLNk.shape
    b = rows_Mb.shape[1]
    grid = data_MLNk.reshape(m_count, n_layers, len(positions), b, k)
    for m in range(m_count):
        for r, i in enumerate(rows_Mb[m].tolist()):
            if i < 0:
                continue
            n = lengths[i]
            arr = out.get(i)
            if arr is None:
                arr = out[i] = np.zeros((n, n_layers, k), dtype=data_MLNk.dtype)
            sel = positions < n
            arr[positions[sel]] = grid[m, :, :, r][:, sel].transpose(1, 0, 2)
