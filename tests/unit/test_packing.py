"""Packed microbatches without a model: the bins (budget, balance, count), the flat row and its
PackedSeqParams, and that unpacking the flat row's next-token values gives each sequence's own,
as the padded layout holds them."""

import pytest
import torch

from megatron_gspo.train.batch import StepBatch, microbatches
from megatron_gspo.train.packing import packed_microbatches, plan_bins

pytestmark = pytest.mark.unit


def test_bins_keep_the_budget_and_balance_the_load():
    lengths = [90, 10, 50, 50, 40, 30, 30, 20, 60, 5]
    bins = plan_bins(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(10))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 100 and len(bins) == -(-sum(lengths) // 100)  # 385 tokens: 4 bins
    assert max(loads) - min(loads) <= 20  # worst-fit: 90+5, 60+30, 50+50, 40+30+20+10 (95..100)
    assert all(b == sorted(b) for b in bins)


def test_a_sequence_over_the_budget_gets_a_bin_of_its_own_and_at_least_spreads():
    assert plan_bins([150, 20, 30], 100) == [[0], [1, 2]]
    spread = plan_bins([10, 10, 10], 100, at_least=3)
    assert sorted(map(len, spread)) == [1, 1, 1]
    assert plan_bins([10], 100, at_least=2) == [[0], []]


def _batch() -> StepBatch:
    tokens = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1]]
    old = [[None, -1.0, -2.0, -3.0, -4.0], [None, -5.0, -6.0], [None, -7.0, -8.0, -9.0]]
    return StepBatch.from_rows(tokens, mask, [0.5, -1.0, 2.0], old_logprobs=old)


def test_a_packed_microbatch_is_its_sequences_flat_with_a_tail():
    (mb,) = packed_microbatches(_batch(), [[0, 2]], multiple=2)  # 9 tokens -> 10
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 9, 10, 11, 12, 0]]
    assert mb.cu_seqlens.tolist() == [0, 5, 9, 10] and mb.max_seqlen == 5
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]]
    p = mb.packed_seq_params()
    assert p.qkv_format == "thd" and p.cu_seqlens_q is mb.cu_seqlens and p.max_seqlen_kv == 5
    # the training fields are the padded path's for the same rows
    (padded,) = microbatches(_batch(), [0, 2], 2, 5)
    for name in ("mask", "advantages", "old_logprobs", "index", "lengths"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name


def test_unpack_gives_each_sequence_its_next_token_values():
    (mb,) = packed_microbatches(_batch(), [[0, 2]], multiple=2)
    flat = torch.arange(1.0, 10.0).view(1, 9)  # column p: "value of token p + 1" of the row
    got = mb.unpack(flat)
    # sequence 0 (flat 0..4): tokens 1..4 <- columns 0..3; sequence 2 (flat 5..8): 5..7
    assert got.tolist() == [[1.0, 2.0, 3.0, 4.0], [6.0, 7.0, 8.0, 0.0]]


def test_an_empty_microbatch_has_a_masked_position():
    (mb,) = packed_microbatches(_batch(), [[]], multiple=1)
    assert mb.tokens.shape == (1, 2) and mb.cu_seqlens.tolist() == [0, 2]
    assert mb.index.tolist() == [-1] and not mb.mask.any()
