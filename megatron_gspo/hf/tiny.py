"""Tiny random HF checkpoints (Qwen3-MoE, Qwen3, Qwen2) with a locally built tokenizer.

Everything is made on this machine: the model by transformers from a config, the tokenizer by the
`tokenizers` library. No hub access. Two tokenizers (TinySpec.tokenizer):

  words  a fixed word list (digits split one per token, so arithmetic and sorting tasks tokenize
         well); EOS <|endoftext|>, no chat template.
  chars  one token per printable character, plus Qwen3's tool tokens (<tool_call>,
         </tool_call>, <tool_response>, </tool_response>) matched whole as non-special added
         tokens; EOS <|im_end|> and CHAT_TEMPLATE (Qwen3's format with a one-line system
         prompt). Decoding gives back any text exactly, and text tokenizes the same in pieces as
         whole, so a multi-turn episode can be built from token ids turn by turn.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.checks import INT_MAX, in_range
from megatron_gspo.errors import UserError
from megatron_gspo.outputs import check_new_output, temp_dir_for

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
BASE_WORDS = (
    [str(d) for d in range(10)]
    + list("+-*/=(),.:?;[]<>")
    + "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    + "what is sort add sum answer the of and then reverse count max min list".split()
)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # "\n" and " " are tokens
TOKENIZERS = ("words", "chars")
# Qwen3's chat format (tool calls as JSON in <tool_call> blocks, tool results in a user turn),
# with a one-line system prompt naming the tools in place of Qwen3's long JSON one.
CHAT_TEMPLATE = r"""
{%- if tools %}{{- '<|im_start|>system\ntools: ' }}{%- for t in tools %}{{- (t.function.name if t.function is defined else t.name) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (m.content or '') }}
{%- for tc in (m.tool_calls or []) %}
{%- set f = tc.function if tc.function is defined else tc %}
{%- if (loop.first and m.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


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
    tokenizer: str = "words"  # words | chars (see the module docstring)


def vocabulary(vocab_size: int, kind: str = "words") -> list[str]:
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {kind!r}; choose words or chars")
    words = SPECIAL_TOKENS + (BASE_WORDS if kind == "words" else TOOL_TOKENS + CHARS)
    if vocab_size < len(words):
        raise ValueError(f"--vocab-size must be at least {len(words)} (the base {kind} list)")
    return words + [f"<extra_{i}>" for i in range(vocab_size - len(words))]


def build_tokenizer(vocab_size: int, kind: str = "words"):
    """words: whitespace/punctuation split, digits one per token. chars: one token a character,
    the tool tokens whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(vocabulary(vocab_size, kind))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if kind == "words":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
        )
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    else:
        # every character (newlines too) is its own piece, and Fuse joins them back
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
        tok.decoder = decoders.Fuse()
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
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


# The flag of make-tiny-model that sets each config.json key model_spec checks.
FLAG_OF_KEY = {
    "num_hidden_layers": "--layers",
    "hidden_size": "--hidden",
    "num_attention_heads": "--heads",
    "num_key_value_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "moe_intermediate_size": "--moe-ffn",
    "intermediate_size": "--ffn",
    "num_experts_per_tok": "--topk",
    "num_experts": "--experts",
    "vocab_size": "--vocab-size",
}


def check_spec(spec: TinySpec) -> None:
    """The checkpoint `spec` describes is one the project reads back: its config.json passes the
    checks that convert, score and serve make of it (a UserError naming the flag otherwise)."""
    from megatron_gspo.hf.config import SUPPORTED, model_spec

    vocabulary(spec.vocab_size, spec.tokenizer)
    in_range(spec.seed, "--seed", 0, INT_MAX)  # (train's seed: the same range)
    # model_spec reads 0 experts, or 0-wide ones, as a dense model: not what was asked for
    for flag, n in (("--experts", spec.experts), ("--moe-ffn", spec.moe_ffn)):
        if spec.arch == "qwen3_moe" and n < 1:
            raise UserError(
                f"{flag} must be >= 1 for a qwen3_moe model, not {n}; "
                "use --arch qwen3 for a dense one"
            )
    _check_dense(spec)
    outside = [i for i in spec.dense_layers if not 0 <= i < spec.layers]
    if outside:
        raise UserError(
            f"--dense-layers {outside[0]} is not a layer of a {spec.layers}-layer model; "
            f"use layer ids in [0, {spec.layers})"
        )
    class_name = {arch: name for name, arch in SUPPORTED.items()}.get(spec.arch, spec.arch)
    try:
        model_spec({**hf_config(spec).to_dict(), "architectures": [class_name]})
    except UserError as e:
        key = min((k for k in FLAG_OF_KEY if k in str(e)), key=str(e).find, default=None)
        raise UserError(f"{e}; set by {FLAG_OF_KEY[key]}" if key else str(e)) from None


# make-tiny-model's flags that shape only an MoE model: (TinySpec field, flag)
MOE_FLAGS = (("experts", "--experts"), ("topk", "--topk"), ("moe_ffn", "--moe-ffn"),
             ("dense_layers", "--dense-layers"), ("norm_topk_prob", "--no-norm-topk-prob"))  # fmt: skip


def _check_dense(spec: TinySpec) -> None:
    """A dense --arch with an MoE-only setting changed from its default: refused, not ignored."""
    default = TinySpec()
    changed = {name: getattr(spec, name) for name, _ in MOE_FLAGS
               if getattr(spec, name) != getattr(default, name)}  # fmt: skip
    check_dense_flags(spec.arch, changed)


def check_dense_flags(arch: str, given: dict[str, Any]) -> None:
    """A dense `arch` with any MoE-only flag given (`given`: TinySpec field -> value, the flags
    on the command line), whatever its value: refused, not ignored."""
    if arch == "qwen3_moe":
        return
    for name, flag in MOE_FLAGS:
        if name not in given:
            continue
        value = given[name]
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        given_as = flag if isinstance(value, bool) or not shown else f"{flag} {shown}"
        raise UserError(
            f"{given_as} sets the experts of an MoE model, and --arch {arch} is dense; "
            f"drop {flag}, or use --arch qwen3_moe"
        )


def make_tiny_model(spec: TinySpec, out: str | os.PathLike) -> Path:
    """Write an HF checkpoint (config, safetensors, tokenizer) to `out`, atomically."""
    import transformers

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or pass another --out")
    check_spec(spec)
    check_new_output(out, "--out")
    config = hf_config(spec)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    with temp_dir_for(out) as tmp:  # (an error, SIGINT or SIGTERM: nothing left behind)
        model.save_pretrained(tmp)
        _save_tokenizer(spec, tmp)
    return out


def _save_tokenizer(spec: TinySpec, path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    chars = spec.tokenizer == "chars"
    extra = {"clean_up_tokenization_spaces": False} if chars else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(spec.vocab_size, spec.tokenizer),
        pad_token="<|pad|>",
        eos_token="<|im_end|>" if chars else "<|endoftext|>",
        unk_token="<unk>",
        **extra,
    )
    eos: int | list[int] = tok.eos_token_id
    if chars:
        tok.chat_template = CHAT_TEMPLATE
        # a chat turn ends at <|im_end|>; generation stops at either end token
        eos = [tok.eos_token_id, SPECIAL_TOKENS.index("<|endoftext|>")]
    tok.save_pretrained(path)
    gen = {"eos_token_id": eos, "pad_token_id": tok.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
