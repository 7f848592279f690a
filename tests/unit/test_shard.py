"""The sharded batch's parts that need no process group: which replica owns which row, the wire
tensors of a shard and what they unpack to (rows, token fields, the stage's routing columns), and
that the bytes are those of the rows and layers the rank needs."""

import numpy as np
import pytest

from megatron_gspo.routing.align import align_rollout_experts
from megatron_gspo.train.batch import RLBatch
from megatron_gspo.train.shard import RankNeeds, minibatch_parts, owners, pack, unpack

NUM_LAYERS, MOE, EXPERTS, K = 6, (1, 2, 3, 4, 5), 8, 2  # layer 0 dense


def batch(n=7, per_token=False, server_layers=NUM_LAYERS) -> RLBatch:
    rng = np.random.default_rng(0)
    tokens, masks, lps, experts = [], [], [], []
    for i in range(n):
        p, length = 2 + i % 3, 6 + i
        tokens.append(rng.integers(0, 50000, length).tolist())
        masks.append([0] * p + [1] * (length - p))
        lps.append([None] * p + (-rng.random(length - p)).tolist())
        ids = np.argsort(rng.random((length - 1, server_layers, EXPERTS)), -1)[..., :K]
        experts.append(None if i == 3 else ids.astype(np.int32))
    adv = [[float(i)] * len(t) for i, t in enumerate(tokens)] if per_token else list(range(n))
    return RLBatch(tokens, masks, adv, rollout_logprobs=lps, rollout_experts=experts)


def test_minibatch_parts_and_owners_follow_the_actors_split():
    parts = minibatch_parts(10, 3, seed=4, step=2)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3] and all(p == sorted(p) for p in parts)
    assert parts == minibatch_parts(10, 3, seed=4, step=2) != minibatch_parts(10, 3, 4, 3)
    own = owners(parts, 10, dp=2)
    for p in parts:  # position j of each part: replica j % 2, as the actor lays a minibatch out
        assert [own[i] for i in p] == [j % 2 for j in range(len(p))]
    assert [len(p) for p in minibatch_parts(2, 4, 0, 1)] == [1, 1]  # no empty minibatch


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("server_layers", [NUM_LAYERS, len(MOE)])
def test_a_shard_holds_its_rows_and_its_stages_routing(per_token, server_layers):
    whole = batch(per_token=per_token, server_layers=server_layers)
    stage = (4, 5)  # the second pipeline stage's MoE layers
    needs = RankNeeds(1, 2, stage, NUM_LAYERS, MOE, EXPERTS)
    rows = [1, 3, 6]
    wire = pack(whole, rows, needs)
    shard = unpack(wire, len(whole), stage)
    assert shard.sharded and shard.index == rows and shard.total == 7 and len(shard) == 3
    for j, i in enumerate(rows):
        assert shard.tokens[j] == whole.tokens[i] and shard.loss_mask[j] == whole.loss_mask[i]
        assert shard.rollout_logprobs[j] == pytest.approx(whole.rollout_logprobs[i])
        assert shard.advantages[j] == whole.advantages[i]
        assert [v is None for v in shard.rollout_logprobs[j]] == [
            v is None for v in whole.rollout_logprobs[i]
        ]
    assert shard.rollout_experts[1] is None  # row 3 came without routing
    for j, i in ((0, 1), (2, 6)):
        got = shard.rollout_experts[j]
        assert got.dtype == np.uint8 and got.shape == (len(whole.tokens[i]) - 1, 2, K)
        # what the stage replays: the same as aligning the server's whole array
        full = align_rollout_experts(
            whole.rollout_experts[i], len(whole.tokens[i]), NUM_LAYERS, list(MOE), stage, K,
            EXPERTS, sample=i,
        )  # fmt: skip
        mine = align_rollout_experts(
            got, len(shard.tokens[j]), NUM_LAYERS, list(MOE), stage, K, EXPERTS, sample=i,
            given_layers=stage,
        )  # fmt: skip
        assert np.array_equal(mine, full)
    # the bytes: the rows' tokens (int32, mask, rollout log-prob and its flag) and the stage's
    # 2 of 6 layers in one byte per id, not the server's int32 for every layer
    n_tok = sum(len(whole.tokens[i]) for i in rows)
    adv = 4 * (n_tok if per_token else len(rows))
    ids = sum((len(whole.tokens[i]) - 1) * 2 * K for i in (1, 6))
    payload = sum(t.numel() * t.element_size() for t in wire[2:])
    assert payload == n_tok * (4 + 1 + 4 + 1) + adv + ids


def test_ids_out_of_range_travel_as_int32_so_the_actor_names_them():
    whole = batch()
    assert whole.rollout_experts is not None
    whole.rollout_experts[0][0, 2, 0] = 300  # not an expert of an 8-expert model
    needs = RankNeeds(0, 1, MOE, NUM_LAYERS, MOE, EXPERTS)
    shard = unpack(pack(whole, [0, 1], needs), 7, MOE)
    assert shard.rollout_experts[0].dtype == np.int32 and shard.rollout_experts[0][0, 1, 0] == 300
    with pytest.raises(Exception, match="expert id 300"):
        align_rollout_experts(shard.rollout_experts[0], len(shard.tokens[0]), NUM_LAYERS,
                              list(MOE), MOE, K, EXPERTS, 0, given_layers=MOE)  # fmt: skip


def test_rows_of_a_shard_keep_their_place_in_the_whole_batch():
    whole = batch()
    needs = RankNeeds(0, 1, MOE, NUM_LAYERS, MOE, EXPERTS)
    shard = unpack(pack(whole, [0, 2, 4, 5], needs), 7, MOE)
    assert shard.positions_of([5, 1, 2]) == [3, 1]  # row 1 is another replica's
    sub = shard.rows([3, 1], total=3)
    assert sub.index == [5, 2] and sub.total == 3 and sub.global_size == 3
    assert sub.expert_layers == MOE and sub.tokens[0] == whole.tokens[5]
    assert whole.positions_of([5, 1]) == [5, 1] and not whole.sharded
    assert whole.rows([5, 1]).total is None
