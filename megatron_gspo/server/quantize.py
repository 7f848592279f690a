"""FP8 rollout weights for the built-in server (`--quantization fp8`): the train-inference gap of
an FP8 rollout engine against a BF16/FP32 trainer, on a CPU.

What it models is SGLang's online `--quantization fp8` of a BF16 checkpoint: the weights of the
linear layers (attention q, k, v, o; the dense MLP's and every expert's gate, up, down) are
rounded to float8 e4m3 with one scale per tensor, s = amax|W| / 448 (448: e4m3's largest finite
value), W8 = e4m3(W / s) * s. For MoE, one scale per expert and projection. The embeddings,
norms, the router (`mlp.gate`) and `lm_head` stay in the server's dtype, as in SGLang.

The server keeps computing in its dtype (`--dtype`): the weights are quantized and dequantized
in place after every load (W8A16, weight-only). SGLang's FP8 GEMMs on a GPU also quantize the
activations per token, so this is the smaller part of its gap, not all of it.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_LINEAR_SUFFIXES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def is_quantized_param(name: str) -> bool:
    """True for the HF names of the (non-expert) linear weights that fp8 rounds."""
    return name.startswith("model.layers.") and name.endswith(_LINEAR_SUFFIXES)


@torch.no_grad()
def fp8_round_(w: torch.Tensor) -> torch.Tensor:
    """W <- e4m3(W / s) * s in place, s = amax|W| / 448 over the whole tensor (all zeros stay)."""
    x = w.float()
    amax = x.abs().max()
    if amax == 0:
        return w
    scale = amax / E4M3_MAX
    w.copy_((x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale)
    return w
