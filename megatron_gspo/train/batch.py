"""A batch of RL samples as the actor trains on it, and its split into microbatches.

Legend: b microbatch rows, s padded sequence length, S = s - 1 next-token positions.
Token-aligned fields follow `tokens`: entry t belongs to token t (its log-prob given tokens < t);
entry 0 is never trained on.

In the RL loop a rank holds a shard: its data-parallel replica's rows only (`index`: their rows in
the step's whole batch of `total` rows; train/shard.py sends them from rank 0), with R3 routing for
its pipeline stage's MoE layers only (`expert_layers`). A batch without `index` is whole: every
rank holds every row and the actor picks its replica's (tests, scoring tools). Either way every
replica gets the same number of full microbatches (empty rows have an all-zero mask), since
pipeline stages and expert-parallel collectives need equal shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RLBatch:
    tokens: list[list[int]]  # prompt + response
    loss_mask: list[list[int]]  # 1 on the response tokens that are trained on
    advantages: list[float] | list[list[float]]  # per sequence, or per token
    # token-aligned (None where no log-prob: position 0, the prompt); None until computed, and a
    # row None while only some rows are (train.loop._old_logprobs)
    old_logprobs: list[list[float | None] | None] | None = None
    rollout_logprobs: list[list[float | None]] | None = None  # token-aligned, from the server
    # R3: per sample, as Sample.routed_experts (int32 [len(tokens) - 1, layers, k]) or None
    rollout_experts: list | None = None
    # per-sample recorded routing (megatron_gspo.routing.SampleRouting); set by Actor.logprobs
    routing: list | None = None
    # a shard: these rows' places in the whole batch, and its size (None: this is the whole)
    index: list[int] | None = None
    total: int | None = None
    # the decoder layers the rollout_experts arrays hold, in order (None: as the server sent)
    expert_layers: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def sharded(self) -> bool:
        return self.index is not None

    @property
    def global_size(self) -> int:
        """Rows of the whole batch this holds (or is a shard of)."""
        return len(self) if self.total is None else self.total

    def global_index(self) -> list[int]:
        return list(range(len(self))) if self.index is None else list(self.index)

    def positions_of(self, rows: list[int]) -> list[int]:
        """Local positions of those of the whole batch's `rows` this holds (all, unsharded)."""
        if self.index is None:
            return list(rows)
        where = {g: j for j, g in enumerate(self.index)}
        return [where[g] for g in rows if g in where]

    def rows(self, index: list[int], total: int | None = None) -> RLBatch:
        """The rows at local positions `index`. Of a shard: a shard of a whole batch of `total`
        rows (the rows every replica holds of that sub-batch together)."""

        def pick(x):
            return None if x is None else [x[i] for i in index]

        return RLBatch(
            pick(self.tokens),
            pick(self.loss_mask),
            pick(self.advantages),
            pick(self.old_logprobs),
            pick(self.rollout_logprobs),
            pick(self.rollout_experts),
            pick(self.routing),
            index=pick(self.index),
            total=None if self.index is None else (len(index) if total is None else total),
            expert_layers=self.expert_layers,
        )


@dataclass
class TrainMicrobatch:
    tokens: torch.Tensor  # [b, s]
    mask: torch.Tensor  # [b, S] float, next-token loss mask
    advantages: torch.Tensor  # [b] or [b, S]
    old_logprobs: torch.Tensor | None  # [b, S]
    rollout_logprobs: torch.Tensor | None  # [b, S]
    index: torch.Tensor  # [b] row in the caller's batch, -1 for an empty row
    lengths: torch.Tensor | None = field(default=None)  # [b]
    logits_from: int = 0  # the first position whose logits are computed (the logits window)

    @property
    def position_ids(self) -> torch.Tensor:
        b, s = self.tokens.shape
        return torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)


def _padded(rows, b: int, s: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """[b, s] tensor of `rows` right-padded with `fill` (None entries too), built in one call."""
    rows = [r or [] for r in rows]  # (a None row: no values here, e.g. an earlier stage's)
    out = [[fill if v is None else v for v in r] + [fill] * (s - len(r)) for r in rows]
    out += [[fill] * s for _ in range(b - len(rows))]
    return torch.tensor(out, dtype=dtype)


def _token_field(rows, b: int, s: int, fill: float = 0.0) -> torch.Tensor:
    return _padded(rows, b, s, fill, torch.float32)[:, 1:]


def microbatches(
    batch: RLBatch, index: list[int], micro_batch_size: int, seq_len: int, window: bool = False
):
    """Full microbatches over `index` rows of `batch`, padded to [micro_batch_size, seq_len].

    `window`: each microbatch's `logits_from` is its first position with a loss (the shortest
    prompt's last token), so the logits of the prompts before it are never computed."""
    out = []
    n_micro = max(1, -(-len(index) // micro_batch_size))
    per_token_adv = bool(batch.advantages) and isinstance(batch.advantages[0], list)
    for m in range(n_micro):
        idx = index[m * micro_batch_size : (m + 1) * micro_batch_size]
        part = batch.rows(idx)
        b = micro_batch_size
        tokens = _padded(part.tokens, b, seq_len, 0, torch.long)
        mask = _token_field(part.loss_mask, b, seq_len)
        if per_token_adv:
            adv = _token_field(part.advantages, b, seq_len)
        else:
            adv = torch.zeros(b)
            adv[: len(idx)] = torch.tensor(part.advantages, dtype=torch.float32)
        old = None if part.old_logprobs is None else _token_field(part.old_logprobs, b, seq_len)
        roll = (
            None
            if part.rollout_logprobs is None
            else _token_field(part.rollout_logprobs, b, seq_len)
        )
        fill = b - len(idx)
        lengths = torch.tensor([len(t) for t in part.tokens] + [0] * fill)
        index_t = torch.tensor(list(idx) + [-1] * fill)
        start = 0
        if window and mask.any():  # the first position (column of `mask`) with a loss
            start = int(mask.any(0).int().argmax())
        out.append(TrainMicrobatch(tokens, mask, adv, old, roll, index_t, lengths, start))
    return out


def loss_mask_tensor(batch: RLBatch) -> torch.Tensor:
    """The batch's next-token loss mask [B, S], for counting the step's denominator."""
    if not len(batch):
        return torch.zeros((0, 0))  # (a shard without rows of this minibatch)
    s = max(len(t) for t in batch.tokens)
    return _token_field(batch.loss_mask, len(batch), s)
