"""The built-in server's weights: HF-named tensors laid out for its compute (q|k|v and gate|up
fused, experts stacked), loaded by name or from a checkpoint, every shape checked first."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import ModelSpec, load_hf_config, model_spec
from megatron_gspo.hf.io import HFReader
from megatron_gspo.server.args import QUANTIZATIONS
from megatron_gspo.server.quantize import fp8_round_, is_quantized_param

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


class ModelWeights:
    """The weights of a `RolloutModel` (its base class)."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype | None = None, quantization: str | None = None
    ):
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise UserError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
        self.spec = spec
        self.dtype = dtype or spec.dtype
        self.quantization = quantization  # fp8: linear weights rounded on load (quantize.py)
        self.params: dict[str, torch.Tensor] = {}
        # Fused weights (q|k|v rows, dense gate|up rows): the HF-named params are row views of
        # them, so loading a name fills the fused tensor and one matmul serves all parts.
        self.fused: dict[str, torch.Tensor] = {}
        self.experts: dict[int, dict[str, torch.Tensor]] = {}
        self._alloc()
        # Tensors computed from the weights once (e.g. the per-head q|k norm weight); emptied by
        # every load, so a partial update is never served stale.
        self._derived: dict[str, torch.Tensor] = {}

    def _alloc(self) -> None:
        s, dt = self.spec, self.dtype
        d, hd = s.hidden_size, s.head_dim

        def new(name: str, *shape: int) -> None:
            self.params[name] = torch.zeros(shape, dtype=dt)

        def fused(key: str, parts: list[tuple[str, int]], *cols: int) -> None:
            t = self.fused[key] = torch.zeros(sum(n for _, n in parts), *cols, dtype=dt)
            for (name, _), rows in zip(parts, t.split([n for _, n in parts])):
                self.params[name] = rows

        new("model.embed_tokens.weight", s.vocab_size, d)
        new("model.norm.weight", d)
        if not s.tie_embeddings:
            new("lm_head.weight", s.vocab_size, d)
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            new(p + "input_layernorm.weight", d)
            new(p + "post_attention_layernorm.weight", d)
            qkv = [("q", s.num_heads), ("k", s.num_kv_heads), ("v", s.num_kv_heads)]
            fused(p + "qkv", [(p + f"self_attn.{n}_proj.weight", h * hd) for n, h in qkv], d)
            if s.qkv_bias:
                fused(p + "qkv_bias", [(p + f"self_attn.{n}_proj.bias", h * hd) for n, h in qkv])
            new(p + "self_attn.o_proj.weight", d, s.num_heads * hd)
            if s.qk_norm:
                new(p + "self_attn.q_norm.weight", hd)
                new(p + "self_attn.k_norm.weight", hd)
            if s.moe_layers[i]:
                e, f = s.num_experts, s.moe_ffn_hidden_size
                new(p + "mlp.gate.weight", e, d)
                gate_up = torch.zeros(e, 2 * f, d, dtype=dt)  # one matmul for both
                self.experts[i] = {
                    "gate_up": gate_up,
                    "gate": gate_up[:, :f],
                    "up": gate_up[:, f:],
                    "down": torch.zeros(e, d, f, dtype=dt),
                }
            else:
                f = s.ffn_hidden_size
                fused(
                    p + "gate_up",
                    [(p + "mlp.gate_proj.weight", f), (p + "mlp.up_proj.weight", f)],
                    d,
                )
                new(p + "mlp.down_proj.weight", d, s.ffn_hidden_size)

    def hf_names(self) -> list[str]:
        """Every HF tensor name a full checkpoint of this model holds (experts one by one)."""
        names = list(self.params)
        for i, ex in self.experts.items():
            for j in range(ex["gate"].shape[0]):
                names += [
                    f"model.layers.{i}.mlp.experts.{j}.{w}_proj.weight"
                    for w in ("gate", "up", "down")
                ]
        return names

    def numel(self) -> int:
        """The elements of every weight (what a full update carries)."""
        return sum(self._target(n).numel() for n in self.hf_names())

    def _target(self, name: str) -> torch.Tensor:
        """The tensor (or expert slice) an HF name loads into; UserError for unknown names."""
        if name in self.params:
            return self.params[name]
        m = _EXPERT.fullmatch(name)
        if m and int(m[1]) in self.experts and int(m[2]) < self.spec.num_experts:
            return self.experts[int(m[1])][m[3]][int(m[2])]
        m = _FUSED.fullmatch(name)
        if m and int(m[1]) in self.experts:
            ex = self.experts[int(m[1])]
            return ex["gate_up"] if m[2] == "gate_up_proj" else ex["down"]
        raise UserError(f"weight {name!r} does not belong to this {self.spec.architecture} model")

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors in; all shapes and values are checked before any is written
        (`check_values`). Returns count."""
        items = list(named)
        for name, t in items:
            want = self._target(name).shape
            if tuple(t.shape) != tuple(want):
                raise UserError(
                    f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(want)}"
                )
        for name, t in items:
            check_values(name, t, self.dtype)
        with torch.no_grad():
            for name, t in items:
                self._target(name).copy_(t)
        self._quantize([name for name, _ in items])
        self._derived.clear()
        return len(items)

    def load_checkpoint(self, path: str | Path) -> None:
        """Read every weight of an HF checkpoint directory (the same architecture and sizes)."""
        spec = model_spec(load_hf_config(path))
        if _shape_key(spec) != _shape_key(self.spec):
            raise UserError(f"{path} holds a different model ({spec.architecture}); cannot load it")
        # Straight from the files into the weights: one copy, every header checked first.
        names = self.hf_names()
        targets = [(n, self._target(n)) for n in names]
        HFReader(path).read_into(targets, threads=torch.get_num_threads())
        self._quantize(names)
        self._derived.clear()

    def _quantize(self, names: list[str]) -> None:
        """Round what `names` loaded to fp8 (with quantization), each tensor or expert slice
        on its own scale, so the result does not depend on how the weights were sent."""
        if self.quantization is None:
            return
        for name in names:
            if is_quantized_param(name) or _EXPERT.fullmatch(name):
                fp8_round_(self._target(name))  # the tensor, or one expert's slice
            elif m := _FUSED.fullmatch(name):
                ex = self.experts[int(m[1])]
                for w in ("gate", "up") if m[2] == "gate_up_proj" else ("down",):
                    for j in range(ex[w].shape[0]):
                        fp8_round_(ex[w][j])


# No trained network holds a weight near this; past sqrt(float32's max) ~ 1.8e19 the squares the
# forward takes (norms, attention scores) overflow float32 and bfloat16, and every /generate
# would fail on NaN log-probs (1e38 did).
MAX_WEIGHT = 1e18
_NORMED = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_values(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse (UserError naming the tensor) a weight the server could not compute with: a
    dtype that is no floating point, NaN or inf, a value that is no longer finite once stored in
    `dtype` (1e38 in float16), or one past MAX_WEIGHT."""
    if not t.dtype.is_floating_point:
        raise UserError(f"weight {name!r} is {t.dtype}, not a floating-point tensor")
    if t.numel() == 0:
        return
    if t.dtype not in _NORMED:  # (float8: no reductions on CPU)
        t = t.float()
    largest = torch.linalg.vector_norm(t.detach(), math.inf).item()  # max |x|; NaN if any
    limit = min(MAX_WEIGHT, torch.finfo(dtype).max)
    if not largest <= limit:  # (also NaN)
        kind = "NaN or inf" if not math.isfinite(largest) else f"|value| up to {largest:.3g}"
        raise UserError(
            f"weight {name!r} holds {kind}; weights must be finite and at most {limit:.3g} in "
            f"magnitude (this server computes in {str(dtype).removeprefix('torch.')})"
        )


def _shape_key(spec: ModelSpec) -> tuple:
    d = dict(spec.__dict__)
    d.pop("dtype")
    d.pop("max_position_embeddings")
    return tuple(sorted(d.items()))
