"""Stream the policy's weights as full HF tensors, one pipeline stage per sender.

Each pipeline stage has one sender: its rank with TP rank 0 and data-parallel rank 0 (the rank
that writes the stage's non-expert tensors in `model.weights.iter_hf`). Tensors are gathered over
TP / expert-TP exactly as `iter_hf` does (the same functions, the same bridge mapping), by the
first data-parallel replica only (expert-DP for experts): the others hold the same tensors, and
whole TP, expert-TP and EP groups belong to one replica, so they skip those gathers together; experts
under EP are then gathered from the expert writers of the stage (expert-TP rank 0, expert-DP
rank 0: the sender's expert-parallel group) to the sender, and named through the bridge with each
EP rank's expert offset. So the sender yields every HF tensor of its stage exactly once and no
other rank yields anything, while every rank drives the iterator (the gathers are collectives).
The extra memory per rank is one full tensor (times EP on the sender for an expert weight).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_gspo.comm import bcast, rank
from megatron_gspo.model.bridge import get_bridge
from megatron_gspo.model.bridge.base import split
from megatron_gspo.model.lora import has_adapter
from megatron_gspo.model.weights import gather_full, local_params, shard_info

log = logging.getLogger(__name__)


def unwrap(chunks) -> list:
    """Model chunks without DDP / Float16Module wrappers (an Actor's `chunks` work as they are)."""
    out = []
    for c in chunks:
        while not hasattr(c, "model_spec") and hasattr(c, "module"):
            c = c.module
        out.append(c)
    return out


def is_stage_sender() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0


def stage_index() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_rank()


def num_stages() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_world_size()


class StageTurns:
    """Pipeline stages that send one after another, in stage order: every rank of stage s waits
    until stage s-1's sender is done before its first gather, on a key in the job's store. A
    wait there is the CPU's own: an NCCL recv of a token would return at once (it only makes the
    GPU stream wait) and let the stage's gathers and requests run ahead of the turn, and NCCL's
    watchdog counts a collective's time from when it is queued. Keys are unique to this object
    (a token every rank agrees on) and the sync's number; the key of the sync before is deleted
    when the next one is set (every rank has passed it: a sync ends with an all-gather)."""

    WAIT = timedelta(hours=6)  # a sender always passes the turn on; one that dies ends the job

    def __init__(self):
        """Every rank calls it (a collective: rank 0's token for all)."""
        self.token = bcast(uuid.uuid4().hex if rank() == 0 else None)
        self.stage, self.stages = stage_index(), num_stages()
        if self.stages > 1:  # then there are several ranks and a store
            self.store = dist.distributed_c10d._get_default_store()

    def _key(self, sync: int, stage: int) -> str:
        return f"megatron-gspo/weight-sync/{self.token}/{sync}/stage{stage}"

    def wait(self, sync: int) -> None:
        """Every rank of this stage, before its first gather of sync number `sync`."""
        if self.stage > 0:
            self.store.wait([self._key(sync, self.stage)], self.WAIT)

    def done(self, sync: int) -> None:
        """This stage's sender, when it is done (also after a failure): the next stage's turn."""
        if self.stage + 1 < self.stages:
            self.store.set(self._key(sync, self.stage + 1), "go")
            self.store.delete_key(self._key(sync - 1, self.stage + 1))


def all_gather_objects(obj) -> list:
    """`obj` of every rank, in rank order (just [obj] on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_sender_is_expert_root() -> None:
    from megatron.core import parallel_state as mpu

    if is_stage_sender() and (
        mpu.get_expert_model_parallel_rank() != 0
        or mpu.get_expert_tensor_parallel_rank() != 0
        or mpu.get_expert_data_parallel_rank() != 0
    ):
        raise RuntimeError(
            "the stage sender (TP rank 0, DP rank 0) is not expert rank 0 of its stage; "
            "this parallel-state order is not supported by the weight sync"
        )


def _layer_ids(chunk) -> dict[int, int]:
    return {j: layer.layer_number - 1 for j, layer in enumerate(chunk.decoder.layers)}


@torch.no_grad()
def iter_stage(chunks, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for every tensor of this rank's pipeline stage, on its sender.
    `changed_only`: skip frozen weights without a LoRA adapter (they stay the base model's,
    which every server starts from); the same on every rank, so the collectives match."""
    from megatron.core import parallel_state as mpu

    chunks = unwrap(chunks)
    _check_sender_is_expert_root()
    spec = chunks[0].model_spec
    bridge = get_bridge(spec.arch)
    geo = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, vocab=spec.vocab_size)
    ep = mpu.get_expert_model_parallel_world_size() if spec.is_moe else 1
    local_experts = spec.num_experts // ep if spec.is_moe else 0
    sender = is_stage_sender()
    # The first data-parallel replica (expert-DP for experts) gathers; the others' TP, expert-TP
    # and EP groups are replicas too, and would gather tensors nobody sends.
    first = {
        False: mpu.get_data_parallel_rank() == 0,
        True: mpu.get_expert_data_parallel_rank() == 0,
    }
    # Elsewhere nothing waits on the collectives: on a GPU (NCCL) a rank that is not the sender
    # would queue the whole stage's at once, and NCCL's watchdog counts each one's time from
    # when it was queued. So it queues the next one when the last is done.
    pace = not sender and next(chunks[0].parameters()).is_cuda
    for lp in local_params(chunks):
        if not first[lp.map.expert]:
            continue
        if changed_only and not lp.param.requires_grad and not has_adapter(lp.param):
            continue
        if pace:
            torch.cuda.current_stream().synchronize()
        if spec.tie_embeddings and lp.map.megatron_name == "output_layer.weight":
            continue  # the embedding carries it
        info = shard_info(lp.map)
        full = gather_full(lp, info)
        if not info.writer:
            continue  # another replica or TP rank holds the same tensor
        if not (lp.map.expert and ep > 1):
            if sender:
                yield from zip(lp.map.hf_names, split(lp.map, full, **geo))
            continue
        parts = _gather_to_sender(full, mpu.get_expert_model_parallel_group())
        if not sender:
            continue
        layer_ids = _layer_ids(chunks[lp.chunk])
        for r, part in enumerate(parts):
            pm = bridge.param_map(
                lp.map.megatron_name, layer_ids, r * local_experts, spec.tie_embeddings
            )
            yield from zip(pm.hf_names, split(pm, part, **geo))


