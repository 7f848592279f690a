"""The bridge's fusions and TP splits, against shapes and layouts written out by hand."""

import pytest
import torch

from megatron_gspo.model.bridge import BRIDGES
from megatron_gspo.model.bridge.base import Layout, fuse_qkv, shard, unfuse_qkv, unshard

pytestmark = pytest.mark.unit


def test_qkv_fusion_groups_queries_with_their_kv_head():
    nq, nkv, d, h = 4, 2, 3, 5
    q = torch.arange(nq * d * h, dtype=torch.float32).reshape(nq * d, h)
    k = -torch.arange(nkv * d * h, dtype=torch.float32).reshape(nkv * d, h) - 1
    v = 1000 + torch.arange(nkv * d * h, dtype=torch.float32).reshape(nkv * d, h)
    fused = fuse_qkv(q, k, v, num_heads=nq, num_kv_heads=nkv)
    # Written out: group g = [q heads 2g, 2g+1 | k head g | v head g].
    expect = []
    for g in range(nkv):
        expect += [q[(2 * g) * d : (2 * g + 2) * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    assert torch.equal(fused, torch.cat(expect))
    q2, k2, v2 = unfuse_qkv(fused, num_heads=nq, num_kv_heads=nkv)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_qkv_bias_fusion_round_trips():
    q, k, v = torch.randn(8), torch.randn(4), torch.randn(4)
    fused = fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2)
    assert all(
        torch.equal(a, b) for a, b in zip(unfuse_qkv(fused, num_heads=4, num_kv_heads=2), (q, k, v))
    )


def test_glu_shard_holds_matching_gate_and_up_rows():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    full = torch.cat([gate, up])
    s1 = shard(Layout.GLU, full, 1, 2)
    assert torch.equal(s1, torch.cat([gate[4:], up[4:]]))


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_unshard_round_trip(layout, size):
    full = torch.randn(16, 8)
    parts = [shard(layout, full, r, size) for r in range(size)]
    assert torch.equal(unshard(layout, parts), full)
    if layout is Layout.ROW and size > 1:
        assert parts[0].shape == (16, 8 // size)


def test_unknown_parameter_name_is_an_error():
    with pytest.raises(KeyError, match="no qwen3_moe mapping"):
        BRIDGES["qwen3_moe"].param_map("decoder.layers.0.mystery.weight", {0: 0}, 0, False)


def test_expert_and_layer_indices_become_global():
    pm = BRIDGES["qwen3_moe"].param_map(
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight", {1: 5}, 4, False
    )
    assert pm.hf_names == ("model.layers.5.mlp.experts.6.down_proj.weight",)
    assert pm.layout is Layout.ROW and pm.expert


def test_tied_output_layer_maps_to_embedding():
    pm = BRIDGES["qwen2"].param_map("output_layer.weight", {}, 0, True)
    assert pm.hf_names == ("model.embed_tokens.weight",)
