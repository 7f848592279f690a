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


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_matches_the_chunked_path_and_the_formula(dtype, with_entropy):
    """The few-pass path (vocab_softmax.py, the default on a GPU) against today's elementwise
    passes and log_softmax written out, padded vocabulary included; gradients too."""
    torch.manual_seed(3)
    logits = (torch.randn(3, 11, 72) * 3).to(dtype)
    targets = torch.randint(0, 60, (3, 11))
    g_lp, g_ent = torch.randn(3, 11), torch.randn(3, 11)

    def run(fused):
        x = logits.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(
            x, targets, vocab_size=60, with_entropy=with_entropy, fused=fused
        )
        obj = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
        (g,) = torch.autograd.grad(obj, x)
        return lp.detach(), (ent.detach() if with_entropy else torch.zeros(())), g

    fused, chunked = run(True), run(False)
    x = logits[..., :60].double().requires_grad_()
    ref_lsm = torch.log_softmax(x, -1)
    ref_lp = ref_lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)
    obj = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0)
    (g_ref,) = torch.autograd.grad(obj, x)
    ref = (ref_lp, ref_ent if with_entropy else torch.zeros(()), g_ref)
    grad_tol = 1e-6 if dtype == torch.float32 else 2e-2 * g_ref.abs().max().item()
    for i, tol in enumerate((1e-5, 1e-5, grad_tol)):
        f, c, r = (
            t[..., :60].double() if i == 2 else t.double() for t in (fused[i], chunked[i], ref[i])
        )
        assert (f - r).abs().max() <= tol and (f - c).abs().max() <= tol
    assert fused[2].dtype == dtype and torch.all(fused[2][..., 60:] == 0)


def test_fused_is_the_default_off_a_cpu_only():
    """fused=None picks the chunked passes on a CPU: bit-identical to fused=False."""
    torch.manual_seed(4)
    logits, targets = torch.randn(2, 5, 30), torch.randint(0, 30, (2, 5))
    default, _ = vocab_parallel_logprobs(logits, targets)
    chunked, _ = vocab_parallel_logprobs(logits, targets, fused=False)
    fused, _ = vocab_parallel_logprobs(logits, targets, fused=True)
    assert torch.equal(default, chunked) and torch.allclose(fused, chunked, atol=1e-6)


def test_fused_chunks_change_no_value(monkeypatch):
    from megatron_gspo.model import vocab_softmax

    torch.manual_seed(5)
    logits, targets = torch.randn(4, 9, 40), torch.randint(0, 40, (4, 9))

    def run():
        x = logits.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, targets, with_entropy=True, fused=True)
        (g,) = torch.autograd.grad(lp.sum() + 0.5 * ent.sum(), x)
        return lp.detach(), ent.detach(), g

    whole = run()
    monkeypatch.setattr(vocab_softmax, "CPU_CHUNK_ELEMENTS", 40 * 5)  # 5 tokens a chunk
    for a, b in zip(whole, run()):
        assert torch.allclose(a, b, atol=1e-6)
