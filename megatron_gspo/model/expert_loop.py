"""megatron-core's SequentialMLP (one MLP per local expert) with its experts' loop as one autograd
node: the same kernels on the same operands, without a module call, two autograd functions and
eight autograd nodes per expert and call.

Legend: T tokens routed to this rank's experts, sorted by expert (T_e of them to expert e); H
hidden; F the expert ffn size on this expert-TP rank; E local experts.

Per expert e, with x_e its rows of x_TH and p_e their router probabilities, megatron's MLP
(SwiGLU, no bias, unfused activation: a CPU's config) computes, on this rank's expert-TP shard
of the weights (its experts' linears leave the communication to the token dispatcher)

    h = x_e W1^T  [T_e, 2F]    gate, up = chunk(h, 2)     s = silu(gate)    u = up + offset
    g = s * u     a = g * p_e   y_e = a W2^T  [T_e, H]    (offset: config.glu_linear_offset)

and y_TH = cat_e(y_e). `ExpertLoop` forms exactly these, and in backward what autograd and
megatron's linear function form from them, in their order: dgrad = dy W, the weight's gradient
dy^T x added into DDP's fp32 `main_grad` (gradient-accumulation fusion, model/cpu_compat.py) or
returned, the products' and silu's gradients as their autograd formulas give them, the
probabilities' gradient summed over F, and the chunk's and the split's gradients concatenated.
So the step is bit for bit megatron's (tests/distributed/test_expert_loop.py), and the study
numbers in docs/results.md stay. On bench/bench_pack.py's long tail (32 experts x 6 layers,
~70 rows an expert) the training phase took 0.94x megatron's loop's time (docs/results.md §4).

Where anything else would run in megatron's experts (a LoRA hook on an expert's linear, biases,
a fused or quantized activation, mixed dtypes, delayed weight gradients, communication inside
a linear), the layer runs megatron's own loop (`SequentialExperts.loop_applies`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.utils import get_pg_size
from torch.autograd.function import once_differentiable

from megatron_gspo.model.experts import replace_experts_module


class ExpertLoop(torch.autograd.Function):
    """(x_TH, probs_T, sizes, offset, fusions, w1_0, w2_0, w1_1, w2_1, ...) -> y_TH.
    `sizes`: T_e per expert; `fusions`: per weight, whether its gradient goes into its
    `main_grad` (megatron's gradient-accumulation fusion on that linear layer)."""

    @staticmethod
    def forward(ctx, x_TH, probs_T, sizes, offset, fusions, *weights):
        xs, ps = torch.split(x_TH, sizes), torch.split(probs_T, sizes)
        y_TH = x_TH.new_empty((x_TH.shape[0], weights[1].shape[0]))
        saved = []
        for e, (x, p, y) in enumerate(zip(xs, ps, torch.split(y_TH, sizes), strict=True)):
            w1, w2 = weights[2 * e], weights[2 * e + 1]
            h = torch.matmul(x, w1.t())
            gate, up = torch.chunk(h, 2, dim=-1)
            s = F.silu(gate)
            u = up + offset
            g = s * u
            p1 = p.unsqueeze(-1)
            a = g * p1
            torch.matmul(a, w2.t(), out=y)  # (megatron: one tensor per expert, then their cat)
            saved.append((x, gate, s, u, g, p1, a))
        ctx.saved, ctx.sizes, ctx.fusions = saved, sizes, fusions
        ctx.save_for_backward(*weights)
        return y_TH

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_TH):
        weights, sizes = ctx.saved_tensors, ctx.sizes
        need_x, need_p = ctx.needs_input_grad[:2]
        # Written in place of megatron's per-expert tensors and their concatenations.
        dx_TH = dy_TH.new_empty((dy_TH.shape[0], weights[0].shape[1]))
        dp_T = dy_TH.new_empty(dy_TH.shape[0])
        dws = []
        parts = zip(torch.split(dy_TH, sizes), torch.split(dx_TH, sizes),
                    torch.split(dp_T, sizes), ctx.saved, strict=True)  # fmt: skip
        for e, (dy, dx, dp, saved) in enumerate(parts):
            w1, w2 = weights[2 * e], weights[2 * e + 1]
            fused = ctx.fusions[2 * e], ctx.fusions[2 * e + 1]
            dws += _expert_backward(dy, saved, w1, w2, fused, dx, dp)
        ctx.saved = None
        return (dx_TH if need_x else None), (dp_T if need_p else None), None, None, None, *dws


