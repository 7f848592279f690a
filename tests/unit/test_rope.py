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


class OneContextRank:
    """The context-parallel group argument of megatron's THD rotary: one rank (all it reads)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _megatron_thd(monkeypatch):
    """megatron-core's own THD rotary, over its own BSHD function (not `rotary_bshd`)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_gspo.model import rope

    original = _megatron()
    assert rope_utils._apply_rotary_pos_emb_thd is rope.rotary_thd
    assert rope.megatron_rotary_thd() is not rope.rotary_thd

    def thd(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", original)
            return rope.megatron_rotary_thd()(*args, **kwargs)

    return thd


@pytest.mark.parametrize("per_token", [False, True], ids=["positions-restart", "per-token"])
def test_thd_values_and_gradients_are_megatrons_bit_for_bit(monkeypatch, per_token):
    """Both of megatron's THD cases: frequencies per position (each packed sequence from 0) and
    per packed token (each sequence at its offset)."""
    from megatron_gspo.model.rope import rotary_thd

    original = _megatron_thd(monkeypatch)
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 5, 12, 20, 21], dtype=torch.int32)
    d = 16
    freqs = torch.rand(21 if per_token else 9, 1, 1, d, generator=g) * 30.0
    base = torch.randn(21, 3, d, generator=g)
    grad_out = torch.randn(21, 3, d, generator=g)
    out = {}
    for name, fn in (("megatron", original), ("ours", rotary_thd)):
        t = base.clone().requires_grad_()
        y = fn(t, cu, freqs, mscale=0.75, cp_group=OneContextRank())
        (y * grad_out).sum().backward()
        out[name] = (y.detach(), t.grad)
    assert torch.equal(out["megatron"][0], out["ours"][0])
    assert torch.equal(out["megatron"][1], out["ours"][1])
    assert not torch.equal(out["ours"][0], base)


def test_thd_reuses_cos_sin_only_for_the_same_unmodified_tensors(monkeypatch):
    """Every layer's queries and keys rotate by one forward's frequencies: formed once, and
    formed again when the frequencies or the sequence bounds are other tensors or modified."""
    from megatron_gspo.model import rope

    original = _megatron_thd(monkeypatch)
    made = []
    real_packed = rope.packed_freqs
    monkeypatch.setattr(rope, "packed_freqs", lambda *a: made.append(1) or real_packed(*a))
    g = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    freqs = torch.rand(8, 1, 1, 8, generator=g) * 10.0
    t = torch.randn(10, 2, 8, generator=g)
    group = OneContextRank()

    def both():
        ours = rope.rotary_thd(t, cu, freqs, cp_group=group)
        return ours, original(t, cu, freqs, cp_group=group)

    for _ in range(3):  # the same tensors: packed and rotated alike, formed once
        ours, ref = both()
        assert torch.equal(ours, ref)
    assert len(made) == 1
    freqs.mul_(1.5)  # modified in place
    ours, ref = both()
    assert torch.equal(ours, ref) and len(made) == 2
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)  # other bounds
    ours, ref = both()
    assert torch.equal(ours, ref) and len(made) == 3
