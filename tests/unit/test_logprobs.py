"""Vocab-parallel log-probs and entropy on one rank, against log_softmax written out."""

import pytest
import torch

from megatron_gspo.model.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def test_matches_log_softmax_and_entropy_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    lp, ent = vocab_parallel_logprobs(logits, targets, with_entropy=True)
    ref_logp = torch.log_softmax(logits.float(), -1)
    ref = ref_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    assert torch.allclose(lp, ref, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    (g,) = torch.autograd.grad(lp.sum() + ent.sum(), logits)
    x = logits.detach().double().requires_grad_()
    lx = torch.log_softmax(x, -1)
    want = lx.gather(-1, targets.unsqueeze(-1)).sum() - (lx.exp() * lx).sum()
    (g_ref,) = torch.autograd.grad(want, x)
    assert torch.allclose(g.double(), g_ref, atol=1e-5)


def test_padded_vocabulary_entries_are_excluded():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 64)
    targets = torch.randint(0, 40, (2, 4))
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=40, with_entropy=True)
    ref_logp = torch.log_softmax(logits[..., :40], -1)
    assert torch.allclose(lp, ref_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(ref_logp.exp() * ref_logp).sum(-1), atol=1e-5)
    assert torch.isfinite(ent).all()


def test_small_chunks_give_the_same_values_and_gradients(monkeypatch):
    """Force many chunks per row: chunking must not change the numbers."""
    from megatron_gspo.model import logprobs as mod

    torch.manual_seed(2)
    logits = torch.randn(2, 9, 70, dtype=torch.float64)
    targets = torch.randint(0, 60, (2, 9))

    def run():
        x = logits.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, targets, vocab_size=60, with_entropy=True)
        (g,) = torch.autograd.grad((lp * 1.5).sum() + ent.sum(), x)
        return lp.detach(), ent.detach(), g

    big = run()
    monkeypatch.setattr(mod, "_CHUNK_ELEMENTS", 70 * 2)
    small = run()
    for a, b in zip(big, small):
        assert torch.allclose(a, b, atol=1e-12)
    x = logits[..., :60].clone().requires_grad_()
    ref = torch.log_softmax(x, -1)
    want = (ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * 1.5).sum() - (ref.exp() * ref).sum()
    (g_ref,) = torch.autograd.grad(want, x)
    assert torch.allclose(small[2][..., :60], g_ref, atol=1e-6)  # computed in fp32
    assert torch.all(small[2][..., 60:] == 0)
