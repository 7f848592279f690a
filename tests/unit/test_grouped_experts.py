"""Grouped experts' pieces on a CPU: the grouped GEMM's loop against one matmul per expert
(written out), the per-expert views against the grouped computation, the build options, and the
multi-tensor gradient norm / scaling against megatron's own per-tensor fallback."""

import pytest
import torch

from megatron_gspo.model.experts import (
    cpu_kernel_works,
    expert_views,
    grouped_kernel_applies,
    grouped_mm,
    is_grouped,
    loop_mm,
)
from megatron_gspo.model.without_te import foreach_l2_norm, foreach_scale

pytestmark = pytest.mark.unit


def reference(x_TH, w_EHN, counts):
    """Expert e's rows are the e-th range of counts[e] rows; each its own matmul."""
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x_TH[start : start + n] @ w_EHN[e])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "counts", [[3, 0, 5, 2], [0, 0, 7, 0], [0, 4, 4, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
)
def test_grouped_mm_is_one_matmul_per_expert_with_gradients(counts):
    g = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), 6, generator=g, requires_grad=True)
    w = torch.randn(4, 6, 10, generator=g, requires_grad=True)
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    y = grouped_mm(x, w, torch.tensor(counts))
    y_ref = reference(x_ref, w_ref, counts)
    assert y.shape == (sum(counts), 10)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    dy = torch.randn(y.shape, generator=g)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    # every expert's weight has a gradient, zero for the experts that got no rows
    assert w.grad is not None
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(w.grad[e]) == 0
        else:
            torch.testing.assert_close(w.grad[e], w_ref.grad[e], rtol=1e-6, atol=1e-6)


def test_counts_that_do_not_split_the_rows_are_refused():
    with pytest.raises(ValueError, match="does not split 5 rows over 2 experts"):
        loop_mm(torch.zeros(5, 2), torch.zeros(2, 2, 3), [2, 2])
    with pytest.raises(ValueError, match="over 2 experts"):
        loop_mm(torch.zeros(4, 2), torch.zeros(2, 2, 3), [2, 1, 1])


def test_the_grouped_kernel_takes_fp32_on_a_cpu_with_aligned_widths():
    x, w = torch.zeros(8, 16), torch.zeros(2, 16, 8)
    assert grouped_kernel_applies(x, w) == cpu_kernel_works()
    assert not grouped_kernel_applies(x.bfloat16(), w.bfloat16())  # a CPU in bf16: the loop
    assert not grouped_kernel_applies(x[:, :6], w[:, :6, :])  # rows of 24 bytes: the loop
    assert not grouped_kernel_applies(x[:0], w)  # no rows: the loop (zero weight gradients)


@pytest.mark.skipif(not cpu_kernel_works(), reason="this torch has no CPU grouped GEMM")
@pytest.mark.parametrize("counts", [[37, 0, 74, 5], [0, 0, 40, 0], [1, 1, 1, 1]])
def test_the_cpu_grouped_kernel_is_the_loop_bit_for_bit(counts):
    """fp32 at a width the kernel takes: the same values and gradients as one matmul per
    expert, exactly."""
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    x = torch.randn(sum(counts), 64, generator=g, requires_grad=True)
    w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
    assert grouped_kernel_applies(x, w)
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    y, y_ref = grouped_mm(x, w, counts), reference(x_ref, w_ref, counts)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    for e, n in enumerate(counts):
        assert torch.equal(w.grad[e], w_ref.grad[e] if n else torch.zeros_like(w.grad[e]))


def test_expert_views_compute_what_the_grouped_weights_do():
    """Expert e's views under SequentialMLP's names ([2F, H] fc1 rows gate then up, [H, F]
    fc2) give, as SequentialMLP's linear layers (x @ W.T), the grouped forward's values."""
    E, H, F = 3, 4, 5
    g = torch.Generator().manual_seed(0)
    weight1 = torch.randn(H, E * 2 * F, generator=g)
    weight2 = torch.randn(E * F, H, generator=g)
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), H, generator=g)
    h = grouped_mm(x, weight1.view(E, H, -1), counts)
    gate, up = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    y = grouped_mm(a, weight2.view(E, -1, H), counts)

    prefix = "decoder.layers.1.mlp.experts."
    fc1 = expert_views(prefix + "weight1", weight1, E, H)
    fc2 = expert_views(prefix + "weight2", weight2, E, H)
    assert [n for n, _ in fc1] == [f"{prefix}local_experts.{e}.linear_fc1.weight" for e in range(E)]
    assert [n for n, _ in fc2] == [f"{prefix}local_experts.{e}.linear_fc2.weight" for e in range(E)]
    assert all(t.shape == (2 * F, H) for _, t in fc1) and all(t.shape == (H, F) for _, t in fc2)
    rows, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start : start + n]
        start += n
        g_e, u_e = (xe @ fc1[e][1].T).chunk(2, dim=-1)
        rows.append((torch.nn.functional.silu(g_e) * u_e) @ fc2[e][1].T)
    torch.testing.assert_close(torch.cat(rows), y, rtol=1e-6, atol=1e-6)
    # a view writes the grouped weight (loading HF tensors goes through them)
    fc1[2][1].copy_(torch.full((2 * F, H), 7.0))
    assert torch.all(weight1.view(E, H, -1)[2] == 7.0) and torch.all(weight1.view(E, H, -1)[1] != 7)


