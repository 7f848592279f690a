"""Tensor (colocated): /update_weights_from_tensor with a flattened_bucket payload. Buffers are
allocated in shared memory ("file_system" strategy) on CPU and on the GPU otherwise (CUDA IPC), so
serializing a bucket copies nothing: the payload holds a shared-memory file name or IPC handle, and
the server copies the bytes straight into its weights. A buffer is reused once every server has
answered (the server has copied it by then). A borrowed bucket (a span of the trainer's parameter
buffer, lent in place; bucket.py) needs no buffer back, so two of those are in flight at a time.
"""

from __future__ import annotations

import torch

from megatron_gspo.rollout import weight_payload as wp
from megatron_gspo.weight_sync import gather
from megatron_gspo.weight_sync.bucket import Bucket
from megatron_gspo.weight_sync.servers import collect
from megatron_gspo.weight_sync.transports.base import StageContext, Transport


class TensorTransport(Transport):
    name = "tensor"
    relays = True

    def lend(self, chunks: list) -> object:
        return gather.share_parameters(chunks)  # to the servers, in shared memory

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        with wp.TensorSharing():  # shared memory by file name, which the server can open
            return torch.empty(nbytes, dtype=torch.uint8).share_memory_()

    def send(self, bucket: Bucket, ctx: StageContext) -> dict[int, str]:
        base = {
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "abort_all_requests": False,
            "weight_version": ctx.version_for_bucket(),
        }

        def body(i: int) -> dict:
            # One serialization per receiving rank: each one takes a reference on the shared
            # memory that the receiver gives back, so a payload must not be read twice.
            with wp.TensorSharing():
                payloads = [wp.serialize(bucket.payload()) for _ in range(tp[i])]
            return {"serialized_named_tensors": payloads, **base}

        tp = {i: ctx.servers.refs[i].tp_size for i in ctx.live}
        ctx.touched.update(ctx.live)
        futures = {i: ctx.servers.submit(i, "/update_weights_from_tensor", body(i)) for i in tp}
        bucket.sum()  # while the servers copy
        # A borrowed bucket (the trainer's own parameters) has no buffer to give back, so its
        # answers are awaited after the next bucket is posted: a server decodes that request
        # while it loads this one. A pooled buffer goes back only once every server has copied.
        errors = self._answers(ctx, *ctx.state.pop("pending", ({}, None, tp)))
        shared = bucket.flat.untyped_storage() if bucket.flat.device.type == "cpu" else None
        sent = (futures, shared, tp)
        if bucket.borrowed:
            ctx.state["pending"] = sent
        else:
            for i, msg in self._answers(ctx, *sent).items():
                errors.setdefault(i, msg)
        return errors

    def _answers(self, ctx: StageContext, futures: dict, storage, tp: dict) -> dict[int, str]:
        """The servers' answers (errors by server). Each payload's pickle took a reference on
        the bucket's shared memory; torch's receiver (SGLang) gives it back, a server that maps
        it read-only (the built-in one: `released_shared_memory: false`) does not, so it is
        given back here, else the memory would outlive the bucket."""
        answers, errors = collect(futures)
        keeps = ctx.servers.keeps_shared_refs
        for i, answer in answers.items():
            if answer.get(wp.RELEASED) is False:
                keeps.add(ctx.servers.refs[i].url)
        if storage is not None:
            for i in futures:
                if ctx.servers.refs[i].url in keeps:
                    for _ in range(tp[i]):
                        storage._shared_decref()
        return errors

    def close_stage(self, ctx: StageContext) -> None:
        errors = self._answers(ctx, *ctx.state.pop("pending", ({}, None, {})))
        ctx.fail(errors)  # (the last borrowed bucket's answers)