def _expert_backward(dy, saved, w1, w2, fused: tuple[bool, bool], dx, dp):
    """One expert's gradients as megatron's MLP and linear function form them: x's into `dx`,
    p's into `dp`; (W1's, W2's) returned."""
    x, gate, s, u, g, p1, a = saved
    da = dy.matmul(w2)
    dw2 = _weight_grad(w2, dy, a, fused[1])
    dg = da * p1
    torch.sum(da * g, -1, out=dp)
    width = gate.shape[-1]
    dh = dg.new_empty((dg.shape[0], 2 * width))  # (megatron: cat(dgate, du), chunk's backward)
    torch.ops.aten.silu_backward.grad_input(dg * u, gate, grad_input=dh[:, :width])
    torch.mul(dg, s, out=dh[:, width:])
    torch.matmul(dh, w1, out=dx)
    dw1 = _weight_grad(w1, dh, x, fused[0])
    return dw1, dw2


def _weight_grad(weight, dy, x, fused: bool):
    """dy^T x: added into the weight's `main_grad` where the layer fuses it (returning what
    megatron's linear function returns then: an unused placeholder, the weight marked so DDP's
    hook skips it, where DDP tracks that), else returned; None where the weight takes none."""
    if not weight.requires_grad:
        return None
    if not fused:
        return dy.t().matmul(x)
    main = weight.main_grad
    kernels = layers.fused_weight_gradient_mlp_cuda  # megatron's; on a CPU model/cpu_compat.py's
    if main.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(x, dy, main)
    elif main.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(x, dy, main)
    else:
        raise RuntimeError(f"no weight-gradient accumulation into a {main.dtype} main_grad")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return torch.empty(main.shape, dtype=x.dtype, device=main.device)


class SequentialExperts(SequentialMLP):
    """SequentialMLP whose experts' loop is `ExpertLoop` where it applies (`loop_applies`),
    megatron's own otherwise. Its modules, weights, state dict and checkpoints are
    SequentialMLP's: only the forward differs."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x, probs = permuted_local_hidden_states, permuted_probs
        if not self.loop_applies(x, probs):
            return super().forward(x, tokens_per_expert, probs)
        sizes = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
        weights, fusions = [], []
        for expert in self.local_experts:
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            weights += [fc1.weight, fc2.weight]
            fusions += [_fuses(fc1), _fuses(fc2)]
        offset = self.config.glu_linear_offset
        return ExpertLoop.apply(x, probs, sizes, offset, fusions, *weights), None

    def loop_applies(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """The experts compute what `ExpertLoop` forms: SwiGLU, unfused, no bias, no clamp or
        quantization, probabilities after fc1, no delayed weight gradient, one dtype throughout,
        no communication in their linears, and nothing hooked on an expert or its linears."""
        c = self.config
        if (c.bias_activation_fusion or c.use_te_activation_func or c.add_bias_linear
                or not c.gated_linear_unit or c.activation_func is not F.silu
                or c.activation_func_clamp_value is not None or c.moe_apply_probs_on_input
                or c.fp8 or c.fp4 or getattr(c, "delay_wgrad_compute", False)):  # fmt: skip
            return False
        if probs.dtype != x.dtype or x.dim() != 2:
            return False
        return all(_plain(expert, x.dtype) for expert in self.local_experts)


def _plain(expert, dtype) -> bool:
    """An expert MLP with no hooks, whose two linears are megatron's, hook-free, with weights of
    `dtype`, no weight-gradient buffering, and no communication (an expert's linears leave it to
    the token dispatcher where their TP group has more than one rank)."""
    fc1, fc2 = expert.linear_fc1, expert.linear_fc2
    if type(fc1) is not layers.ColumnParallelLinear or type(fc2) is not layers.RowParallelLinear:
        return False
    for m in (expert, fc1, fc2):
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return False
    for fc in (fc1, fc2):
        if fc.weight.dtype != dtype or getattr(fc, "bias", None) is not None:
            return False
        if not (fc.explicit_expert_comm or get_pg_size(fc.tp_group) == 1):
            return False
        if getattr(fc, "grad_output_buffer", None) is not None:  # its weight gradient deferred
            return False
    return True


def _fuses(linear) -> bool:
    """megatron's linear function adds this layer's weight gradient into `main_grad`."""
    w = linear.weight
    return bool(linear.gradient_accumulation_fusion) and hasattr(w, "main_grad")


def use_expert_loop(block_spec) -> None:
    """Swap megatron's SequentialMLP for `SequentialExperts` in a (local) block spec, in place."""
    replace_experts_module(block_spec, SequentialMLP, SequentialExperts)
