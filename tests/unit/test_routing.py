"""Routing replay pieces without megatron: token layout, storage, R3 alignment, metrics."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.routing.align import align_rollout_experts
from megatron_gspo.routing.layout import TokenLayout, token_map
from megatron_gspo.routing.metrics import fraction_metrics
from megatron_gspo.routing.storage import bytes_per_token, index_dtype, microbatch_targets

pytestmark = pytest.mark.unit


def test_positions_follow_sequence_and_context_parallel_splits():
    assert TokenLayout().positions(6).tolist() == list(range(6))
    sp = [TokenLayout(tp_rank=r, tp=2, sequence_parallel=True).positions(6) for r in range(2)]
    assert [p.tolist() for p in sp] == [[0, 1, 2], [3, 4, 5]]
    # TP without sequence parallelism: every TP rank routes every token, rank 0 alone counts.
    no_sp = TokenLayout(tp_rank=1, tp=2, sequence_parallel=False)
    assert no_sp.positions(4).tolist() == [0, 1, 2, 3] and not no_sp.counts_tokens
    # CP 2: 4 chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; then SP halves.
    cp = [TokenLayout(cp_rank=r, cp=2).positions(8).tolist() for r in range(2)]
    assert cp == [[0, 1, 6, 7], [2, 3, 4, 5]]
    both = TokenLayout(tp_rank=1, tp=2, sequence_parallel=True, cp_rank=0, cp=2)
    assert both.positions(8).tolist() == [6, 7]
    every = sorted(
        p
        for c in range(2)
        for t in range(2)
        for p in TokenLayout(t, 2, True, c, 2).positions(16).tolist()
    )
    assert every == list(range(16))


def test_index_dtype_and_bytes_per_token():
    assert index_dtype(8) == np.uint8 and index_dtype(256) == np.uint8
    assert index_dtype(257) == np.int16 and index_dtype(32768) == np.int16
    # Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8: 384 bytes vs SGLang's 1536 (int32).
    assert bytes_per_token(48, 8, 128) == 384 == 48 * 8 * 4 // 4
    assert bytes_per_token(58, 8, 384) == 58 * 8 * 2


def test_microbatch_targets_in_router_token_order():
    k = 2
    a = np.arange(5 * 3 * k).reshape(5, 3, k).astype(np.uint8)  # 5 tokens, 3 layers
    b = (100 + np.arange(3 * 3 * k)).reshape(3, 3, k).astype(np.uint8)  # 3 tokens
    rows = [a, None, b]  # row 1 is an empty row
    positions = np.array([0, 1, 2, 3])  # TP rank 0 of 2 with s = 8
    mb = SimpleNamespace(tokens=torch.zeros((3, 8)), index=torch.tensor([7, -1, 9]))
    rows_N, pos_N = token_map(mb, TokenLayout(tp_rank=0, tp=2, sequence_parallel=True))
    arrays = {7: a, 9: b}
    got = microbatch_targets(arrays, rows_N, pos_N, [2, 0], k).numpy()
    assert got.shape == (2, len(positions) * 3, k)
    for j in range(len(positions) * 3):
        t, r = positions[j // 3], j % 3
        for li, col in enumerate([2, 0]):
            arr = rows[r]
            want = arr[t, col] if arr is not None and t < len(arr) else [-1, -1]
            assert got[li, j].tolist() == list(want), (li, j)


def test_a_packed_microbatch_maps_its_tokens_to_its_sequences():
    """Packed [1, t]: sequences of 3 and 4 tokens, a tail of 1; SP rank 1 of 2 sees 4..7."""
    from megatron_gspo.train.packing import PackedMicrobatch

    mb = PackedMicrobatch(
        torch.zeros((1, 8)), torch.zeros((2, 3)), torch.zeros(2), None, None,
        torch.tensor([5, 2]), torch.tensor([3, 4]), 0, torch.tensor([0, 3, 7, 8]), 4,
    )  # fmt: skip
    rows_N, pos_N = token_map(mb, TokenLayout(tp_rank=1, tp=2, sequence_parallel=True))
    assert rows_N.tolist() == [2, 2, 2, -1] and pos_N.tolist() == [1, 2, 3, -1]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def rollout(n_rows, n_layers, k=2, experts=8, seed=0):
    g = np.random.default_rng(seed)
    return np.stack(
        [
            np.stack([g.choice(experts, k, replace=False) for _ in range(n_layers)])
            for _ in range(n_rows)
        ]
    ).astype(np.int32)


MODEL = dict(num_layers=4, moe_layer_ids=[1, 2, 3], topk=2, num_experts=8)


def test_align_drops_dense_layers_and_keeps_the_stage():
    every = rollout(9, 4)  # as SGLang sends it: every decoder layer (layer 0 dense)
    every[:, 0] = 0
    got = align_rollout_experts(every, 10, layers=(2, 3), sample=0, **MODEL)
    assert got.dtype == np.uint8 and got.shape == (9, 2, 2)
    assert np.array_equal(got, every[:, [2, 3]])
    moe_only = every[:, 1:]  # an engine that sends MoE layers only
    assert np.array_equal(
        align_rollout_experts(moe_only, 10, layers=(2, 3), sample=0, **MODEL), got
    )
    # A row for the last token too (n rows) is accepted; a stage without MoE layers holds none.
    assert align_rollout_experts(rollout(10, 4), 10, layers=(1,), sample=0, **MODEL).shape[0] == 10
    assert align_rollout_experts(every, 10, layers=(), sample=0, **MODEL).shape == (9, 0, 2)


@pytest.mark.parametrize(
    "experts, n_tokens, message",
    [
        (None, 10, "sample 3 has no routed experts"),
        (rollout(9, 4)[:, :, :1], 10, "expected [tokens, layers, 2]"),
        (rollout(9, 2), 10, "for 2 layers; the model has 4 decoder layers, 3 of them MoE"),
        (rollout(6, 4), 10, "cover 6 tokens but the sample has 10"),
        (rollout(12, 4), 10, "cover 12 tokens but the sample has 10"),
        (rollout(9, 4, experts=9), 10, "outside [0, 8)"),
    ],
)
def test_align_refuses_what_does_not_fit(experts, n_tokens, message):
    if experts is not None and "outside" in message:
        experts[4, 2] = [8, 1]
    with pytest.raises(UserError, match=re.escape(message)):
        align_rollout_experts(experts, n_tokens, layers=(1, 2, 3), sample=3, **MODEL)


def test_align_refuses_a_dense_row_where_the_model_has_moe():
    every = rollout(9, 4)
    every[5, 2] = [0, 0]  # what a server that thinks layer 2 is dense would send
    with pytest.raises(UserError, match="token 5 repeats an expert in its top-k at layer 2"):
        align_rollout_experts(every, 10, layers=(1, 2, 3), sample=0, **MODEL)


def test_fraction_metrics():
    counts = {1: (3, 10), 4: (0, 30), 6: (0, 0)}
    assert fraction_metrics("routing/changed_fraction", counts) == {
        "routing/changed_fraction": 3 / 40,
        "routing/changed_fraction/layer_1": 0.3,
        "routing/changed_fraction/layer_4": 0.0,
    }
    agree = fraction_metrics("a", {1: (3, 10)}, agreement=True)
    assert agree == {"a": pytest.approx(0.7), "a/layer_1": pytest.approx(0.7)}
    assert fraction_metrics("a", {1: (0, 0)}) == {}


def test_unknown_mode_is_a_user_error():
    from megatron_gspo.routing.replay import RoutingReplay

    with pytest.raises(UserError, match="routing_replay 'r4' is not one of none, r2, r3"):
        RoutingReplay([], "r4")


def test_recorded_routing_is_kept_as_a_patch_on_the_rollout_one():
    from megatron_gspo.routing.storage import SampleRouting

    roll = rollout(9, 3, seed=1).astype(np.uint8)  # server: tokens 0..8 of 10
    natural = np.concatenate([roll, rollout(1, 3, seed=2).astype(np.uint8)])  # + the last token
    natural[4, 1] = natural[4, 1][::-1]  # same set, other order
    natural[6, 2] = (natural[6, 2] + 1) % 8  # another set
    s = SampleRouting((1, 2, 3), rollout=roll)
    s.recorded = natural
    # The same top-k sets (the order of a top-k does not matter to replay or drift).
    assert np.array_equal(np.sort(s.recorded, -1), np.sort(natural, -1))
    assert s.recorded.dtype == np.uint8 and np.array_equal(s.recorded[6], natural[6])
    # One bit per (token, layer): 30 bits in 4 bytes; the ids of the 4 positions whose sets
    # differ (3 for token 9, which the server never fed, 1 for token 6): 4 x 2 bytes.
    assert s.nbytes == roll.nbytes + 4 + 4 * 2
    plain = SampleRouting((1, 2, 3), recorded=natural)  # R2: no rollout, the full array
    assert plain.recorded is natural and plain.nbytes == natural.nbytes == 10 * 3 * 2
