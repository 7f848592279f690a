"""The step's batch: named tensor fields from one registry, flat over the step's tokens.

Legend: B rows (sequences), T = sum of their lengths (the step's tokens), cu = cu_seqlens [B + 1]
(row i holds the flat tokens cu[i] .. cu[i + 1]); in a microbatch b rows, s padded sequence
length, S = s - 1 next-token positions.

`FIELDS` is the one list of what a batch can carry: a field is per token ([T], flat, row i at
cu[i]:cu[i+1]) or per sequence ([B]), with its dtype, the dtype it travels in (train/shard.py)
and its fill (padding, and "none here": NaN for log-probs a position has none of). Selecting
rows, sending shards, padding into microbatches all iterate `FIELDS`; a new field (reference
log-probs, per-token rewards) is one line here plus the code that fills it and the code that uses
it. Token-aligned fields follow `tokens`: entry t belongs to token t (its log-prob given tokens
< t); entry 0 is never trained on.

Two per-row parts are not tensors: the rollout server's routing (R3: int arrays [len - 1, layers,
k], sliced per pipeline stage when sent) and the routing the actor records (`SampleRouting`).

In the RL loop a rank holds a shard: its data-parallel replica's rows only (`index`: their rows in
the step's whole batch of `total` rows; train/shard.py sends them from rank 0), with R3 routing for
its pipeline stage's MoE layers only (`expert_layers`). A batch without `index` is whole: every
rank holds every row and the actor picks its replica's (tests, scoring tools). Either way every
replica gets the same number of full microbatches (empty rows have an all-zero mask), since
pipeline stages and expert-parallel collectives need equal shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from megatron_gspo.errors import UserError


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    per_token: bool  # [T] flat over the tokens; else [B], one value per sequence
    fill: float  # padding, and where a row has no value (NaN: no log-prob at that position)
    wire: torch.dtype  # as train/shard.py sends it


FIELDS: tuple[Field, ...] = (
    Field("tokens", torch.int64, True, 0, torch.int32),  # prompt + response
    Field("loss_mask", torch.bool, True, 0, torch.uint8),  # the trained (response) tokens
    Field("advantages", torch.float32, False, 0.0, torch.float32),  # one per sequence
    Field("token_advantages", torch.float32, True, 0.0, torch.float32),  # or one per token
    Field("rewards", torch.float64, False, 0.0, torch.float64),  # the advantages' rewards
    Field("rollout_logprobs", torch.float32, True, math.nan, torch.float32),  # the server's
    Field("old_logprobs", torch.float32, True, math.nan, torch.float32),  # the trainer's
    Field("ref_logprobs", torch.float32, True, math.nan, torch.float32),  # the KL's reference
)
REGISTRY = {f.name: f for f in FIELDS}
LOGPROB_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs")


@dataclass
class StepBatch:
    fields: dict[str, torch.Tensor]  # registry name -> [T] or [B] tensor
    cu_seqlens: torch.Tensor  # int64 [B + 1]
    # R3: per row, as Sample.routed_experts (int32 [len - 1, layers, k]) or None
    rollout_experts: list | None = None
    # per-row recorded routing (megatron_gspo.routing.storage.SampleRouting); set by Actor.logprobs
    routing: list | None = None
    # a shard: these rows' places in the whole batch, and its size (None: this is the whole)
    index: list[int] | None = None
    total: int | None = None
    # the decoder layers the rollout_experts arrays hold, in order (None: as the server sent)
    expert_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.fields = dict(self.fields)
        for name, value in list(self.fields.items()):
            self.set(name, value)

    # ---- fields ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64, each row's tokens."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.fields:
            raise KeyError(f"the batch has no field {name!r} (it has {sorted(self.fields)})")
        return self.fields[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.fields.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        """Field `name` (a registry field), checked against its shape and cast to its dtype."""
        if name not in REGISTRY:
            raise UserError(f"{name!r} is not a batch field; add it to train/batch.py FIELDS")
        f = REGISTRY[name]
        size = self.num_tokens if f.per_token else len(self)
        if value.shape != (size,):
            raise ValueError(f"field {name}: shape {tuple(value.shape)}, expected ({size},)")
        self.fields[name] = value.to(device="cpu", dtype=f.dtype)

    def without(self, *names: str) -> StepBatch:
        """This batch without those fields (and their routing, when "routing" is named)."""
        kept = {k: v for k, v in self.fields.items() if k not in names}
        return replace(self, fields=kept, routing=None if "routing" in names else self.routing)

    def row_values(self, name: str) -> list:
        """A field as Python rows (tests, tools): per token a list per row, NaN as None."""
        values = self[name]
        return self.to_rows(values) if REGISTRY[name].per_token else values.tolist()

    def to_rows(self, values: torch.Tensor) -> list[list]:
        """A [T] tensor over this batch's tokens as Python rows, NaN as None."""
        cu = self.cu_seqlens.tolist()
        flat = values.tolist()
        nan = values.is_floating_point()
        return [[None if nan and v != v else v for v in flat[a:b]] for a, b in zip(cu, cu[1:])]

    # ---- rows --------------------------------------------------------------------------

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

    def token_positions(self, rows: list[int] | torch.Tensor) -> torch.Tensor:
        """The flat positions of `rows`' tokens, row after row: [sum of their lengths]."""
        rows_t = torch.as_tensor(rows, dtype=torch.int64)
        lens = self.lengths[rows_t]
        before = torch.cumsum(lens, 0) - lens  # where each row starts in the output
        shift = torch.repeat_interleave(self.cu_seqlens[:-1][rows_t] - before, lens)
        return torch.arange(int(lens.sum())) + shift

    def rows(self, index: list[int], total: int | None = None) -> StepBatch:
        """The rows at local positions `index`. Of a shard: a shard of a whole batch of `total`
        rows (the rows every replica holds of that sub-batch together)."""
        at = self.token_positions(index)
        rows_t = torch.as_tensor(index, dtype=torch.int64)
        fields = {k: v[at] if REGISTRY[k].per_token else v[rows_t] for k, v in self.fields.items()}
        lens = self.lengths[rows_t]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])

        def pick(x):
            return None if x is None else [x[i] for i in index]

        return StepBatch(
            fields, cu, pick(self.rollout_experts), pick(self.routing), index=pick(self.index),
            total=None if self.index is None else (len(index) if total is None else total),
            expert_layers=self.expert_layers,
        )  # fmt: skip

    def set_rows(self, name: str, index: list[int], values: torch.Tensor) -> None:
        """Field `name` of the rows at local positions `index` from `values` (that field of
        `self.rows(index)`); the field is made, all fill, where the batch has none yet."""
        f = REGISTRY[name]
        if name not in self.fields:
            size = self.num_tokens if f.per_token else len(self)
            self.fields[name] = torch.full((size,), f.fill, dtype=f.dtype)
        at = self.token_positions(index) if f.per_token else torch.as_tensor(index)
        self.fields[name][at] = values.to(f.dtype)

    def padded(self, name: str, index: list[int], b: int, s: int) -> torch.Tensor:
        """Field `name` of the rows `index` as [b, s] (per sequence: [b]), right-padded with the
        field's fill; rows past len(index) are all fill."""
        f = REGISTRY[name]
        if not f.per_token:
            out = torch.full((b,), f.fill, dtype=f.dtype)
            out[: len(index)] = self[name][torch.as_tensor(index, dtype=torch.int64)]
            return out
        out = torch.full((b, s), f.fill, dtype=f.dtype)
        lens = self.lengths[torch.as_tensor(index, dtype=torch.int64)]
        row = torch.repeat_interleave(torch.arange(len(index)), lens)
        before = torch.cumsum(lens, 0) - lens
        col = torch.arange(int(lens.sum())) - torch.repeat_interleave(before, lens)
        out[row, col] = self[name][self.token_positions(index)]
        return out

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_rows(
        cls,
        tokens: list[list[int]],
        loss_mask: list[list[int]],
        advantages: list[float] | list[list[float]],
        *,
        old_logprobs: list | None = None,
        rollout_logprobs: list | None = None,
        rollout_experts: list | None = None,
    ) -> StepBatch:
        """A batch from Python rows (None entries of log-prob rows: none at that position)."""
        lens = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        per_token_adv = bool(advantages) and isinstance(advantages[0], list)
        rows = {"tokens": tokens, "loss_mask": loss_mask, "old_logprobs": old_logprobs,
                "rollout_logprobs": rollout_logprobs,
                "token_advantages" if per_token_adv else "advantages": advantages}  # fmt: skip
        fields = {k: _flat(REGISTRY[k], v, lens) for k, v in rows.items() if v is not None}
        return cls(fields, cu, rollout_experts)


