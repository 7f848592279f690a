"""GPU tier: torch's grouped GEMM as the grouped experts' kernel (model/experts.py) against the
per-expert loop, forward and backward, bf16, with empty experts and group sizes that are not
multiples of anything."""

import pytest
import torch

from megatron_gspo.model.experts import grouped_kernel_applies, grouped_mm, loop_mm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("counts", [[3, 0, 17, 5], [0, 0, 9, 0], [64, 1, 0, 31]])
def test_grouped_kernel_matches_the_loop(counts):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch's grouped GEMM kernel needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    H, N, E = 256, 384, len(counts)
    x = torch.randn(sum(counts), H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(E, H, N, device="cuda", generator=g)).bfloat16().requires_grad_()
    assert grouped_kernel_applies(x, w)
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    y = grouped_mm(x, w, torch.tensor(counts))
    y_ref = loop_mm(x_ref, w_ref, counts)
    dy = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    (y.float() * dy).sum().backward()
    (y_ref.float() * dy).sum().backward()
    for got, want in ((y, y_ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        scale = want.float().abs().max().clamp_min(1e-3)
        assert float((got.float() - want.float()).abs().max() / scale) < 2e-2
    assert all(torch.count_nonzero(w.grad[e]) == 0 for e, n in enumerate(counts) if n == 0)
