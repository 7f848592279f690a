"""The local RMSNorm (model/norm.py): its fp32 autograd function against autograd's gradients
of the expression it computes (HF Qwen's RMSNorm), bit for bit."""

import pytest
import torch

pytestmark = pytest.mark.unit


def _expression(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(37, 64), (13, 2, 48), (11, 3, 4, 32), (1, 1, 8)])
def test_fp32_function_is_autograds_bit_for_bit(shape):
    from megatron_gspo.model.norm import RmsScale, ScaledByWeight

    g = torch.Generator().manual_seed(len(shape))
    x0 = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 3
    w0 = 1.0 + torch.randn(shape[-1], generator=g) / 5
    grad_out = torch.randn(shape, generator=g)
    out = {}

    def function(x, w, eps):
        return ScaledByWeight.apply(x, RmsScale.apply(x, eps), w)

    for name, fn in (("autograd", _expression), ("function", function)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, 1e-6)
        (y * grad_out).sum().backward()
        out[name] = (y.detach(), x.grad, w.grad)
    for a, b in zip(out["autograd"], out["function"]):
        assert torch.equal(a, b)


def test_module_uses_the_function_in_fp32_only():
    from types import SimpleNamespace

    from megatron_gspo.model.norm import RMSNorm

    norm = RMSNorm(SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False), 16)
    x = torch.randn(5, 16, requires_grad=True)
    assert type(norm(x).grad_fn).__name__ == "ScaledByWeightBackward"
    y = norm(x.detach().bfloat16().requires_grad_())
    assert y.dtype == torch.float32 and "ScaledByWeight" not in type(y.grad_fn).__name__
