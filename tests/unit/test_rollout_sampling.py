"""Sampling parameters as SGLang parses them, and the sampler's filters."""

import pytest
import torch

from megatron_gspo.server.sampling import (
    BadRequest,
    SamplingParams,
    adjust_logits,
    parse_sampling_params,
    sample,
    sample_batch,
)

pytestmark = pytest.mark.unit


def test_parse_defaults_and_errors():
    sp = parse_sampling_params({"max_new_tokens": 5, "stop": "x", "top_k": None}, 100)
    assert (sp.max_new_tokens, sp.stop, sp.top_k, sp.temperature) == (5, ["x"], -1, 1.0)
    with pytest.raises(BadRequest, match="unknown sampling_params keys: bogus"):
        parse_sampling_params({"bogus": 1}, 100)
    for bad in ({"top_p": 0}, {"max_new_tokens": 1.5}, {"stop_token_ids": [100]}, {"regex": "a"}):
        with pytest.raises(BadRequest):
            parse_sampling_params(bad, 100)


def test_filters_and_seeds():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    assert sample(logits, SamplingParams(temperature=0), None)[0] == 0
    gen = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingParams(top_k=2), gen)[0] for _ in range(200)}
    assert picks == {0, 1}
    picks = {sample(logits, SamplingParams(top_p=0.3), gen)[0] for _ in range(50)}
    assert picks == {0}
    picks = {sample(logits, SamplingParams(min_p=0.5), gen)[0] for _ in range(200)}
    assert picks == {0, 1}

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, SamplingParams(), g)[0] for _ in range(20)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    # the log-prob is of the temperature-scaled distribution, before filtering
    token, lp = sample(logits, SamplingParams(temperature=0.5, top_k=1), None)
    assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[token]))
    token, lp = sample(logits, SamplingParams(temperature=0.5, top_p=0.5), gen)
    assert lp == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[token]))


def test_adjust_logits_min_tokens_and_penalties():
    logits = torch.zeros(5)
    sp = SamplingParams(min_new_tokens=2, stop_token_ids=[3], frequency_penalty=1.0)
    x = adjust_logits(logits, sp, context=[0], output=[2, 2], eos={4})
    assert x[2] == -2.0 and x[3] == 0 and x[4] == 0
    x = adjust_logits(logits, sp, context=[0], output=[2], eos={4})
    assert x[3] == float("-inf") and x[4] == float("-inf") and x[2] == -1.0


def test_sampled_frequencies_follow_the_filtered_distribution():
    """Many rows of one batch: token frequencies match the (filtered, renormalised) softmax, a
    banned token (-inf) is never drawn, and a seeded row ignores its neighbours."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, float("-inf"), -1.0])
    rows = 20000
    gen = torch.Generator().manual_seed(1)
    tokens, logprobs = sample_batch(
        logits.expand(rows, -1), [SamplingParams()] * rows, [None] * rows, gen
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=6).float() / rows
    torch.testing.assert_close(freq, torch.softmax(logits, -1), atol=0.015, rtol=0)
    assert freq[4] == 0
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[tokens[0]]))

    tokens, _ = sample_batch(
        logits.expand(rows, -1), [SamplingParams(top_k=2)] * rows, [None] * rows, gen
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=6).float() / rows
    want = torch.softmax(logits[:2], -1)
    torch.testing.assert_close(freq[:2], want, atol=0.015, rtol=0)
    assert freq[2:].sum() == 0

    def seeded_row(batch: int) -> list[int]:
        g = torch.Generator().manual_seed(7)
        out = []
        for _ in range(10):
            gens = [None] * (batch - 1) + [g]
            out.append(
                sample_batch(logits.expand(batch, -1), [SamplingParams()] * batch, gens, gen)[0][-1]
            )
        return out

    assert seeded_row(1) == seeded_row(5)
