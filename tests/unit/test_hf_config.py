import json

import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import load_hf_config, model_spec
from megatron_gspo.model.parallel import ParallelDims

pytestmark = pytest.mark.unit


def test_spec_of_tiny_moe_with_dense_first_layer(tiny_models):
    spec = model_spec(load_hf_config(tiny_models["moe"]))
    assert spec.arch == "qwen3_moe" and spec.moe_layers == (False, True)
    assert (spec.num_experts, spec.topk, spec.norm_topk_prob, spec.qk_norm) == (8, 2, True, True)


def test_decoder_sparse_step_and_v4_field_names():
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "rope_theta": 1e6,
    }
    spec = model_spec(cfg)
    assert spec.moe_layers == (False, True, False, False) and spec.rope_theta == 1e6


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError, match="unsupported architecture.*Qwen3MoeForCausalLM"):
        model_spec(load_hf_config(tmp_path))


@pytest.mark.parametrize(
    "dims, message",
    [
        (ParallelDims(tp=3, world_size=1), "does not divide the model's 4 attention heads"),
        (ParallelDims(ep=3, world_size=1), "does not divide the model's 8 experts"),
        (ParallelDims(pp=2, vpp=2, world_size=2), "cannot be split into pp\\*vpp=4"),
        (ParallelDims(tp=2, world_size=3), "not divisible by tp\\*pp=2"),
    ],
)
def test_layouts_that_cannot_work_are_refused(tiny_models, dims, message):
    spec = model_spec(load_hf_config(tiny_models["moe"]))
    with pytest.raises(UserError, match=message):
        dims.validate(spec)


@pytest.mark.parametrize(
    "dims, flags, keys",
    [
        (ParallelDims(tp=2, world_size=3), "change --tp/--pp or the number of processes",
         "change parallel.tp/parallel.pp or the number of processes"),
        (ParallelDims(vpp=2, world_size=1), "--vpp needs --pp >= 2",
         "parallel.vpp needs parallel.pp >= 2"),
        (ParallelDims(tp=3, world_size=3), "--tp 3 does not divide the model's 4 attention heads "
         "and 2 key/value heads; choose a --tp that divides both", "parallel.tp=3 does not divide"
         " the model's 4 attention heads and 2 key/value heads; choose a parallel.tp that divides "
         "both"),
    ],
)  # fmt: skip
def test_a_layout_error_names_the_flags_or_the_config_keys_that_set_it(tiny_models, dims, flags,
                                                                        keys):  # fmt: skip
    """`train` takes parallel.* keys, `convert` and `score` flags: each error names its own."""
    spec = model_spec(load_hf_config(tiny_models["moe"]))
    for named, want in ((False, flags), (True, keys)):
        with pytest.raises(UserError) as e:
            dims.validate(spec, keys=named)
        assert want in str(e.value)


GOOD = {
    "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
    "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}  # fmt: skip


@pytest.mark.parametrize(
    "key, value",
    [("rms_norm_eps", float("nan")), ("rope_theta", float("inf")), ("rope_theta", -1),
     ("num_hidden_layers", -2), ("num_hidden_layers", None), ("hidden_size", "64"),
     ("vocab_size", 2**70), ("vocab_size", True), ("num_attention_heads", 0),
     ("torch_dtype", "int8"), ("torch_dtype", "nope"), ("num_experts_per_tok", 99),
     ("decoder_sparse_step", 0), ("rope_parameters", [1]), ("mlp_only_layers", "0"),
     ("max_position_embeddings", 1.5), ("head_dim", -16), ("num_experts_per_tok", 0),
     ("tie_word_embeddings", "yes"), ("norm_topk_prob", 1)],
)  # fmt: skip
def test_malformed_config_values_are_one_line_naming_the_key(key, value):
    """NaN, a negative size, a string for a number, an unknown dtype: each used to be a
    ValueError, TypeError, ZeroDivisionError or AttributeError traceback (a 500 at the server's
    /update_weights_from_disk)."""
    cfg = {**GOOD, key: value}
    if value is None:
        del cfg[key]
    with pytest.raises(UserError) as e:
        model_spec(cfg)
    assert key in str(e.value) and "\n" not in str(e.value)
    model_spec(GOOD)


def test_a_config_that_is_no_object_or_no_json_is_refused(tmp_path):
    with pytest.raises(UserError, match="must hold a JSON object"):
        model_spec([1, 2])  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")
    with pytest.raises(UserError, match="is not valid JSON"):
        load_hf_config(tmp_path)


def test_head_counts_that_do_not_group_are_refused():
    """3 query heads over 2 key/value heads used to load, and the server then failed every
    /generate with a 500."""
    with pytest.raises(UserError) as e:
        model_spec({**GOOD, "num_attention_heads": 3, "num_key_value_heads": 2})
    assert str(e.value) == (
        "config.json: num_attention_heads (3) must be a multiple of num_key_value_heads (2)"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 0}, "config.json: num_experts is 0 for Qwen3MoeForCausalLM; set it >= 1, "
         "or for a dense model use Qwen3ForCausalLM (model_type qwen3) with no num_experts"),
        ({"num_experts": None, "num_local_experts": 0}, "config.json: num_local_experts is 0 for "
         "Qwen3MoeForCausalLM; set it >= 1, or for a dense model use Qwen3ForCausalLM "
         "(model_type qwen3) with no num_experts"),
        ({"moe_intermediate_size": 0}, "config.json: moe_intermediate_size is 0 on a MoE model; "
         "set it >= 1 (one expert's FFN width), or for a dense model use Qwen3ForCausalLM "
         "(model_type qwen3) with no num_experts"),
        ({"moe_intermediate_size": None}, "config.json: moe_intermediate_size is missing on a "
         "MoE model; set it >= 1 (one expert's FFN width), or for a dense model use "
         "Qwen3ForCausalLM (model_type qwen3) with no num_experts"),
    ],
)  # fmt: skip
def test_a_moe_config_with_no_experts_is_refused_not_read_as_dense(change, message):
    """num_experts 0 used to give a dense spec (and moe_intermediate_size 0 experts with no
    weights), so convert and the server then failed on the checkpoint's expert tensors."""
    with pytest.raises(UserError) as e:
        model_spec({**GOOD, **change})
    assert str(e.value) == message


def test_a_moe_config_whose_layers_are_all_dense_needs_no_expert_width():
    spec = model_spec({**GOOD, "mlp_only_layers": [0, 1], "moe_intermediate_size": 0})
    assert not spec.is_moe and spec.moe_ffn_hidden_size == 0


def test_mlp_only_layers_outside_the_model_are_named():
    """Ids past the last layer (or negative) used to be ignored, so a config meant for another
    depth loaded with the wrong layers dense."""
    with pytest.raises(UserError) as e:
        model_spec({**GOOD, "mlp_only_layers": [0, 2, -1, 5]})
    assert str(e.value) == (
        "config.json: mlp_only_layers has layer ids [-1, 2, 5] outside [0, 2) "
        "(num_hidden_layers is 2)"
    )


def test_dtype_is_read_before_the_older_torch_dtype_as_transformers_reads_it():
    """transformers 5 takes `dtype` where a config has both keys (PretrainedConfig's __init__);
    the model spec, and so the trainer and the built-in server, read `torch_dtype` first."""
    assert (
        model_spec({**GOOD, "dtype": "bfloat16", "torch_dtype": "float32"}).dtype == torch.bfloat16
    )
    assert model_spec({**GOOD, "torch_dtype": "float16"}).dtype == torch.float16
