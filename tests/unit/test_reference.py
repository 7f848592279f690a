"""The reference weights: a frozen copy of the starting parameters swapped in and out of the
policy's own modules. Inside the block the modules hold the copy; after it (also after a raise)
the policy's values come back bit for bit."""

import pytest
import torch

from megatron_gspo.model.reference import ReferenceWeights

pytestmark = pytest.mark.unit


def chunks() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)),
            torch.nn.Linear(3, 2, bias=False)]  # fmt: skip


def values(cs) -> list[torch.Tensor]:
    return [p.detach().clone() for c in cs for p in c.parameters()]


@pytest.mark.parametrize("offload", [False, True])
def test_swap_in_gives_the_start_and_swap_out_restores_the_policy(offload):
    cs = chunks()
    start = values(cs)
    ref = ReferenceWeights(cs, offload=offload)
    assert ref.nbytes == sum(t.numel() * 4 for t in start)
    with torch.no_grad():  # training moves the policy
        for c in cs:
            for p in c.parameters():
                p.add_(torch.randn_like(p))
    policy = values(cs)
    x = torch.randn(4, 5)
    with ref.swapped_in(cs):
        assert all(torch.equal(a, b) for a, b in zip(values(cs), start, strict=True))
        out = cs[1](cs[0](x))
    expected = torch.nn.functional.linear(
        torch.nn.functional.linear(torch.nn.functional.linear(x, start[0], start[1]), start[2],
                                   start[3]), start[4])  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(values(cs), policy, strict=True))
    with ref.swapped_in(cs):  # and again: the copy is still the start
        assert all(torch.equal(a, b) for a, b in zip(values(cs), start, strict=True))


def test_a_raise_inside_still_restores_the_policy():
    cs = chunks()
    ref = ReferenceWeights(cs)
    with torch.no_grad():
        cs[1].weight.mul_(2.0)
    policy = values(cs)
    with pytest.raises(ValueError), ref.swapped_in(cs):
        raise ValueError("a forward failed")
    assert all(torch.equal(a, b) for a, b in zip(values(cs), policy, strict=True))


def test_another_layout_is_refused():
    ref = ReferenceWeights(chunks())
    with pytest.raises(RuntimeError, match="another model layout"), ref.swapped_in(chunks()[:1]):
        pass
