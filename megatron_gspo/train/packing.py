"""Token-budget microbatches: whole sequences packed into one flat row each (THD), no padding
between them.

Planning (`plan_bins`): worst-fit decreasing. Sequences are taken longest first; each goes to
the open microbatch with the FEWEST tokens that still has room for it under the budget, else to
a new one. Taking the least-loaded bin (not the first that fits) balances the microbatches'
token counts, which is what a pipeline's bubbles and the replicas' waits depend on; the count of
microbatches is that of first-fit decreasing in all but contrived cases (at most
11/9 OPT + 1). A sequence longer than the budget gets a microbatch of its own. Every
data-parallel replica must run the same number of microbatches (expert-parallel collectives and
the loss scale span them): `plan_bins(..., at_least=M)` spreads a replica's sequences over M
microbatches where it needed fewer (still least-loaded first), and a replica with fewer
sequences than M gets empty ones.

A packed microbatch holds its b sequences as tokens [1, t] (t: their tokens, plus a tail of
padding to a multiple of the tensor-parallel size, as sequence parallelism splits t) with
megatron-core's `PackedSeqParams` (qkv_format "thd", cu_seqlens over the sequences and the tail
as one more segment; rotary positions restart at each sequence). Its per-token training fields
(mask, advantages, old and rollout log-probs) are kept in the padded [b, S] layout of its own
sequences, so the loss code is the padded path's: `unpack` gathers the model's next-token
log-probs [1, t - 1] into that layout (column j of row r: token j + 1 of sequence r).

Legend: b sequences in the microbatch, t packed tokens, S = (longest of them) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.train.batch import StepBatch, TrainMicrobatch, microbatches


def plan_bins(lengths: list[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Positions of `lengths` per microbatch (worst-fit decreasing under `budget` tokens, at
    least `at_least` microbatches; each microbatch's positions in ascending order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(at_least)]
    load = [0] * at_least
    for i in order:
        n = lengths[i]
        fits = [k for k in range(len(bins)) if load[k] + n <= budget or not bins[k]]
        if fits:
            k = min(fits, key=lambda k: (load[k], k))
        else:
            bins.append([])
            load.append(0)
            k = len(bins) - 1
        bins[k].append(i)
        load[k] += n
    return [sorted(b) for b in bins]


@dataclass
class PackedMicrobatch(TrainMicrobatch):
    """A TrainMicrobatch whose `tokens` are [1, t] packed sequences; its other fields are
    its sequences' ([b], [b, S]) as in the padded path."""

    cu_seqlens: torch.Tensor | None = None  # int32 [b + 2]: the sequences, then the tail
    max_seqlen: int = 0

    @property
    def position_ids(self) -> torch.Tensor:
        """[1, t]: each sequence's positions from 0 (and the tail's)."""
        cu = self.cu_seqlens.to(torch.int64)  # type: ignore[union-attr]
        lens = cu[1:] - cu[:-1]
        t = torch.arange(int(cu[-1]), device=cu.device)
        return (t - torch.repeat_interleave(cu[:-1], lens)).unsqueeze(0)

    def packed_seq_params(self, cp_group=None):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen, cp_group=cp_group,
        )  # fmt: skip

    def unpack(self, values_1t: torch.Tensor) -> torch.Tensor:
        """Next-token values [1, t - 1] (column p: token p + 1 of the flat row) -> [b, S]
        (row r, column j: token j + 1 of sequence r; 0 past its end)."""
        cu = self.cu_seqlens.to(device=values_1t.device, dtype=torch.int64)  # type: ignore[union-attr]
        b, s = self.mask.shape
        j = torch.arange(s, device=values_1t.device)
        at = cu[:b, None] + j[None]
        valid = j[None] < (cu[1 : b + 1] - cu[:b] - 1)[:, None]
        picked = values_1t[0, at.clamp(max=values_1t.shape[1] - 1)]
        return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    def token_map(self, positions) -> tuple:
        """(sequence row in the batch, its position) of each packed position in `positions`
        (numpy; -1 for the tail)."""
        import numpy as np

        cu = self.cu_seqlens.cpu().numpy().astype(np.int64)  # type: ignore[union-attr]
        index = self.index.cpu().numpy()
        seg = np.searchsorted(cu, positions, side="right") - 1
        real = seg < len(index)
        rows = np.where(real, index[np.minimum(seg, len(index) - 1)], -1)
        return rows, np.where(real, positions - cu[np.minimum(seg, len(cu) - 1)], -1)


def packed(mb) -> bool:
    """Whether a microbatch is packed (THD)."""
    return isinstance(mb, PackedMicrobatch)


