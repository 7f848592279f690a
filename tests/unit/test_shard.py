"""The sharded batch's parts that need no process group: which replica owns which row, the wire
tensors of a shard and what they unpack to (rows, token fields, the stage's routing columns), and
that the bytes are those of the rows and layers the rank needs."""

import numpy as np
import pytest
import torch

from megatron_gspo.routing.align import align_rollout_experts
from megatron_gspo.train.batch import FIELDS, StepBatch
from megatron_gspo.train.shard import RankNeeds, minibatch_parts, owners, pack, unpack

NUM_LAYERS, MOE, EXPERTS, K = 6, (1, 2, 3, 4, 5), 8, 2  # layer 0 dense


def batch(n=7, per_token=False, server_layers=NUM_LAYERS) -> StepBatch:
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
    return StepBatch.from_rows(tokens, masks, adv, rollout_logprobs=lps, rollout_experts=experts)


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
    adv = "token_advantages" if per_token else "advantages"
    for name in ("tokens", "loss_mask", adv):
        assert shard.row_values(name) == [whole.row_values(name)[i] for i in rows]
    for j, i in enumerate(rows):
        got, want = shard.row_values("rollout_logprobs")[j], whole.row_values("rollout_logprobs")[i]
        assert [v is None for v in got] == [v is None for v in want]
        assert [v for v in got if v is not None] == pytest.approx(
            [v for v in want if v is not None]
        )
    assert shard.rollout_experts[1] is None  # row 3 came without routing
    for j, i in ((0, 1), (2, 6)):
        got = shard.rollout_experts[j]
        assert got.dtype == np.uint8 and got.shape == (int(whole.lengths[i]) - 1, 2, K)
        # what the stage replays: the same as aligning the server's whole array
        full = align_rollout_experts(
            whole.rollout_experts[i], int(whole.lengths[i]), NUM_LAYERS, list(MOE), stage, K,
            EXPERTS, sample=i,
        )  # fmt: skip
        mine = align_rollout_experts(
            got, int(shard.lengths[j]), NUM_LAYERS, list(MOE), stage, K, EXPERTS, sample=i,
            given_layers=stage,
        )  # fmt: skip
        assert np.array_equal(mine, full)
    # the bytes: the rows' tokens (int32, mask, rollout log-prob: NaN where none) and the
    # stage's 2 of 6 layers in one byte per id, not the server's int32 for every layer
    n_tok = sum(int(whole.lengths[i]) for i in rows)
    adv_bytes = 4 * (n_tok if per_token else len(rows))
    ids = sum((int(whole.lengths[i]) - 1) * 2 * K for i in (1, 6))
    payload = sum(t.numel() * t.element_size() for t in wire[2:])
    assert payload == n_tok * (4 + 1 + 4) + adv_bytes + ids


def test_ids_out_of_range_travel_as_int32_so_the_actor_names_them():
    whole = batch()
    assert whole.rollout_experts is not None
    whole.rollout_experts[0][0, 2, 0] = 300  # not an expert of an 8-expert model
    needs = RankNeeds(0, 1, MOE, NUM_LAYERS, MOE, EXPERTS)
    shard = unpack(pack(whole, [0, 1], needs), 7, MOE)
    assert shard.rollout_experts[0].dtype == np.int32 and shard.rollout_experts[0][0, 1, 0] == 300
    with pytest.raises(Exception, match="expert id 300"):
        align_rollout_experts(shard.rollout_experts[0], int(shard.lengths[0]), NUM_LAYERS,
                              list(MOE), MOE, K, EXPERTS, 0, given_layers=MOE)  # fmt: skip


def test_rows_of_a_shard_keep_their_place_in_the_whole_batch():
    whole = batch()
    needs = RankNeeds(0, 1, MOE, NUM_LAYERS, MOE, EXPERTS)
    shard = unpack(pack(whole, [0, 2, 4, 5], needs), 7, MOE)
    assert shard.positions_of([5, 1, 2]) == [3, 1]  # row 1 is another replica's
    sub = shard.rows([3, 1], total=3)
    assert sub.index == [5, 2] and sub.total == 3 and sub.global_size == 3
    assert sub.expert_layers == MOE and sub.row_values("tokens")[0] == whole.row_values("tokens")[5]
    assert whole.positions_of([5, 1]) == [5, 1] and not whole.sharded
    assert whole.rows([5, 1]).total is None


def test_every_registry_field_travels_without_code_of_its_own():
    """A field the batch carries (here every one in FIELDS) arrives as it was, NaN ("none")
    included: shard.py iterates the registry, so a new field needs no wire code."""
    whole = batch()
    rng = np.random.default_rng(1)
    for f in FIELDS:
        if f.name not in whole.fields:
            size = whole.num_tokens if f.per_token else len(whole)
            values = torch.from_numpy(rng.random(size)).float()
            values[::5] = float("nan") if f.dtype.is_floating_point else 0
            whole.set(f.name, values)
    rows = [0, 4, 5]
    shard = unpack(pack(whole, rows, RankNeeds(0, 1, MOE, NUM_LAYERS, MOE, EXPERTS)), 7, MOE)
    assert set(shard.fields) == {f.name for f in FIELDS}
    for f in FIELDS:
        want, got = whole.rows(rows)[f.name], shard[f.name]
        assert (
            got.dtype == f.dtype
            and torch.equal(got, want)
            or torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
        ), f.name


def test_shard_py_names_no_field():
    """The wire format is derived from the registry: shard.py's code names no field."""
    from pathlib import Path

    import megatron_gspo.train.shard as shard_module

    source = Path(shard_module.__file__).read_text()
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    body = code[code.index("import") :]  # (the module docstring describes the wire format)
    for f in FIELDS:
        assert f'"{f.name}"' not in body and f".{f.name}" not in body, f.name
