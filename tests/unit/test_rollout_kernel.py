"""The compiled decode step (server/decode_kernel.c) against HF transformers and the torch path:
log-probs, routed experts, weight updates seen by the packed weight copies, the fallback switch."""

import pytest
import torch

from megatron_gspo.hf.tiny import make_tiny_model
from megatron_gspo.server import kernels
from megatron_gspo.server.model import Chunk, RolloutModel
from tests.unit.test_rollout_model import SPECS, hf_forward, prompt

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    if kernels.library() is None:
        pytest.skip("no C compiler here: the decode kernel is not built")
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_model(spec, root / arch) for arch, spec in SPECS.items()}


def compiled(path) -> RolloutModel:
    model = RolloutModel.from_pretrained(path)
    assert kernels.attach(model, "c") and model.decode_kernel is not None
    return model


def decode_all(model: RolloutModel, tokens: list[int], prefill: int, routing: bool = False):
    """Logits of every position: a prefill of `prefill` tokens (torch), then one token per step
    in slot 2 of a cache shared with another sequence decoding in slot 0 (so the steps are
    batches of two one-token chunks, the kernel's case)."""
    other = prompt(6, seed=11)
    cache = model.new_cache(slots=1, capacity=4)  # grows during the run
    first = [Chunk(2, 0, tokens[:prefill], logits_from=0), Chunk(0, 0, other)]
    out = model.forward(first, cache, record_routing=routing)
    logits, routed = [out.logits[0]], [out.routed[0]] if routing else []
    for i in range(prefill, len(tokens)):
        step = [Chunk(0, len(other) + i - prefill, [7]), Chunk(2, i, [tokens[i]])]
        out = model.forward(step, cache, record_routing=routing)
        logits.append(out.logits[1])
        if routing:
            routed.append(out.routed[1])
    return torch.cat(logits), torch.cat(routed) if routing else None


@pytest.mark.parametrize("arch", list(SPECS))
def test_decode_kernel_logprobs_equal_hf(ckpts, arch):
    tokens = prompt(40, seed=4)
    model = compiled(ckpts[arch])
    _, out = hf_forward(ckpts[arch], tokens, model)  # Qwen2's random biases copied in
    ref = torch.log_softmax(out.logits[0].float(), -1)
    logits, _ = decode_all(model, tokens, prefill=5)
    assert ref.std() > 0.5
    torch.testing.assert_close(torch.log_softmax(logits, -1), ref, atol=1e-4, rtol=0)


def test_decode_kernel_routed_experts_equal_torch_path(ckpts):
    tokens = prompt(30, seed=8)
    model = compiled(ckpts["qwen3_moe"])
    fast, routed = decode_all(model, tokens, prefill=4, routing=True)
    model.decode_kernel = None
    slow, routed_torch = decode_all(model, tokens, prefill=4, routing=True)
    assert routed.shape == (30, 2, 2) and routed.dtype == torch.int32
    assert torch.equal(routed, routed_torch)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=0)


def test_decode_kernel_sees_weight_updates(ckpts):
    """The kernel reads packed copies of the weights; a load, and a direct in-place write,
    must both reach the next step."""
    tokens = prompt(16, seed=9)
    model, ref = compiled(ckpts["qwen3_moe"]), RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    decode_all(model, tokens, prefill=3)  # packed copies built
    g = torch.Generator().manual_seed(3)
    names = [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.2.mlp.experts.5.up_proj.weight",
    ]
    update = [(n, torch.randn(model._target(n).shape, generator=g) * 0.3) for n in names]
    model.load_weights(update)
    ref.load_weights(update)
    want, _ = decode_all(ref, tokens, prefill=3)
    torch.testing.assert_close(decode_all(model, tokens, prefill=3)[0], want, atol=1e-4, rtol=0)
    with torch.no_grad():  # not through load_weights: the version counter tells
        for m in (model, ref):
            m.params["lm_head.weight"].mul_(1.5)
            m.experts[1]["down"][2].zero_()
    want, _ = decode_all(ref, tokens, prefill=3)
    torch.testing.assert_close(decode_all(model, tokens, prefill=3)[0], want, atol=1e-4, rtol=0)


def test_modes(ckpts):
    model = RolloutModel.from_pretrained(ckpts["qwen3"])
    assert not kernels.attach(model, "torch") and model.decode_kernel is None
    assert kernels.attach(model, "auto") and model.decode_kernel is not None
    with pytest.raises(ValueError, match="decode kernel mode"):
        kernels.attach(model, "fast")
    bf16 = RolloutModel.from_pretrained(ckpts["qwen3"], dtype=torch.bfloat16)
    assert not kernels.attach(bf16, "auto")
    with pytest.raises(RuntimeError, match="unavailable"):
        kernels.attach(bf16, "c")


def test_failed_build_falls_back(ckpts, tmp_path, monkeypatch):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    monkeypatch.setenv("MEGATRON_GSPO_KERNEL_CACHE", str(tmp_path / "cache"))
    assert kernels._load() is None


def test_sampling_kernel_draws_the_torch_path_tokens(ckpts):
    """Same draws, same rule: greedy, tempered and seeded rows give the torch path's tokens."""
    from megatron_gspo.server.sampling import SamplingParams

    kernel = compiled(ckpts["qwen3"]).decode_kernel
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        logits = torch.randn(12, 256, generator=g) * 3
        params = [SamplingParams(temperature=(0.0, 1.0, 0.7, 1.3)[i % 4]) for i in range(12)]
        tokens, logprobs = draw(logits, params, trial, kernel)
        want, want_lp = draw(logits, params, trial, None)
        assert tokens == want
        assert logprobs == pytest.approx(want_lp, abs=1e-5)


def draw(logits, params, seed, kernel):
    from megatron_gspo.server.sampling import sample_batch

    gens = [None if i % 3 else torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return sample_batch(logits, params, gens, torch.Generator().manual_seed(seed), kernel)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_mixed_batches_split_between_kernel_and_torch(ckpts, arch):
    """A prefill joining running decode steps: the one-token chunks go through the kernel, the
    prefill through torch, in one forward; outputs (and routed experts) come in chunk order."""
    model = compiled(ckpts[arch])
    a, b = prompt(20, seed=2), prompt(13, seed=3)
    full_a, full_b = model.full_logits(a).logits[0], model.full_logits(b).logits[0]
    routing = arch == "qwen3_moe"
    want_routed = model.full_logits(b, record_routing=True).routed if routing else None
    cache = model.new_cache(slots=1, capacity=4)
    got_a = [model.forward([Chunk(3, 0, a[:6], logits_from=0)], cache).logits[0]]
    got_b = []
    for i in range(6, 20):
        step = [Chunk(3, i, a[i : i + 1])]
        if i == 9:  # b's prefill joins, between and after one-token chunks
            step = [Chunk(1, 0, [b[0]]), Chunk(0, 0, b[:9], logits_from=0), *step]
        out = model.forward(step, cache, record_routing=routing)
        got_a.append(out.logits[-1])
        if i == 9:
            assert out.counts == [1, 9, 1]
            got_b.append(out.logits[1])
            if routing:
                assert [r.shape[0] for r in out.routed] == [1, 9, 1]
                assert torch.equal(out.routed[1], want_routed[0][:9])
    torch.testing.assert_close(torch.cat(got_a), full_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_b[0], full_b[:9], atol=1e-4, rtol=0)
