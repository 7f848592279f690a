"""The step's batch sharded at the source: rank 0 holds the rollouts, every rank receives only
what its place in the parallel layout trains on, as a few flat tensors (never pickled).

Which replica trains which row is fixed when the batch is made, by the step's minibatch split
(`minibatch_parts`: a seeded permutation of the rows cut into `algo.minibatches` parts, each
part sorted): row `part[j]` belongs to data-parallel replica `j % dp`, which is where the actor
would put it in that minibatch's update anyway. So a replica holds the same rows for the
old-log-prob pass and every update, and the log-probs and routing it records (R2) stay where they
were made.

A rank receives its replica's rows (tokens, loss mask, advantages, the rollout's log-probs) and,
under R3, the rollout server's routing for its pipeline stage's MoE layers only, in the smallest
integer type that holds an expert id (int32 where an id is out of range: the actor then reports
it). Tensor- and context-parallel peers of a replica receive the same rows, which is what their
layout needs. Nothing is sent where there is one process: the batch is used as it is.

Wire format, rank 0 to one rank (point-to-point; gloo on CPU tensors, NCCL on the device):
    head  int64 [8]       rows, tokens, the fields sent (bit k: FIELDS[k]), routing?,
                          routing ids, routing dtype code, 0, 0
    rows  int64 [n, 5]    global row, length, routing [rows (-1: none), columns, top-k]
    then each field the batch has, in registry order (train/batch.py FIELDS), in its wire
    dtype: [T] per token, [n] per sequence (a log-prob field's "none" is its NaN fill);
    routing ids [V]
(T: the rows' tokens, V: their routing ids, in row order). Nothing here names a field: a field
added to the registry travels as it is. The routing is the one part sent apart from it, since it
is cut to each rank's pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.model.parallel import device_type
from megatron_gspo.routing.storage import index_dtype
from megatron_gspo.train.batch import FIELDS, StepBatch

_DTYPES = {0: torch.uint8, 1: torch.int16, 2: torch.int32}
_CODES = {np.dtype(np.uint8): 0, np.dtype(np.int16): 1, np.dtype(np.int32): 2}


@dataclass(frozen=True)
class RankNeeds:
    """What one rank trains on: its data-parallel replica, and the decoder layer ids of its
    pipeline stage's MoE layers (the routing R3 replays there)."""

    dp_rank: int
    dp: int
    layers: tuple[int, ...] = ()
    num_layers: int = 0  # decoder layers of the model
    moe_layer_ids: tuple[int, ...] = ()
    num_experts: int = 0


def minibatch_parts(n: int, minibatches: int, seed: int, step: int) -> list[list[int]]:
    """The step's minibatches: a permutation of the `n` rows seeded by (seed, step), cut into
    `minibatches` parts (fewer when there are fewer rows), each sorted."""
    order = np.random.default_rng([seed, step]).permutation(n).tolist()
    return [sorted(p.tolist()) for p in np.array_split(order, minibatches) if len(p)]


def owners(parts: list[list[int]], n: int, dp: int) -> list[int]:
    """The data-parallel replica of each of the `n` rows: its place in its part, modulo dp."""
    out = [0] * n
    for part in parts:
        for j, row in enumerate(part):
            out[row] = j % dp
    return out


