"""The chunked LM head (model/lm_head.py) on one rank: log-probs, entropy and the gradients with
respect to the hidden states and the output weight, against log_softmax(h W^T) written out and
against today's path (the whole logits through `vocab_parallel_logprobs`)."""

import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.model.lm_head import lm_head_logprobs
from megatron_gspo.model.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit

T, H, V, VOCAB = 37, 16, 64, 50  # tokens (prime: no chunk size below divides it), padded V


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / 2).to(dtype)
    targets = torch.randint(0, VOCAB, (T,), generator=g)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, targets, g_lp, g_ent


def _grads(fn, h, w, g_lp, g_ent):
    """(log p, H, d/dh, d/dW) of sum(g_lp log p + g_ent H) for fn(h, w) -> (log p, H)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(h, w)
    dh, dw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))
    return lp.detach(), ent.detach(), dh, dw


def _formula(targets):
    def fn(h, w):
        logp = torch.log_softmax((h.double() @ w.double().t())[:, :VOCAB], -1)
        return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    return fn


def _chunked(targets, chunk):
    return lambda h, w: lm_head_logprobs(
        h, w, targets, vocab_size=VOCAB, with_entropy=True, chunk_tokens=chunk
    )


def _today(targets):
    """The output layer's whole logits, then the chunked log-softmax of logprobs.py."""
    return lambda h, w: vocab_parallel_logprobs(
        h @ w.t(), targets, vocab_size=VOCAB, with_entropy=True, fused=False
    )


@pytest.mark.parametrize("chunk", [1, 5, 16, 36, 37, 1000])
def test_fp32_values_and_gradients_match_the_formula_and_todays_path(chunk):
    h, w, targets, g_lp, g_ent = _inputs(torch.float32)
    got = _grads(_chunked(targets, chunk), h, w, g_lp, g_ent)
    ref = _grads(_formula(targets), h, w, g_lp.double(), g_ent.double())
    today = _grads(_today(targets), h, w, g_lp, g_ent)
    for a, b, c in zip(got, ref, today):
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), b.double(), atol=2e-5, rtol=1e-5)
        assert torch.allclose(a, c, atol=2e-5, rtol=1e-5)
    assert torch.all(got[3][VOCAB:] == 0)  # padded vocabulary rows get no gradient
    assert got[3].abs().max() > 0.1 and got[2].abs().max() > 0.1


def test_chunk_size_changes_no_value():
    """Up to fp32 rounding: the matmul kernel a CPU picks depends on the chunk's row count (a
    one-row chunk is a matrix-vector product), so the sums run in another order; a gradient
    entry sums 64 products of about its own size. A chunk-boundary bug moves values by ~0.1."""
    h, w, targets, g_lp, g_ent = _inputs(torch.float32, seed=1)
    one = _grads(_chunked(targets, 1), h, w, g_lp, g_ent)
    for chunk in (3, 8, 64):
        for a, b in zip(one, _grads(_chunked(targets, chunk), h, w, g_lp, g_ent)):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 11, 64])
def test_bf16_matches_todays_bf16_path_and_the_formula(chunk):
    h, w, targets, g_lp, g_ent = _inputs(torch.bfloat16, seed=2)
    got = _grads(_chunked(targets, chunk), h, w, g_lp, g_ent)
    today = _grads(_today(targets), h, w, g_lp, g_ent)
    ref = _grads(_formula(targets), h, w, g_lp.double(), g_ent.double())
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    for a, b, c in zip(got, today, ref):
        scale = c.abs().max().item()
        assert (a.double() - b.double()).abs().max() <= 0.02 * scale
        assert (a.double() - c.double()).abs().max() <= 0.02 * scale