def packed_microbatches(
    batch: StepBatch, bins: list[list[int]], multiple: int, same_length: bool = False
) -> list[PackedMicrobatch]:
    """One packed microbatch per bin (positions in `batch`); t padded to `multiple`, or with
    `same_length` to the longest microbatch's t (the interleaved schedule's stages exchange
    one activation shape)."""
    out = []
    total = [int(batch.lengths[torch.as_tensor(b, dtype=torch.int64)].sum()) for b in bins]
    floor = max(total) if same_length else 0
    for rows in bins:
        lens = batch.lengths[torch.as_tensor(rows, dtype=torch.int64)].tolist() if rows else []
        longest = max(lens, default=1)
        real = sum(lens)
        # (at least 2 tokens: an empty microbatch still has a next-token position, masked)
        t = max(-(-max(real, floor) // multiple) * multiple, -(-2 // multiple) * multiple)
        (padded,) = microbatches(batch, rows, max(len(rows), 1), longest if rows else t)
        tokens = torch.zeros((1, t), dtype=torch.int64)
        if rows:
            tokens[0, :real] = batch["tokens"][batch.token_positions(rows)]
        cu = [0, *torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).tolist()]
        if t > real or not rows:
            cu.append(t)
        mb = PackedMicrobatch(
            tokens, padded.mask, padded.advantages, padded.old_logprobs, padded.rollout_logprobs,
            padded.index, padded.lengths, 0, torch.tensor(cu, dtype=torch.int32),
            max(longest, t - real), ref_logprobs=padded.ref_logprobs,
        )  # fmt: skip
        out.append(mb)
    return out


def packed_layout(batch: StepBatch, index: list[int], budget: int, tp: int, dp_group=None,
                  multiple: int = 1):  # fmt: skip
    """A replica's rows `index` of `batch` as packed microbatches of at most `budget` tokens,
    as many on every data-parallel replica (collective over `dp_group` when it has peers), a
    multiple of `multiple` (the interleaved schedule runs them in groups of pp; it also gets
    them at one length: its stages exchange activations of one shape)."""
    lens = batch.lengths[torch.as_tensor(index, dtype=torch.int64)].tolist() if index else []
    bins = plan_bins(lens, budget) if lens else [[]]
    count = -(-_most(len(bins), dp_group) // multiple) * multiple
    while True:  # (every rank takes the same turns: `count` is the same on all of them)
        if len(bins) < count:  # spread over as many as the replica with the most
            bins = plan_bins(lens, budget, at_least=count) if lens else [[]] * count
        grown = -(-_most(len(bins), dp_group) // multiple) * multiple
        if grown == count:
            break
        count = grown
    while len(bins) < count:  # (fewer rows than microbatches: empty ones)
        bins.append([])
    rows = [[index[p] for p in b] for b in bins]
    return packed_microbatches(batch, rows, tp, same_length=multiple > 1)


def _most(n: int, group) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return n
    from megatron_gspo.model.parallel import device_type

    t = torch.tensor([n], dtype=torch.int64, device=device_type())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def token_logprobs(mb: TrainMicrobatch, logits: torch.Tensor, vocab: int,
                   with_entropy: bool = False, head=None, trained_only: bool = False):  # fmt: skip
    """Next-token log-probs (and entropy) [b, S] of a microbatch's logits (its hidden states
    under the chunked LM head `head`, model/lm_head.py): a packed one's gathered from its flat
    row into its sequences' layout (`unpack`). `trained_only`: under the head, the log-probs of
    the positions with a loss (`mb.mask`) only, 0 elsewhere (prompts: their logits are never
    formed), which must then have no gradient there."""
    from megatron_gspo.model.forward import next_token_logprobs

    rows = head_rows(mb, logits.shape[1]) if trained_only and head is not None else None
    lp, ent = next_token_logprobs(logits, mb.tokens, vocab, with_entropy=with_entropy, head=head,
                                  rows=rows)  # fmt: skip
    if isinstance(mb, PackedMicrobatch):
        lp = mb.unpack(lp)
        ent = None if ent is None else mb.unpack(ent)
    return lp, ent


def trained_only_values(mb: TrainMicrobatch, values_bS: torch.Tensor) -> torch.Tensor:
    """[b, S] values with NaN where no token has a loss (`mb.mask`): what `trained_only`
    log-probs hold there is no value."""
    return torch.where(mb.mask > 0, values_bS, float("nan"))


def head_rows(mb: TrainMicrobatch, width: int) -> torch.Tensor:
    """The positions (ascending) of the head's flat [b, width] hidden states that predict a
    token with a loss: a packed microbatch's row r, column j of `mask` is flat position
    cu_seqlens[r] + j; a padded one's, r * width + j - (s - width) (its logits window)."""
    r, j = (mb.mask > 0).nonzero(as_tuple=True)
    if isinstance(mb, PackedMicrobatch):
        cu = mb.cu_seqlens.to(device=r.device, dtype=torch.int64)  # type: ignore[union-attr]
        return cu[r] + j
    return r * width + j - (mb.tokens.shape[1] - width)


def packing_budget(budget: int | None, config) -> int | None:
    """The actor's token budget (None: padded), checked against what megatron's THD path needs
    here: no context parallelism (its THD split is not wired), and variable sequence lengths
    between pipeline stages (set here)."""
    from megatron.core import parallel_state as mpu

    from megatron_gspo.errors import UserError

    if budget is None:
        return None
    if mpu.get_context_parallel_world_size() > 1:
        raise UserError(
            "train.pack with context parallelism is not supported; set train.pack=false"
        )
    if config.pipeline_model_parallel_size > 1 and not config.virtual_pipeline_model_parallel_size:
        config.variable_seq_lengths = True  # (1F1B; the interleaved one gets equal lengths)
    return budget
