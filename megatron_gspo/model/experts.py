"""Grouped MoE experts without Transformer Engine: megatron-core's GroupedMLP with torch's own
grouped GEMM (`torch._grouped_mm`: CUTLASS on Hopper in bf16, a C++ loop over the groups on a CPU
in fp32) as its kernel, and a loop over experts in Python where that kernel does not apply (an
older torch, other dtypes, unaligned shapes).

GroupedMLP holds each projection of all local experts in one parameter, so the optimizer, the
gradient buffers and the norms see two tensors per layer instead of two per expert, and the
matmuls run as one kernel per projection. Its own kernel (the `grouped_gemm` package) and its
bf16-only forward are what this subclass replaces; its weights, initialization, state dict and
dist-checkpoint format (per-expert keys shared with SequentialMLP) stay megatron's.

Legend: T tokens routed to this rank's experts, sorted by expert; H hidden; F the expert ffn
size on this expert-TP rank; E local experts; N a GEMM's output width.

Weight layout (megatron-core's GroupedMLP): weight1 [H, E*2F] is read as w1_EH2F =
weight1.view(E, H, 2F) (the memory reinterpreted, not column blocks of weight1), weight2
[E*F, H] as w2_EFH = weight2.view(E, F, H). So expert e's SequentialMLP `linear_fc1.weight`
[2F, H] is w1_EH2F[e].T and its `linear_fc2.weight` [H, F] is w2_EFH[e].T. The gated unit
splits fc1's output into (gate, up) halves with `chunk(2, -1)`, the same order as
SequentialMLP's fc1 rows, TP shard by TP shard (each rank holds gate_r then up_r).
`expert_views` gives those per-expert views under SequentialMLP's names, so the HF bridge,
weight sync and the checkpoint tools see one model whichever experts it was built with.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import GroupedMLP

_ALIGN_BYTES = 16  # torch._grouped_mm: data pointers and leading strides 16-byte aligned


def grouped_mm(x_TH: torch.Tensor, w_EHN: torch.Tensor, tokens_per_expert) -> torch.Tensor:
    """y_TN with y[rows of expert e] = x[rows of expert e] @ w[e]; the rows of expert e are the
    e-th contiguous range of `tokens_per_expert[e]` rows of x (an expert may have none).

    One `torch._grouped_mm` where it applies (`grouped_kernel_applies`), else one matmul per
    expert over its range. Empty experts still take part in the loop (a [0, H] @ [H, N]
    product), so every weight gets a (zero) gradient."""
    if grouped_kernel_applies(x_TH, w_EHN):
        counts = torch.as_tensor(tokens_per_expert).to(x_TH.device)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # each group's end row
        return torch._grouped_mm(x_TH, w_EHN, offs=offs)
    return loop_mm(x_TH, w_EHN, tokens_per_expert)


def loop_mm(x_TH: torch.Tensor, w_EHN: torch.Tensor, tokens_per_expert) -> torch.Tensor:
    """`grouped_mm` as a loop of E matmuls over contiguous row ranges."""
    sizes = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
    if len(sizes) != w_EHN.shape[0] or sum(sizes) != x_TH.shape[0]:
        raise ValueError(
            f"tokens_per_expert {sizes} does not split {x_TH.shape[0]} rows over "
            f"{w_EHN.shape[0]} experts"
        )
    # unbind, not w[e]: its backward stacks the E gradients once, where indexing would give
    # each expert's gradient as a zero-filled [E, H, N] tensor (E^2 work in the backward)
    parts, weights = torch.split(x_TH, sizes), w_EHN.unbind(0)
    return torch.cat([part @ w for part, w in zip(parts, weights, strict=True)])


def grouped_kernel_applies(x_TH: torch.Tensor, w_EHN: torch.Tensor) -> bool:
    """torch's grouped GEMM takes these operands: it exists; x is 2-D with rows (none: the loop
    keeps the weights' zero gradients) and w 3-D on x's device; they are fp32 on a CPU whose
    torch has the kernel (`cpu_kernel_works`: a C++ loop over the groups, each product the
    loop's matmul bit for bit), or bf16 on a GPU of compute capability 9.0 or newer (its CUTLASS
    kernel's floor); and both pass its layout check, on either device: 16-byte-aligned data
    pointers, each row- or column-major in its last two dims with a leading stride that is a
    multiple of 16 bytes. Their last dims are multiples of 16 bytes as well, so the backward's
    transposed operands and output pass it too."""
    if not hasattr(torch, "_grouped_mm") or x_TH.device != w_EHN.device:
        return False
    if x_TH.dim() != 2 or w_EHN.dim() != 3 or x_TH.shape[0] == 0:  # no rows: the loop
        return False
    if x_TH.device.type == "cpu":
        if x_TH.dtype != torch.float32 or w_EHN.dtype != torch.float32 or not cpu_kernel_works():
            return False
    elif not x_TH.is_cuda or x_TH.dtype != torch.bfloat16 or w_EHN.dtype != torch.bfloat16:
        return False
    elif torch.cuda.get_device_capability(x_TH.device)[0] < 9:
        return False
    align = _ALIGN_BYTES // x_TH.element_size()
    if x_TH.shape[-1] % align or w_EHN.shape[-1] % align:
        return False
    return _aligned(x_TH) and _aligned(w_EHN)


@functools.cache
def cpu_kernel_works() -> bool:
    """This torch's `_grouped_mm` runs on a CPU in fp32, forward and backward, with an empty
    group, and gives the loop's results bit for bit (a torch without a CPU kernel raises)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g)
    w = torch.randn(3, 16, 8, generator=g)
    dy = torch.randn(7, 8, generator=g)  # widths of 16-byte multiples: its layout check
    sizes = [3, 0, 4]
    got = [t.clone().requires_grad_(True) for t in (x, w)]
    ref = [t.clone().requires_grad_(True) for t in (x, w)]
    try:
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        y = torch._grouped_mm(got[0], got[1], offs=offs)
        y.backward(dy)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    y_ref = loop_mm(ref[0], ref[1], sizes)
    y_ref.backward(dy)
    return all(
        torch.equal(a, b) for a, b in [(y, y_ref), *((p.grad, q.grad) for p, q in zip(got, ref))]
    )


def _aligned(t: torch.Tensor) -> bool:
    align = _ALIGN_BYTES // t.element_size()
    if t.data_ptr() % _ALIGN_BYTES:
        return False
    rows, cols = t.shape[-2:]
    s_row, s_col = t.stride()[-2:]
    if s_col == 1 and s_row >= max(1, cols):  # row-major
        return s_row % align == 0
    if s_row == 1 and s_col >= max(1, rows):  # column-major
        return s_col % align == 0
    return False


@contextlib.contextmanager
def _without_grouped_gemm_package():
    """GroupedMLP's constructor asserts that the `grouped_gemm` package imports; this class
    does not use it."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    check = gg.assert_grouped_gemm_is_available
    gg.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        gg.assert_grouped_gemm_is_available = check


class GroupedExperts(GroupedMLP):
    """GroupedMLP whose GEMMs are `grouped_mm`; any dtype, any device.

    forward: h = x @ W1_e (rows of expert e), a = silu(gate(h)) * up(h) * p (the router's
    probability of each (token, expert) pair), y = a @ W2_e: SequentialMLP's computation with
    the experts' weights stacked. `moe_act` selective recompute keeps h and recomputes a."""

    def __init__(self, num_local_experts, config, pg_collection=None):
        if config.moe_apply_probs_on_input:
            raise ValueError("GroupedExperts applies the router's probabilities after fc1 only")
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("GroupedExperts computes SwiGLU experts only")
        with _without_grouped_gemm_package():
            super().__init__(num_local_experts, config, pg_collection)
        self.lora: dict = {}  # "fc1" / "fc2": an adapter shared by the experts (model/lora.py)

    def forward(self, x_TH, tokens_per_expert, probs_T):
        from megatron.core import tensor_parallel

        E, H = self.num_local_experts, self.config.hidden_size
        w1_EH2F = self.weight1.view(E, H, -1)
        w2_EFH = self.weight2.view(E, -1, H)
        probs_T1 = probs_T.unsqueeze(-1)
        h_T2F = grouped_mm(x_TH, w1_EH2F, tokens_per_expert)
        fc1, fc2 = self.lora.get("fc1"), self.lora.get("fc2")
        if fc1 is not None:
            h_T2F = h_T2F + fc1(x_TH).to(h_T2F.dtype)
        if self.activation_recompute and fc2 is None:  # fc2's adapter keeps a for its backward
            ckpt = tensor_parallel.CheckpointWithoutOutput()
            a_TF = ckpt.checkpoint(self._swiglu_with_probs, h_T2F, probs_T1)
            y_TH = grouped_mm(a_TF, w2_EFH, tokens_per_expert)
            ckpt.discard_output_and_register_recompute(y_TH)
            return y_TH, None
        a_TF = self._swiglu_with_probs(h_T2F, probs_T1)
        y_TH = grouped_mm(a_TF, w2_EFH, tokens_per_expert)
        if fc2 is not None:
            y_TH = y_TH + fc2(a_TF).to(y_TH.dtype)
        return y_TH, None

    def _swiglu_with_probs(self, h_T2F, probs_T1):
        """silu(gate) * up * p in h's dtype; megatron's fused kernel where the config fuses it
        (a GPU), the same formula in plain torch otherwise (as SequentialMLP's MLP on a CPU)."""
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(h_T2F, None, probs_T1)
        gate, up = torch.chunk(h_T2F, 2, dim=-1)
        return (F.silu(gate) * up * probs_T1).to(h_T2F.dtype)


def use_grouped_experts(block_spec) -> None:
    """Swap megatron's GroupedMLP for `GroupedExperts` in a (local) block spec, in place."""
    replace_experts_module(block_spec, GroupedMLP, GroupedExperts)


def replace_experts_module(block_spec, old: type, new: type) -> None:
    """Every MoE layer's experts module `old` becomes `new` in a block spec, in place."""
    for layer in block_spec.layer_specs:
        experts = getattr(getattr(layer.submodules.mlp, "submodules", None), "experts", None)
        if experts is not None and experts.module is old:
            experts.module = new


_GROUPED = re.compile(r"(?P<prefix>.*\.mlp\.experts\.)weight(?P<which>[12])")
_FC = {"1": "linear_fc1", "2": "linear_fc2"}


def is_grouped(name: str) -> bool:
    """The name is a GroupedMLP / GroupedExperts weight (`...mlp.experts.weight1` / `weight2`)."""
    return _GROUPED.fullmatch(name) is not None


def expert_views(
    name: str, param: torch.Tensor, num_local_experts: int, hidden: int
) -> list[tuple[str, torch.Tensor]]:
    """Per-expert views of a grouped weight under SequentialMLP's parameter names:
    `...experts.weight1` -> (`...experts.local_experts.{e}.linear_fc1.weight`, [2F, H] view),
    `...experts.weight2` -> (`...experts.local_experts.{e}.linear_fc2.weight`, [H, F] view).
    Views share the parameter's storage: writing one writes the parameter."""
    m = _GROUPED.fullmatch(name)
    if m is None:
        raise ValueError(f"{name} is not a grouped expert weight")
    data = param.detach()
    if m["which"] == "1":
        stacked = data.view(num_local_experts, hidden, -1)  # [E, H, 2F]
    else:
        stacked = data.view(num_local_experts, -1, hidden)  # [E, F, H]
    fc = _FC[m["which"]]
    views = [(f"{m['prefix']}local_experts.{e}.{fc}.weight", stacked[e].t())
             for e in range(num_local_experts)]  # fmt: skip
    adapter = getattr(param, "lora_adapter", None)  # a shared LoRA adapter: every view's
    if adapter is not None:
        for _, view in views:
            view.lora_adapter = adapter  # type: ignore[attr-defined]
    return views
