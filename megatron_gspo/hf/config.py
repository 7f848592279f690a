"""Read an HF `config.json` into one architecture-neutral description (`ModelSpec`).

Accepts what transformers 4.x and 5.x write for Qwen3-MoE, Qwen3 and Qwen2 (`num_experts` or
`num_local_experts`, `rope_theta` or `rope_parameters.rope_theta`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

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
    if not cfg.is_file():
        raise UserError(f"no config.json in {path}; point at an HF checkpoint directory")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg} is not valid JSON ({e}); re-copy the checkpoint") from None


def model_spec(cfg: dict) -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch_name = next((a for a in archs if a in SUPPORTED), None)
    if arch_name is None:
        raise UserError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(sorted(SUPPORTED))}"
        )
    arch = SUPPORTED[arch_name]
    n_layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    if arch != "qwen3_moe":
        experts = 0
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(
        experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)
    )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(f"rope type {rope_type!r} is not supported yet; use a default-RoPE model")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelSpec(
        arch=arch,
        architecture=arch_name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        num_experts=experts,
        topk=int(cfg.get("num_experts_per_tok", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        dtype=getattr(torch, str(dtype_name)),
    )