def _gather_to_sender(t: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Every EP rank's `t` on EP rank 0 (the sender), in EP-rank order; None elsewhere."""
    t = t.contiguous()
    dst = dist.get_global_rank(group, 0)
    if dist.get_rank() == dst:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.gather(t, parts, dst=dst, group=group)
        return parts
    dist.gather(t, None, dst=dst, group=group)
    return None


def share_parameters(chunks) -> Callable[[torch.Tensor], bool] | None:
    """Move the storages that hold this rank's CPU parameters side by side (megatron DDP's
    parameter buffers) into shared memory (file-system names), in place, so the tensor transport
    can lend the servers views of them instead of copying them into buckets (see bucket.py,
    borrowed buckets). Returns the `borrow` test for `bucket.pack`, or None when nothing can be
    lent (GPU parameters: CUDA IPC; or no such buffer).

    Moving a storage in place keeps every view of it valid (the optimizer's too) and the
    training bit for bit the same. Parameters that own their storage (no DDP, or DDP without
    the distributed optimizer) are left where they are and copied into buckets as before:
    gathering them into one slab would change their memory layout, and with it the rounding
    of some kernels."""
    from megatron_gspo.rollout.weight_payload import TensorSharing

    groups = _parameter_buffers(chunks)
    moving = sum(
        g[0].untyped_storage().nbytes() for g in groups if not g[0].untyped_storage().is_shared()
    )
    if moving and moving > 0.8 * _shm_free():
        log.warning(
            "weight sync: %.2f GB of parameters do not fit in /dev/shm (%.2f GB free); "
            "copying them into buckets instead of lending them (enlarge /dev/shm, e.g. "
            "docker --shm-size)", moving / 1e9, _shm_free() / 1e9,
        )  # fmt: skip
        return None
    with TensorSharing():
        for group in groups:
            storage = group[0].untyped_storage()
            if not storage.is_shared():  # else moved already (an earlier WeightSync)
                storage.share_memory_()
    return _borrow_test(groups)


def buffer_parameters(chunks) -> Callable[[torch.Tensor], bool] | None:
    """The `borrow` test for `bucket.pack` of this rank's CPU parameters that live side by side
    in one storage (megatron DDP's parameter buffers), where they are: the distributed
    transport broadcasts them and the disk transport's shard writer writes them straight from
    there. None when there are none."""
    return _borrow_test(_parameter_buffers(chunks))


def _parameter_buffers(chunks) -> list[list[torch.Tensor]]:
    """This rank's CPU parameters grouped by storage, for storages that hold several (megatron
    DDP's buffers); [] when any parameter is on a GPU."""
    params = list({id(p): p for c in unwrap(chunks) for p in c.parameters()}.values())
    if not params or any(p.device.type != "cpu" for p in params):
        return []
    by_storage: dict[int, list] = {}
    for p in params:
        by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    return [g for g in by_storage.values() if len(g) > 1]


def _borrow_test(groups: list[list[torch.Tensor]]) -> Callable[[torch.Tensor], bool] | None:
    if not groups:
        return None
    storages = {g[0].untyped_storage().data_ptr() for g in groups}

    def borrow(t: torch.Tensor) -> bool:
        return (
            t.device.type == "cpu" and t.is_contiguous()
            and t.untyped_storage().data_ptr() in storages
        )  # fmt: skip

    return borrow


def _shm_free() -> int:
    """Free bytes of /dev/shm, where torch's file-system sharing puts shared storages."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
