"""How the actor lays a batch out in microbatches: padded rows, or packed sequences under a
token budget (train/packing.py); the same number of microbatches on every data-parallel replica,
as pipeline stages and expert-parallel collectives need."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.model.forward import on_device, padded_length
from megatron_gspo.train.batch import StepBatch, microbatches
from megatron_gspo.train.packing import packed_layout

# Logits one forward-only microbatch may produce (1 GiB in fp32) when it takes more rows than a
# training microbatch; a large-vocabulary model at a real sequence length stays at the training
# size, a small one scores its whole share of the batch at once.
_FORWARD_LOGITS = 1 << 28


class MicrobatchLayout:
    """The actor's microbatch layout (a mixin: it reads the actor's parallel layout, `dp`,
    `dp_rank`, `tp`, `pp`, `chunks`, `spec`, `device`, `max_tokens`, `_dp_group`)."""

    dp: int
    dp_rank: int
    tp: int
    pp: int
    chunks: list[Any]
    spec: Any
    device: torch.device
    max_tokens: int | None
    _dp_group: Any

    def _extent(self, batch: StepBatch) -> tuple[int, int]:
        """(the most rows a replica holds, the longest row): of a shard, over every replica
        (one all-reduce over the data-parallel group)."""
        longest = int(batch.lengths.max()) if len(batch) else 1
        if not batch.sharded:
            return -(-len(batch) // self.dp), longest
        if self.dp == 1:
            return len(batch), longest
        t = torch.tensor([len(batch), longest], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._dp_group)
        return int(t[0]), int(t[1])

    def _layout(self, batch: StepBatch, micro_batch_size: int, window: bool = False,
                budget: int | None = None):  # fmt: skip
        """This replica's microbatches (on the device), the schedule's sequence length, dp:
        packed under a token budget when the actor packs, else padded rows."""
        if self.max_tokens is not None:
            index = self._replica_rows(batch)
            groups = self.pp if len(self.chunks) > 1 else 1  # (interleaved: groups of pp)
            mbs = packed_layout(batch, index, budget or self.max_tokens, self.tp, self._dp_group,
                                groups)  # fmt: skip
            seq_len = max(mb.tokens.shape[1] for mb in mbs)
            return [on_device(mb, self.device) for mb in mbs], seq_len, self.dp
        dp = self.dp
        per_rank, longest = self._extent(batch)
        seq_len = padded_length(longest, self.tp)
        # Same number of microbatches on every replica (expert-parallel collectives span them).
        mbs = microbatches(batch, self._replica_rows(batch), micro_batch_size, seq_len, window)
        n_micro = max(1, -(-per_rank // micro_batch_size))
        while len(mbs) < n_micro:
            mbs += microbatches(batch, [], micro_batch_size, seq_len)
        return [on_device(mb, self.device) for mb in mbs], seq_len, dp

    def _replica_rows(self, batch: StepBatch) -> list[int]:
        if batch.sharded:
            return list(range(len(batch)))  # a shard: every row is this replica's
        return list(range(self.dp_rank, len(batch), self.dp))

    def _fitted_micro_batch(self, batch: StepBatch, micro_batch_size: int) -> int:
        """Rows per forward-only microbatch: the replica's whole share if its logits fit in
        `_FORWARD_LOGITS`, else as many as fit, never fewer than `micro_batch_size`. Pipeline
        stages overlap microbatches, so under PP their number is kept. The same on every rank."""
        if self.pp > 1:
            return micro_batch_size
        per_rank, longest = self._extent(batch)
        seq_len = padded_length(longest, self.tp)
        fits = _FORWARD_LOGITS // (seq_len * -(-self.spec.vocab_size // self.tp))
        return max(micro_batch_size, min(per_rank, fits))

    def _fitted_budget(self) -> int | None:
        """Tokens per packed forward-only microbatch: as many as `_FORWARD_LOGITS` logits hold,
        never fewer than the training budget (none under PP: stages overlap microbatches)."""
        if self.max_tokens is None or self.pp > 1:
            return None
        return max(self.max_tokens, _FORWARD_LOGITS // -(-self.spec.vocab_size // self.tp))
