"""The HF tensors (names and shapes) a `ModelSpec` implies, and the check that a checkpoint's
tensors are exactly those.

Conversion reads tensors by the names the config implies and takes slices of them, so a config
that disagrees with its weights (a smaller vocab_size, tie_word_embeddings beside a trained
lm_head, another hidden_size) would otherwise convert without error into a checkpoint that lost
rows or tensors, or that nothing can load. Checking every name and shape up front, from the
files' headers, costs no weight reads.

Legend: V vocab, H hidden, d head dim, nq / nkv query / key-value heads, F dense ffn, Fm one
expert's ffn, E experts.
"""

from __future__ import annotations

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import ModelSpec

# Buffers some older checkpoints saved beside the weights; recomputed from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every weight tensor of the HF checkpoint `spec` describes, with its shape."""
    V, H, d = spec.vocab_size, spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
    }
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (V, H)
    for layer in range(spec.num_layers):
        out.update(_layer_shapes(spec, layer, q, kv))
    return out


def _layer_shapes(spec: ModelSpec, layer: int, q: int, kv: int) -> dict[str, tuple[int, ...]]:
    H, d = spec.hidden_size, spec.head_dim
    p, attn = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
    out = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        attn + "q_proj.weight": (q, H),
        attn + "k_proj.weight": (kv, H),
        attn + "v_proj.weight": (kv, H),
        attn + "o_proj.weight": (H, q),
    }
    if spec.qkv_bias:
        out.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,)})
        out[attn + "v_proj.bias"] = (kv,)
    if spec.qk_norm:
        out.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
    if spec.moe_layers and spec.moe_layers[layer]:
        out[p + "mlp.gate.weight"] = (spec.num_experts, H)
        out.update(_mlp_shapes(p + "mlp.experts.{e}.", H, spec.moe_ffn_hidden_size, spec))
    else:
        out.update(_mlp_shapes(p + "mlp.", H, spec.ffn_hidden_size, None))
    return out


def _mlp_shapes(prefix: str, H: int, F: int, moe: ModelSpec | None) -> dict:
    experts = range(moe.num_experts) if moe is not None else [None]
    out = {}
    for e in experts:
        at = prefix.format(e=e)
        out.update({at + "gate_proj.weight": (F, H), at + "up_proj.weight": (F, H)})
        out[at + "down_proj.weight"] = (H, F)
    return out


def check_tensors(found: dict[str, tuple[int, ...]], spec: ModelSpec, where: str) -> None:
    """UserError unless `found` ({name: shape}, from the checkpoint at `where`) holds exactly the
    tensors of `spec`, each of its shape. The fix named is the config: the weights are what was
    trained."""
    want = hf_shapes(spec)
    found = {k: v for k, v in found.items() if not k.endswith(IGNORED_SUFFIXES)}
    head = f"{where}: checkpoint and config disagree"
    for name, shape in want.items():
        if name not in found:
            raise UserError(f"{head}: the config implies {name} {shape}, which the weights lack")
        if tuple(found[name]) != shape:
            raise UserError(
                f"{head}: {name} is {tuple(found[name])}, the config implies {shape}; fix "
                "config.json (or re-copy the checkpoint)"
            )
    extra = sorted(set(found) - set(want))
    if extra:
        hint = (
            "; tie_word_embeddings is true, but the weights have their own lm_head"
            if "lm_head.weight" in extra and spec.tie_embeddings
            else ""
        )
        raise UserError(
            f"{head}: the weights hold {len(extra)} tensor(s) the config does not use "
            f"({', '.join(extra[:3])}){hint}; fix config.json"
        )