def test_grouped_names():
    assert is_grouped("decoder.layers.3.mlp.experts.weight1")
    assert is_grouped("decoder.layers.3.mlp.experts.weight2")
    assert not is_grouped("decoder.layers.3.mlp.experts.local_experts.0.linear_fc1.weight")
    with pytest.raises(ValueError):
        expert_views("decoder.layers.0.mlp.router.weight", torch.zeros(2, 2), 1, 2)


def test_build_options_choose_grouped_and_recompute(tiny_models):
    from megatron_gspo.hf.config import load_hf_config, model_spec
    from megatron_gspo.model.builder import BuildOptions, transformer_config
    from megatron_gspo.model.parallel import ParallelDims

    spec = model_spec(load_hf_config(tiny_models["moe"]))
    dims = ParallelDims()
    assert BuildOptions().grouped() is False  # auto on a CPU: sequential
    sel = transformer_config(spec, dims, BuildOptions(recompute="selective", moe_grouped_gemm=True))
    assert sel.moe_grouped_gemm and sel.recompute_granularity == "selective"
    assert sel.recompute_modules == ["core_attn", "moe_act"]
    seq = transformer_config(spec, dims, BuildOptions(recompute="selective"))
    assert not seq.moe_grouped_gemm and seq.recompute_modules == ["core_attn"]
    full = transformer_config(spec, dims, BuildOptions(recompute="full"))
    assert full.recompute_granularity == "full" and full.recompute_num_layers == 1
    assert transformer_config(spec, dims, BuildOptions()).recompute_granularity is None


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(7, 3), (128,), (1,), (5, 5, 2)]]


def test_foreach_l2_norm_is_the_norm_of_all_gradients():
    grads = _grads(0)
    flag = torch.zeros(1, dtype=torch.int)
    total, per = foreach_l2_norm(2048, flag, [grads], False)
    assert per is None and total.shape == (1,) and total.dtype == torch.float32
    whole = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in grads]))
    torch.testing.assert_close(total[0], whole, rtol=1e-6, atol=0)
    # megatron's fallback (megatron.core.utils.local_multi_tensor_l2_norm), written out
    fallback = torch.norm(torch.tensor([torch.norm(t) for t in grads]))
    assert float(total[0]) == float(fallback)
    _, per = foreach_l2_norm(2048, flag, [grads], True)
    assert per.tolist() == [float(torch.norm(t)) for t in grads]
    empty, _ = foreach_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]


def test_foreach_scale_equals_megatrons_fallback_bit_for_bit():
    from megatron.core.utils import local_multi_tensor_scale

    flag = torch.zeros(1, dtype=torch.int)
    for scale in (0.37, 1.0):
        mine, theirs = _grads(1), _grads(1)
        foreach_scale(2048, flag, [mine, mine], scale)  # in place (gradient clipping)
        local_multi_tensor_scale(2048, flag, [theirs, theirs], scale)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        src = [t.bfloat16() for t in _grads(2)]  # bf16 params -> fp32 main params and back
        mine, theirs = [torch.zeros(t.shape) for t in src], [torch.zeros(t.shape) for t in src]
        foreach_scale(2048, flag, [src, mine], scale)
        local_multi_tensor_scale(2048, flag, [src, theirs], scale)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_megatrons_grad_norm_and_clipping_run_on_the_foreach_ops():
    """Swapped into megatron's clip_grads (what a GPU without TE or apex gets), its own grad
    norm and clipping give what its per-tensor fallback gives (a CPU process, cpu_compat)."""
    from tests.unit.test_cpu_compat import run

    run(
        "import torch\n"
        "from megatron_gspo.model import cpu_compat, without_te\n"
        "from megatron_gspo.comm import free_port\n"
        "cpu_compat.apply()\n"
        "torch.distributed.init_process_group(\n"
        "    'gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "from megatron.core.optimizer import clip_grads\n"
        "def norm_and_clip():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    ps = [torch.nn.Parameter(torch.zeros(s)) for s in [(7, 3), (64,), (2, 2, 5)]]\n"
        "    for p in ps:\n"
        "        p.grad = torch.randn(p.shape, generator=g)\n"
        "    n = clip_grads.get_grad_norm_fp32([p.grad for p in ps])\n"
        "    clip_grads.clip_grad_by_total_norm_fp32(ps, 1.0, n)\n"
        "    return n, [p.grad for p in ps]\n"
        "before = norm_and_clip()\n"
        "without_te.use_foreach_grad_ops()\n"
        "assert clip_grads.l2_norm_impl is without_te.foreach_l2_norm\n"
        "after = norm_and_clip()\n"
        "assert before[0] == after[0] and before[0] > 1, (before[0], after[0])\n"
        "assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))\n"
        "assert abs(float(torch.cat([g.view(-1) for g in after[1]]).norm()) - 1) < 1e-5\n"
        "print('ok')\n",
        "ok",
    )