def test_log_probs_alone_and_without_grad():
    h, w, targets, g_lp, _ = _inputs(torch.float32, seed=3)
    formula = _formula(targets)

    def lp_only(h, w):
        lp, ent = lm_head_logprobs(h, w, targets, vocab_size=VOCAB, chunk_tokens=6)
        assert ent is None
        return lp, torch.zeros_like(lp)

    got = _grads(lp_only, h, w, g_lp, torch.zeros(T))
    ref = _grads(formula, h, w, g_lp.double(), torch.zeros(T, dtype=torch.float64))
    for i in (0, 2, 3):
        assert torch.allclose(got[i].double(), ref[i].double(), atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        lp, _ = lm_head_logprobs(h, w, targets, vocab_size=VOCAB, chunk_tokens=6)
    assert torch.allclose(lp.double(), ref[0].double(), atol=2e-5)


def test_weight_gradient_alone_for_a_frozen_input():
    """h without grad (e.g. a frozen trunk): only W's gradient, still right."""
    h, w, targets, g_lp, g_ent = _inputs(torch.float32, seed=4)
    w = w.requires_grad_()
    lp, ent = lm_head_logprobs(h, w, targets, vocab_size=VOCAB, with_entropy=True, chunk_tokens=9)
    (dw,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (w,))
    ref = _grads(_formula(targets), h, w.detach(), g_lp.double(), g_ent.double())
    assert torch.allclose(dw.double(), ref[3].double(), atol=2e-5, rtol=1e-5)


def test_leading_dims_keep_the_targets_shape():
    h, w, targets, _, _ = _inputs(torch.float32, seed=5)
    hb = h[:36].reshape(4, 9, H)
    lp, ent = lm_head_logprobs(hb, w, targets[:36].reshape(4, 9), vocab_size=VOCAB,
                               with_entropy=True, chunk_tokens=7)  # fmt: skip
    flat, _ = lm_head_logprobs(h[:36], w, targets[:36], vocab_size=VOCAB, chunk_tokens=7)
    assert lp.shape == ent.shape == (4, 9)
    assert torch.allclose(lp.reshape(-1), flat, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 1.5, "1k"])
def test_bad_chunk_option_is_a_one_line_error(bad):
    from megatron_gspo.model.builder import BuildOptions

    with pytest.raises(UserError, match="lm_head_chunk_tokens must be an integer >= 0") as e:
        BuildOptions(lm_head_chunk_tokens=bad)
    assert "\n" not in str(e.value)


def test_bad_config_value_is_a_one_line_error(tmp_path):
    from megatron_gspo.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: /m}\n")
    assert load_config(cfg, []).model.lm_head_chunk > 0  # on by default
    assert load_config(cfg, ["model.lm_head_chunk=0"]).model.lm_head_chunk == 0
    for bad in ("-4", "big"):
        with pytest.raises(UserError, match="model.lm_head_chunk must be an integer") as e:
            load_config(cfg, [f"model.lm_head_chunk={bad}"])
        assert "\n" not in str(e.value)


def _record_calls(monkeypatch) -> list:
    """The HeadCall of every head call (what the forward was told to do)."""
    from megatron_gspo.model import lm_head

    made, make = [], lm_head.HeadCall

    def record(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(lm_head, "HeadCall", record)
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 37])
def test_kept_logits_give_the_recomputed_values_and_gradients_bit_for_bit(
    chunk, dtype, monkeypatch
):
    h, w, targets, g_lp, g_ent = _inputs(dtype, seed=7)
    calls = _record_calls(monkeypatch)

    def head(keep_bytes):
        return lambda h, w: lm_head_logprobs(h, w, targets, vocab_size=VOCAB, with_entropy=True,
                                             chunk_tokens=chunk, keep_bytes=keep_bytes)  # fmt: skip

    kept = _grads(head(1 << 20), h, w, g_lp, g_ent)
    recomputed = _grads(head(0), h, w, g_lp, g_ent)
    assert [c.keep_logits for c in calls] == [True, False]
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    ref = _grads(_formula(targets), h, w, g_lp.double(), g_ent.double())
    assert torch.allclose(kept[3].double(), ref[3].double(), atol=0.02 * ref[3].abs().max().item())


def test_logits_are_kept_only_for_a_backward_and_within_the_bound(monkeypatch):
    h, w, targets, _, _ = _inputs(torch.float32, seed=8)
    calls = _record_calls(monkeypatch)
    size = T * VOCAB * 4  # fp32 logits of this rank's valid vocabulary
    for keep_bytes in (size - 1, size):
        lm_head_logprobs(h.requires_grad_(), w, targets, vocab_size=VOCAB, keep_bytes=keep_bytes)
    with torch.no_grad():
        lm_head_logprobs(h, w, targets, vocab_size=VOCAB)
    lm_head_logprobs(h.detach(), w, targets, vocab_size=VOCAB)  # nothing needs a gradient
    assert [c.keep_logits for c in calls] == [False, True, False, False]


