"""Run the policy over a batch of token sequences with megatron's pipeline schedules.

Sequences are right-padded to one length (a multiple of TP, as sequence parallelism requires);
causal attention makes right padding invisible to the real tokens, so no attention mask is needed.
`score` returns, for each sequence, the log-probability of every token given its prefix (the
first entry None), computed on the last pipeline stage and sent to every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_gspo.model.lm_head import LMHead, lm_head_of
from megatron_gspo.model.logprobs import tp_vocab_logprobs


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [b, s] int64, right-padded
    lengths: torch.Tensor  # [b] real lengths
    index: torch.Tensor  # [b] position of each sequence in the caller's list

    @property
    def position_ids(self) -> torch.Tensor:
        b, s = self.tokens.shape
        return torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)


def on_device(mb, device: torch.device):
    """A microbatch (a dataclass of tensors) with its tensors on `device`, the model's: they are
    built on the CPU, where a GPU model cannot read them."""
    if device.type == "cpu":
        return mb
    moved = {
        f.name: v.to(device, non_blocking=True)
        for f in dataclasses.fields(mb)
        if isinstance(v := getattr(mb, f.name), torch.Tensor)
    }
    return dataclasses.replace(mb, **moved)


def padded_length(max_len: int, tp: int, multiple: int = 1) -> int:
    step = tp * multiple
    return -(-max_len // step) * step


def make_microbatches(seqs: list[list[int]], micro_batch_size: int, seq_len: int, pad_id: int = 0):
    """Full microbatches only: pipeline stages exchange [seq_len, micro_batch_size, hidden]
    tensors, so a short last microbatch is filled with empty rows (length 0, index -1)."""
    out = []
    for start in range(0, len(seqs), micro_batch_size):
        part = seqs[start : start + micro_batch_size]
        tokens = torch.full((micro_batch_size, seq_len), pad_id, dtype=torch.long)
        for i, s in enumerate(part):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        fill = micro_batch_size - len(part)
        lengths = torch.tensor([len(s) for s in part] + [0] * fill)
        index = torch.tensor(list(range(start, start + len(part))) + [-1] * fill)
        out.append(Microbatch(tokens, lengths, index))
    return out


def next_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int,
    with_entropy: bool = False,
    head: LMHead | None = None,
    rows=None,
):
    """logits [b, s, V_local] -> log p(tokens[:, t+1] | ..t) as [b, s-1] (and entropy [b, s-1]).
    With the chunked LM head (`head`, model/lm_head.py) `logits` are the output layer's hidden
    states [b, s, H] instead, and the head forms the logits a chunk of tokens at a time.

    Runs over all s positions (the last one with a dummy target) and drops the last output:
    slicing the logits instead would make autograd zero-fill and copy a full-vocabulary gradient.
    Logits of the last s' < s positions only (a logits window, `set_logits_from`) give zeros
    before them. `rows`: with the head, only these flat positions of its [b, s'] (ascending) are
    computed, the others give 0 (`lm_head_logprobs`)."""
    start = tokens.size(1) - logits.size(1)
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # last column: any valid id
    if head is not None:
        lp, ent = head.logprobs(logits, targets[:, start:], with_entropy, rows=rows)
    else:
        lp, ent = tp_vocab_logprobs(logits, targets[:, start:], vocab_size, with_entropy)
    if start:
        lp = F.pad(lp, (start, 0))
        ent = None if ent is None else F.pad(ent, (start, 0))
    return lp[:, :-1], (None if ent is None else ent[:, :-1])


def _score_loss(mb: Microbatch, vocab_size: int, head: LMHead | None, logits: torch.Tensor):
    lp, _ = next_token_logprobs(logits, mb.tokens, vocab_size, head=head)
    return torch.zeros((), device=lp.device), {"logprobs": lp.detach(), "mb": mb}


def _forward_step(vocab_size: int, data_iterator, model):
    mb = next(data_iterator)
    logits = model(mb.tokens, mb.position_ids, None)
    return logits, partial(_score_loss, mb, vocab_size, lm_head_of(model))


def _iterators(microbatches, chunks):
    if len(chunks) == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in chunks]


@torch.no_grad()
def score(chunks, seqs: list[list[int]], *, micro_batch_size: int = 8) -> list[list[float | None]]:
    """Per-token log-probs of `seqs` (each rank passes the same list; every rank gets the result)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = chunks[0].model_spec
    tp = mpu.get_tensor_model_parallel_world_size()
    seq_len = padded_length(max(len(s) for s in seqs), tp)
    device = next(chunks[0].parameters()).device
    mbs = [on_device(mb, device) for mb in make_microbatches(seqs, micro_batch_size, seq_len)]
    for c in chunks:
        c.eval()
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, spec.vocab_size),
        data_iterator=_iterators(mbs, chunks),
        model=chunks,
        num_microbatches=len(mbs),
        seq_length=seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    result: list = [None] * len(seqs)
    for out in outputs:
        for i, row in token_rows(out["mb"], out["logprobs"]):
            result[i] = row
    return _from_last_stage(result)


def token_rows(mb, lp: torch.Tensor):
    """(caller's index, token-aligned log-probs with entry 0 None) of each real row of a
    microbatch (`index` and `lengths` fields), from its next-token log-probs lp [b, s-1]; None
    also before the microbatch's logits window (`logits_from`), where nothing was computed."""
    start = getattr(mb, "logits_from", 0)
    for row, i in enumerate(mb.index.tolist()):
        if i >= 0:
            n = int(mb.lengths[row])
            values = lp[row, start : n - 1].tolist()
            yield i, [None] * (n - len(values)) + values


def _from_last_stage(result: list):
    """Broadcast the last pipeline stage's result to every rank of the pipeline group."""
    from megatron.core import parallel_state as mpu

    pp = mpu.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return result
    group = mpu.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, pp - 1)
    box = [result]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
