"""Tiny random HF checkpoints (Qwen3-MoE, Qwen3, Qwen2) with a locally built tokenizer.

Everything is made on this machine: the model by transformers from a config, the tokenizer by the
`tokenizers` library from a fixed word list (digits split one per token, so arithmetic and sorting
tasks tokenize well). No hub access.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
BASE_WORDS = (
    [str(d) for d in range(10)]
    + list("+-*/=(),.:?;[]<>")
    + "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    + "what is sort add sum answer the of and then reverse count max min list".split()
)


@dataclass
class TinySpec:
    """Sizes of a tiny model. Defaults: ~0.1M params, 2 layers, 8 experts, top-2."""

    arch: str = "qwen3_moe"  # qwen3_moe | qwen3 | qwen2
    vocab_size: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    moe_ffn: int = 32
    experts: int = 8
    topk: int = 2
    dense_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02


def vocabulary(vocab_size: int) -> list[str]:
    words = SPECIAL_TOKENS + BASE_WORDS
    if vocab_size < len(words):
        raise ValueError(f"--vocab-size must be at least {len(words)} (the base word list)")
    return words + [f"<extra_{i}>" for i in range(vocab_size - len(words))]


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer: whitespace/punctuation split, digits one per token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(vocabulary(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def hf_config(spec: TinySpec):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.ffn,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        torch_dtype=spec.dtype,
    )
    if spec.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            # the config keeps keys its signature does not list (head_dim) as attributes
            head_dim=spec.head_dim,  # type: ignore[call-arg]
            moe_intermediate_size=spec.moe_ffn,
            num_experts=spec.experts,
            num_experts_per_tok=spec.topk,
            norm_topk_prob=spec.norm_topk_prob,
            mlp_only_layers=list(spec.dense_layers),
            decoder_sparse_step=1,
            router_aux_loss_coef=0.0,
            **common,
        )
    if spec.arch == "qwen3":
        return transformers.Qwen3Config(head_dim=spec.head_dim, **common)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(f"unknown --arch {spec.arch!r}; choose qwen3_moe, qwen3 or qwen2")


def make_tiny_model(spec: TinySpec, out: str | os.PathLike) -> Path:
    """Write an HF checkpoint (config, safetensors, tokenizer) to `out`, atomically."""
    import transformers

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or pass another --out")
    config = hf_config(spec)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        _save_tokenizer(spec, tmp)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_tokenizer(spec: TinySpec, path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(spec.vocab_size),
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
    )
    tok.save_pretrained(path)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
