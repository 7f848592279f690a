"""The n samples of one prompt (a group request) share one prefill whose cached k/v rows are
copied to the others (`KVCache.copy_prefix`). At every prompt length, the cache's capacity and
those beside it included, fresh or grown, they give what n separate requests with the same seeds
give, and the prompt's log-probs are an HF transformers forward's."""

import pytest
import torch

from megatron_gspo.hf.config import load_hf_config, model_spec
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.server.engine import Engine, Request
from megatron_gspo.server.kv_cache import KVCache
from megatron_gspo.server.model import RolloutModel
from megatron_gspo.server.sampling import SamplingParams
from tests.unit.test_rollout_model import hf_forward, prompt

pytestmark = pytest.mark.unit

N = 3  # samples of the group


@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def ckpt(request, tmp_path_factory):
    spec = TinySpec(kv_heads=request.param, init_std=0.2)
    return make_tiny_model(spec, tmp_path_factory.mktemp(f"kv{request.param}") / "m")


def run(eng: Engine, reqs: list[Request]) -> None:
    eng.waiting.extend(reqs)
    while eng.running or eng.waiting:
        eng._admit()
        eng._step()


def sample(ids: list[int], seed: int) -> Request:
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=seed, ignore_eos=True)
    return Request(list(ids), sp, return_logprob=True, logprob_start_len=0)


@pytest.mark.parametrize("n", [1, 63, 64])
def test_copy_prefix_copies_the_rows_at_any_length(ckpt, n):
    cache = KVCache(model_spec(load_hf_config(ckpt)), torch.float32, slots=4, capacity=64)
    for t in (*cache.k, *cache.v):
        t.normal_(generator=torch.Generator().manual_seed(t.numel()))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy_prefix(1, [0, 3], n)
    for old, t in zip(before, (*cache.k, *cache.v)):
        want = old.clone()
        want[[0, 3], :, :n] = old[1, :, :n]
        assert torch.equal(t, want)


# (capacity the engine's cache is grown to first, prompt lengths tried there)
CASES = [(64, [64, 63, 65]), (320, [320, 64, 128, 319]), (448, [448, 447])]


@pytest.mark.parametrize("capacity,lengths", CASES, ids=[f"cap{c}" for c, _ in CASES])
def test_a_group_at_the_cache_capacity_gives_the_separate_requests_answers(ckpt, capacity, lengths):
    model = RolloutModel.from_pretrained(ckpt)
    eng = Engine(model, eos_ids=set())
    eng.cache.ensure(eng.cache.slots, capacity)
    assert eng.cache.capacity == capacity
    for length in lengths:
        ids = prompt(length, seed=length)
        group = [sample(ids, seed) for seed in range(N)]
        run(eng, group)  # one prefill, its rows copied to the other samples
        alone = [sample(ids, seed) for seed in range(N)]
        for req in alone:
            run(eng, [req])
        assert [r.error for r in group] == [None] * N, group[0].error
        assert [r.output_ids for r in group] == [r.output_ids for r in alone]
        for g, a in zip(group, alone):
            assert g.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-5)
        _, out = hf_forward(ckpt, ids)
        logp = torch.log_softmax(out.logits[0].float(), -1)
        want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        for r in group:
            assert r.input_logprobs[0] is None
            assert r.input_logprobs[1:] == pytest.approx(want, abs=1e-4)