def _flat(f: Field, rows: list, lens: torch.Tensor) -> torch.Tensor:
    if not f.per_token:
        return torch.tensor(rows, dtype=f.dtype)
    out = []
    for r, n in zip(rows, lens.tolist()):
        r = [f.fill if v is None else v for v in (r or [])][:n]
        out.extend(r + [f.fill] * (n - len(r)))
    return torch.tensor(out, dtype=f.dtype)


def RLBatch(tokens, loss_mask, advantages, old_logprobs=None, rollout_logprobs=None,
            rollout_experts=None) -> StepBatch:  # fmt: skip
    """The earlier constructor's call (Python rows): a `StepBatch.from_rows`."""
    return StepBatch.from_rows(
        tokens, loss_mask, advantages, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, rollout_experts=rollout_experts,
    )  # fmt: skip


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
    ref_logprobs: torch.Tensor | None = field(default=None, kw_only=True)  # [b, S] (algo.kl_coef)

    @property
    def position_ids(self) -> torch.Tensor:
        b, s = self.tokens.shape
        return torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)


def microbatches(
    batch: StepBatch, index: list[int], micro_batch_size: int, seq_len: int, window: bool = False
) -> list[TrainMicrobatch]:
    """Full microbatches over `index` rows of `batch`, padded to [micro_batch_size, seq_len].

    Log-prob fields have no value (NaN) where nothing is trained (position 0, prompts, padding):
    there they are 0, as the loss multiplies them by a zero mask (a NaN would survive it).
    `window`: each microbatch's `logits_from` is its first position with a loss (the shortest
    prompt's last token), so the logits of the prompts before it are never computed."""
    out = []
    b = micro_batch_size
    for m in range(max(1, -(-len(index) // b))):
        idx = index[m * b : (m + 1) * b]
        mask = batch.padded("loss_mask", idx, b, seq_len)[:, 1:].float()
        adv_name = "token_advantages" if "token_advantages" in batch.fields else "advantages"
        adv = batch.padded(adv_name, idx, b, seq_len)
        lps = [
            _trained_values(batch.padded(k, idx, b, seq_len)[:, 1:], mask)
            if k in batch.fields else None
            for k in ("old_logprobs", "rollout_logprobs", "ref_logprobs")
        ]  # fmt: skip
        lengths = torch.zeros(b, dtype=torch.int64)
        lengths[: len(idx)] = batch.lengths[torch.as_tensor(idx, dtype=torch.int64)]
        index_t = torch.tensor(list(idx) + [-1] * (b - len(idx)))
        start = 0
        if window and mask.any():  # the first position (column of `mask`) with a loss
            start = int(mask.any(0).int().argmax())
        out.append(TrainMicrobatch(
            batch.padded("tokens", idx, b, seq_len), mask,
            adv[:, 1:] if adv.dim() == 2 else adv, lps[0], lps[1], index_t, lengths, start,
            ref_logprobs=lps[2],
        ))  # fmt: skip
    return out


def _trained_values(values_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """0 where a log-prob field has none and nothing is trained."""
    return torch.where(values_BS.isnan() & (mask_BS == 0), 0.0, values_BS)


def loss_mask_tensor(batch: StepBatch) -> torch.Tensor:
    """The batch's next-token loss mask [B, S], for counting the step's denominator."""
    if not len(batch):
        return torch.zeros((0, 0))  # (a shard without rows of this minibatch)
    s = int(batch.lengths.max())
    return batch.padded("loss_mask", list(range(len(batch))), len(batch), s)[:, 1:].float()


def scatter_token_logprobs(
    flat_T: torch.Tensor, cu_seqlens: torch.Tensor, mb: TrainMicrobatch, lp_bS: torch.Tensor
) -> None:
    """A microbatch's next-token log-probs lp [b, S] into the token-aligned flat field [T]:
    column t of row r is token t + 1 of row mb.index[r], from its logits window on."""
    real = (mb.index >= 0).cpu()
    rows, lens = mb.index.cpu()[real], mb.lengths.cpu()[real] if mb.lengths is not None else None
    assert lens is not None, "a training microbatch knows its rows' lengths"
    t = torch.arange(lp_bS.shape[1])
    valid = (t[None] >= mb.logits_from) & (t[None] < lens[:, None] - 1)
    target = cu_seqlens[rows][:, None] + 1 + t[None]
    flat_T[target[valid]] = lp_bS.detach()[real.to(lp_bS.device)].float().cpu()[valid]