def needs_table(mine: RankNeeds) -> list[RankNeeds]:
    """Every rank's needs, on every rank (once per run, at the actor's start)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return table


# ---- packing -------------------------------------------------------------------------------


def pack(batch: StepBatch, rows: list[int], needs: RankNeeds) -> list[torch.Tensor]:
    """The wire tensors of `rows` of the whole batch `batch` for a rank with `needs`."""
    lengths = batch.lengths[torch.as_tensor(rows, dtype=torch.int64)]
    experts = [_stage_experts(batch, i, needs) for i in rows] if batch.rollout_experts else []
    dtype = _common_dtype([e for e in experts if e is not None], needs.num_experts)
    shapes = [(-1, 0, 0) if e is None else e.shape for e in experts] or [(-1, 0, 0)] * len(rows)
    table = torch.cat([torch.tensor(rows, dtype=torch.int64).view(-1, 1), lengths.view(-1, 1),
                       torch.tensor(shapes, dtype=torch.int64).view(-1, 3)], 1)  # fmt: skip
    at = batch.token_positions(rows)
    out = [batch[f.name][at if f.per_token else torch.as_tensor(rows, dtype=torch.int64)]
           .to(f.wire) for f in FIELDS if f.name in batch.fields]  # fmt: skip
    if experts:
        parts = [torch.from_numpy(np.ascontiguousarray(e, dtype=dtype).reshape(-1))
                 for e in experts if e is not None]  # fmt: skip
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=_DTYPES[_CODES[dtype]]))
    n_ids = out[-1].numel() if experts else 0
    present = sum(1 << k for k, f in enumerate(FIELDS) if f.name in batch.fields)
    head = torch.tensor([len(rows), int(lengths.sum()), present, int(bool(experts)), n_ids,
                         _CODES[dtype], 0, 0], dtype=torch.int64)  # fmt: skip
    return [head, table, *out]


def _stage_experts(batch: StepBatch, i: int, needs: RankNeeds) -> np.ndarray | None:
    """Sample i's rollout routing, cut to the stage's MoE layers when its shape allows (every
    decoder layer, or the MoE layers only, as servers send it); else as it came (the actor's
    alignment then says what is wrong with it)."""
    assert batch.rollout_experts is not None
    a = batch.rollout_experts[i]
    if a is None:
        return None
    a = np.asarray(a)
    if a.ndim != 3:  # (sent whole; the actor's alignment refuses it)
        return a.reshape(-1, 1, 1)
    if a.shape[1] == needs.num_layers:
        return a[:, list(needs.layers)]
    if a.shape[1] == len(needs.moe_layer_ids):
        return a[:, [needs.moe_layer_ids.index(layer) for layer in needs.layers]]
    return a


def _common_dtype(arrays: list[np.ndarray], num_experts: int) -> np.dtype:
    """The smallest id type for every array, int32 where an id is out of [0, num_experts)."""
    small = index_dtype(num_experts) if num_experts else np.dtype(np.int32)
    for a in arrays:
        if a.size and (a.min() < 0 or a.max() >= num_experts):
            return np.dtype(np.int32)
    return small


def unpack(tensors: list[torch.Tensor], total: int, layers: tuple[int, ...]) -> StepBatch:
    """The shard the wire tensors of `pack` describe (a shard of a `total`-row batch)."""
    head, table, *rest = [t.cpu() for t in tensors]
    n, _, present, has_experts, _, _, _, _ = head.tolist()
    sent = [f for k, f in enumerate(FIELDS) if present >> k & 1]
    fields = dict(zip([f.name for f in sent], rest))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(table[:, 1], 0)])
    batch = StepBatch(fields, cu, index=table[:, 0].tolist(), total=total)
    if has_experts:
        ids = rest[len(sent)].numpy()
        experts: list = []
        at = 0
        for _, _, r, cols, k in table.tolist():
            if r < 0:
                experts.append(None)
                continue
            size = r * cols * k
            experts.append(ids[at : at + size].reshape(r, cols, k))
            at += size
        batch.rollout_experts = experts
        batch.expert_layers = layers
    return batch


# ---- moving ---------------------------------------------------------------------------------


def distribute(
    batch: StepBatch | None,
    parts: list[list[int]],
    table: list[RankNeeds],
    *,
    device: torch.device | str = "cpu",
    stats: dict | None = None,
) -> StepBatch:
    """Rank 0's whole `batch` (None elsewhere) -> this rank's shard (collective over the world;
    `parts` and `table` the same on every rank). One process: the batch itself. `stats`, when
    given, gets this rank's received bytes ("bytes")."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        assert batch is not None
        return batch
    rank = dist.get_rank()
    n = sum(len(p) for p in parts)
    if rank == 0:
        assert batch is not None and len(batch) == n, "rank 0 holds the whole batch"
        owner = owners(parts, n, table[0].dp)
        rows: dict[int, list[int]] = {}
        for i, replica in enumerate(owner):
            rows.setdefault(replica, []).append(i)
        # ranks with the same needs (tensor- and context-parallel peers) get the same tensors:
        # packed once, and kept referenced until their sends complete
        wires: dict[RankNeeds, list[torch.Tensor]] = {}
        for needs in table:
            if needs not in wires:
                wires[needs] = [
                    t.to(device) for t in pack(batch, rows.get(needs.dp_rank, []), needs)
                ]
        pending = [dist.isend(t, dst) for dst in range(1, world) for t in wires[table[dst]]]
        for work in pending:
            if work is not None:
                work.wait()
        if stats is not None:
            stats["bytes"] = 0
        return unpack(wires[table[0]], n, table[0].layers)
    wire = _receive(device)
    if stats is not None:
        stats["bytes"] = sum(t.numel() * t.element_size() for t in wire)
    return unpack(wire, n, table[rank].layers)


def _receive(device) -> list[torch.Tensor]:
    head = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(head, 0)
    n, tokens, present, has_experts, n_ids, code, _, _ = head.tolist()
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = [((n, 5), torch.int64)]
    shapes += [((tokens if f.per_token else n,), f.wire)
               for k, f in enumerate(FIELDS) if present >> k & 1]  # fmt: skip
    if has_experts:
        shapes.append(((n_ids,), _DTYPES[code]))
    out = [head]
    for shape, dtype in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, 0)
        out.append(t)
    return out


def reduce_sums(pairs: list[list[float]]) -> list[list[float]]:
    """Per-rank [sum, count] pairs over a shard's rows, summed over the world: one tensor
    all-reduce, counting each replica once (its last pipeline stage's first tensor- and
    context-parallel rank, which holds its log-probs)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return pairs
    t = torch.tensor(pairs, dtype=torch.float64, device=device_type()) * float(reports_rows())
    dist.all_reduce(t)
    return t.cpu().tolist()


def reports_rows() -> bool:
    """Whether this rank counts its replica's rows in a sum over the world: its last pipeline
    stage's first tensor- and context-parallel rank, which holds their log-probs (the others
    hold NaN or the same values). True without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    from megatron.core import parallel_state as mpu

    return (
        mpu.is_pipeline_last_stage(ignore_virtual=True)
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
    )
