"""Qwen3-MoE, Qwen3 and Qwen2: HF `model.layers.N...` <-> Megatron `decoder.layers.N...`.

Names are listed for both layer specs: the local spec (separate norms, SequentialMLP experts) and
the Transformer Engine spec (norms fused into `linear_qkv` / `linear_fc1` as `layer_norm_weight`).
Expert names are SequentialMLP's (`local_experts.{e}.linear_fc1.weight`): the local spec's
grouped experts are listed under them as per-expert views (model/experts.py, model/weights.py).
Transformer Engine's grouped experts (TEGroupedMLP) hold one tensor per expert,
`experts.linear_fc1.weight{e}`, of the same shape and split, listed here as well.
"""

from megatron_gspo.model.bridge.base import Bridge, Layout, Rule

L = r"decoder\.layers\.(?P<layer>\d+)\."
HL = "model.layers.{layer}."
ATTN = HL + "self_attn."
ROW, COL, REP = Layout.ROW, Layout.COLUMN, Layout.REPLICATED

_COMMON = (
    Rule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), Layout.VOCAB),
    Rule(r"output_layer\.weight", ("lm_head.weight",), Layout.VOCAB),
    Rule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), REP),
    Rule(L + r"input_layernorm\.weight", (HL + "input_layernorm.weight",), REP),
    Rule(
        L + r"self_attention\.linear_qkv\.layer_norm_weight", (HL + "input_layernorm.weight",), REP
    ),
    Rule(
        L + r"self_attention\.linear_qkv\.weight",
        (ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"),
        Layout.QKV,
    ),
    Rule(
        L + r"self_attention\.linear_qkv\.bias",
        (ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"),
        Layout.QKV,
    ),
    Rule(L + r"self_attention\.linear_proj\.weight", (ATTN + "o_proj.weight",), ROW),
    Rule(L + r"pre_mlp_layernorm\.weight", (HL + "post_attention_layernorm.weight",), REP),
    Rule(L + r"mlp\.linear_fc1\.layer_norm_weight", (HL + "post_attention_layernorm.weight",), REP),
    Rule(
        L + r"mlp\.linear_fc1\.weight",
        (HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"),
        Layout.GLU,
    ),
    Rule(L + r"mlp\.linear_fc2\.weight", (HL + "mlp.down_proj.weight",), ROW),
)
_QK_NORM = (
    Rule(L + r"self_attention\.q_layernorm\.weight", (ATTN + "q_norm.weight",), REP),
    Rule(L + r"self_attention\.k_layernorm\.weight", (ATTN + "k_norm.weight",), REP),
)
EXP = HL + "mlp.experts.{expert}."
_MOE = (
    Rule(L + r"mlp\.router\.weight", (HL + "mlp.gate.weight",), REP),
    Rule(
        L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight",
        (EXP + "gate_proj.weight", EXP + "up_proj.weight"),
        Layout.GLU,
        expert=True,
    ),
    Rule(
        L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight",
        (EXP + "down_proj.weight",),
        ROW,
        expert=True,
    ),
    Rule(
        L + r"mlp\.experts\.linear_fc1\.weight(?P<expert>\d+)",
        (EXP + "gate_proj.weight", EXP + "up_proj.weight"),
        Layout.GLU,
        expert=True,
    ),
    Rule(
        L + r"mlp\.experts\.linear_fc2\.weight(?P<expert>\d+)",
        (EXP + "down_proj.weight",),
        ROW,
        expert=True,
    ),
)

QWEN3_MOE = Bridge("qwen3_moe", _COMMON + _QK_NORM + _MOE)
QWEN3 = Bridge("qwen3", _COMMON + _QK_NORM)
QWEN2 = Bridge("qwen2", _COMMON)
