"""Read an HF `config.json` into one architecture-neutral description (`ModelSpec`).

Accepts what transformers 4.x and 5.x write for Qwen3-MoE, Qwen3 and Qwen2 (`num_experts` or
`num_local_experts`, `rope_theta` or `rope_parameters.rope_theta`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gspo.checks import show
from megatron_gspo.errors import UserError

SUPPORTED = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # a key of the bridge registry: qwen3_moe | qwen3 | qwen2
    architecture: str  # the HF class name
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP
    moe_ffn_hidden_size: int  # one expert (0 for dense models)
    num_experts: int  # 0 for dense models
    topk: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: True = MoE, False = dense MLP
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    dtype: torch.dtype

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]


def load_hf_config(path: str | Path) -> dict:
    path = Path(path)
    cfg = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise UserError(f"{path} does not exist; point at an HF checkpoint directory")
    if not cfg.is_file():
        raise UserError(f"no config.json in {path}; point at an HF checkpoint directory")
    try:
        return json.loads(cfg.read_text())
    except ValueError as e:  # (also an integer of > 4300 digits)
        raise UserError(f"{cfg} is not valid JSON ({e}); re-copy the checkpoint") from None


def model_spec(cfg: dict) -> ModelSpec:
    """The description of `cfg` (a config.json's contents); every value is checked first (a
    UserError naming the key: NaN, a negative size, a string where a number belongs)."""
    if not isinstance(cfg, dict):
        raise UserError("config.json must hold a JSON object")
    archs = cfg.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    arch_name = next((a for a in archs if isinstance(a, str) and a in SUPPORTED), None)
    if arch_name is None:
        raise UserError(
            f"unsupported architecture {show(archs or cfg.get('model_type'))}; "
            f"supported: {', '.join(sorted(SUPPORTED))}"
        )
    arch = SUPPORTED[arch_name]
    n_layers, heads = _int(cfg, "num_hidden_layers"), _int(cfg, "num_attention_heads")
    experts, moe_layers = _moe_layers(cfg, arch, n_layers)
    rope = _rope(cfg)
    hidden = _int(cfg, "hidden_size")
    # a MoE model routes each token to 1..experts experts (absent: transformers' default, 8); a
    # dense one ignores the key
    topk = _int(cfg, "num_experts_per_tok", 8, lo=1, hi=experts) if experts else 0
    kv_heads = _kv_heads(cfg, heads)
    return ModelSpec(
        arch=arch,
        architecture=arch_name,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int(cfg, "head_dim", hidden // heads),
        ffn_hidden_size=_int(cfg, "intermediate_size"),
        moe_ffn_hidden_size=_moe_width(cfg, any(moe_layers)),
        num_experts=experts,
        topk=topk,
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
        moe_layers=moe_layers,
        rope_theta=_float(cfg, "rope_theta", rope.get("rope_theta", 10000.0)),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        tie_embeddings=_bool(cfg, "tie_word_embeddings"),
        qkv_bias=arch == "qwen2" or _bool(cfg, "attention_bias"),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        dtype=_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def _moe_layers(cfg: dict, arch: str, n_layers: int) -> tuple[int, tuple[bool, ...]]:
    """The expert count and which layers are MoE. A MoE architecture with no experts is refused
    rather than read as a dense model: the weights it names would not match the tensors."""
    if arch != "qwen3_moe":
        return 0, (False,) * n_layers
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts = _int(cfg, key, 0, lo=0)
    if experts == 0:
        raise UserError(
            f"config.json: {key} is {_given(cfg, key)} for Qwen3MoeForCausalLM; set it >= 1, "
            "or for a dense model use Qwen3ForCausalLM (model_type qwen3) with no num_experts"
        )
    step = _int(cfg, "decoder_sparse_step", 1)
    dense_only = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(_is_int(i) for i in dense_only):
        raise UserError(
            f"config.json: mlp_only_layers must be a list of layer ids, not {show(dense_only)}"
        )
    bad = sorted({i for i in dense_only if not 0 <= i < n_layers})
    if bad:
        raise UserError(
            f"config.json: mlp_only_layers has layer ids {show(bad)} outside [0, {n_layers}) "
            f"(num_hidden_layers is {n_layers})"
        )
    dense = set(dense_only)
    moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    return experts, moe


def _moe_width(cfg: dict, has_moe_layers: bool) -> int:
    """One expert's FFN width: at least 1 where a layer is MoE (absent or 0 would build experts
    with no weights)."""
    width = _int(cfg, "moe_intermediate_size", 0, lo=0)
    if has_moe_layers and width == 0:
        raise UserError(
            f"config.json: moe_intermediate_size is {_given(cfg, 'moe_intermediate_size')} on a "
            "MoE model; set it >= 1 (one expert's FFN width), or for a dense model use "
            "Qwen3ForCausalLM (model_type qwen3) with no num_experts"
        )
    return width


def _given(cfg: dict, key: str) -> str:
    return "missing" if cfg.get(key) is None else show(cfg[key])


def _kv_heads(cfg: dict, heads: int) -> int:
    """Key/value heads: each serves the same number of query heads (GQA)."""
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise UserError(
            f"config.json: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    return kv_heads


def _rope(cfg: dict) -> dict:
    """The config's RoPE parameters: default RoPE only (theta from them or the config)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"config.json: rope_parameters must be an object, not {show(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(
            f"rope type {show(rope_type)} is not supported yet; use a default-RoPE model"
        )
    return rope


_REQUIRED = object()
MAX_SIZE = 2**31 - 1  # sizes index int32 kernels and buffers


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(cfg: dict, key: str, default=_REQUIRED, lo: int = 1, hi: int | None = None) -> int:
    """An integer size in [lo, hi or MAX_SIZE] (an integral float such as 2.0 is taken)."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise UserError(f"config.json has no {key}; is it an HF model config?")
        v = default
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    top = MAX_SIZE if hi is None else hi
    if not _is_int(v) or not lo <= v <= top:
        raise UserError(f"config.json: {key} must be an integer in [{lo}, {top}], not {show(v)}")
    return v


def _bool(cfg: dict, key: str) -> bool:
    """A JSON true or false (absent: false); a string such as "yes" is refused, not read as
    true, since a wrong guess here changes which tensors the model has."""
    v = cfg.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise UserError(f"config.json: {key} must be true or false, not {show(v)}")
    return v


def _float(cfg: dict, key: str, default: object) -> float:
    """A finite number > 0."""
    v = cfg.get(key)
    v = default if v is None else v
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    raise UserError(f"config.json: {key} must be a finite number > 0, not {show(v)}")


def _dtype(name: object) -> torch.dtype:
    t = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(t, torch.dtype) or not t.is_floating_point:
        raise UserError(
            f"config.json: dtype (or torch_dtype) must be a floating-point dtype, not {show(name)}"
        )
    return t
