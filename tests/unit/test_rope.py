"""The rotary embedding without concatenations (model/rope.py) against megatron-core's own
function: values and gradients bit for bit, in the shapes the BSHD and THD paths pass."""

import pytest
import torch

pytestmark = pytest.mark.unit


def _megatron():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_gspo.model import rope

    rope.use_rotary_halves()
    assert rope_utils._apply_rotary_pos_emb_bshd is rope.rotary_bshd
    assert rope.megatron_rotary() is not rope.rotary_bshd
    return rope.megatron_rotary()


@pytest.mark.parametrize("shape", [(37, 2, 4, 64), (101, 1, 8, 32), (5, 3, 2, 2)])
def test_values_and_gradients_are_megatrons_bit_for_bit(shape):
    from megatron_gspo.model.rope import rotary_bshd

    original = _megatron()
    g = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(*shape[:-1], shape[-1] * 3, generator=g)[..., : shape[-1]]  # strided
    positions = torch.arange(shape[0], dtype=torch.float32)[:, None] * torch.rand(
        shape[-1] // 2, generator=g
    )
    # (megatron's halves are equal; distinct ones check that each half uses its own)
    freqs = torch.cat([positions, positions * 1.3], -1)[:, None, None, :] * 7.0
    grad_out = torch.randn(shape, generator=g)
    out = {}
    for name, fn in (("megatron", original), ("halves", rotary_bshd)):
        t = base.clone().requires_grad_()
        y = fn(t, freqs, mscale=1.25)
        (y * grad_out).sum().backward()
        out[name] = (y.detach(), t.grad)
    (y_m, g_m), (y_h, g_h) = out["megatron"], out["halves"]
    assert torch.equal(y_m, y_h) and torch.equal(g_m, g_h)
    assert not torch.equal(y_m, base)  # (it rotated something)


def test_interleaved_and_partial_rotary_keep_megatrons_function():
    from megatron_gspo.model.rope import rotary_bshd

    original = _megatron()
    g = torch.Generator().manual_seed(3)
    t = torch.randn(6, 1, 2, 8, generator=g)
    freqs = torch.rand(6, 1, 1, 8, generator=g)
    assert torch.equal(rotary_bshd(t, freqs, rotary_interleaved=True),
                       original(t, freqs, rotary_interleaved=True))  # fmt: skip
    partial = torch.rand(6, 1, 1, 4, generator=g)  # rotary over the first half of d only
    assert torch.equal(rotary_bshd(t, partial), original(t, partial))