def test_bad_keep_bound_is_a_one_line_error(tmp_path):
    from megatron_gspo.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: /m}\n")
    assert load_config(cfg, ["model.lm_head_keep_mb=0"]).model.lm_head_keep_mb == 0
    for bad in ("-1", "lots", "1e400"):
        with pytest.raises(UserError, match="model.lm_head_keep_mb") as e:
            load_config(cfg, [f"model.lm_head_keep_mb={bad}"])
        assert "\n" not in str(e.value)


def test_weight_gradient_into_megatron_main_grad():
    """A weight with megatron DDP's fp32 main_grad: grad_W is added there (on top of what it
    holds), the flag that makes DDP's hook skip the placeholder gradient is set."""
    h, w, targets, g_lp, g_ent = _inputs(torch.bfloat16, seed=6)
    w = w.requires_grad_()
    w.main_grad = torch.full(w.shape, 0.5)
    w.grad_added_to_main_grad = False
    lp, ent = lm_head_logprobs(h, w, targets, vocab_size=VOCAB, with_entropy=True,
                               chunk_tokens=8, into_main_grad=True)  # fmt: skip
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ref = _grads(_formula(targets), h, w.detach(), g_lp.double(), g_ent.double())[3]
    assert w.grad_added_to_main_grad and w.main_grad.dtype == torch.float32
    added = w.main_grad.double() - 0.5
    assert (added - ref.double()).abs().max() <= 0.01 * ref.abs().max().item()
    assert torch.all(added[VOCAB:] == 0)


@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])  # logits recomputed / kept for the backward
def test_selected_rows_are_the_whole_heads_bit_for_bit(keep_bytes):
    """`rows`: the head computes only those positions (0 elsewhere). Their log-probs, entropy
    and d/dh, and d/dW (whose other rows' log-probs get no gradient), equal the head without a
    selection bit for bit, d/dh of the others is 0; chunks where fewer than MIN_GEMM_ROWS rows
    are selected are computed whole (rows 5-7 of chunk 0 below), one without any is skipped."""
    from megatron_gspo.gemm_rows import MIN_GEMM_ROWS
    from megatron_gspo.model.lm_head import plan_rows

    g = torch.Generator().manual_seed(9)
    n = 600  # chunks of 256: 0-255, 256-511, 512-599
    h, w = torch.randn(n, 64, generator=g), torch.randn(300, 64, generator=g) / 4
    targets = torch.randint(0, 300, (n,), generator=g)
    rows = torch.cat([torch.arange(5, 8), torch.arange(300, 420), torch.arange(430, 431)])
    assert len(torch.arange(5, 8)) < MIN_GEMM_ROWS
    mask = torch.zeros(n)
    mask[rows] = 1.0
    g_lp, g_ent = torch.randn(n, generator=g) * mask, torch.randn(n, generator=g) * mask
    plan = plan_rows(n, 300, h.device, 256, rows)
    assert [(c.start, c.stop, local is None) for c, _, local in plan.parts] == [
        (0, 256, True), (256, 512, False)]  # fmt: skip
    out = {}
    for name, sel in (("all", None), ("rows", rows)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = lm_head_logprobs(hh, ww, targets, with_entropy=True, chunk_tokens=256,
                                   keep_bytes=keep_bytes, rows=sel)  # fmt: skip
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        out[name] = (lp.detach(), ent.detach(), hh.grad, ww.grad)
    (lp_a, ent_a, dh_a, dw_a), (lp_r, ent_r, dh_r, dw_r) = out["all"], out["rows"]
    computed = torch.zeros(n, dtype=torch.bool)
    computed[:256] = True
    computed[rows] = True
    assert torch.equal(lp_r[computed], lp_a[computed]) and torch.equal(
        ent_r[computed], ent_a[computed]
    )
    assert torch.all(lp_r[~computed] == 0) and torch.all(ent_r[~computed] == 0)
    assert torch.equal(dh_r[computed], dh_a[computed]) and torch.all(dh_r[~computed] == 0)
    assert torch.equal(dw_r, dw_a) and dw_r.abs().sum() > 0
    assert not torch.equal(lp_r, lp_a)  # (the selection took effect)
