"""The built-in rollout server as a subprocess, driven by the async client and raw HTTP:
log-probs and routed experts against a teacher-forced HF forward, SGLang's error shape on every
endpoint, abort, flush, weight updates from disk, and the API key."""

import asyncio
import time

import aiohttp
import pytest
import torch

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient, RolloutError
from tests.e2e.server_process import running_server
from tests.helpers import hold_running

pytestmark = pytest.mark.e2e

KEY = "test-key"
SPEC = TinySpec(arch="qwen3_moe", layers=3, dense_layers=[0], init_std=0.2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    other = TinySpec(**{**SPEC.__dict__, "seed": 5})
    return make_tiny_model(SPEC, root / "a"), make_tiny_model(other, root / "b")


@pytest.fixture(scope="module")
def server(ckpts):
    flags = ("--enable-return-routed-experts",)
    with running_server(ckpts[0], *flags, env={"MEGATRON_GSPO_API_KEY": KEY}) as url:
        yield url


def run(coro):
    return asyncio.run(coro)


async def with_client(url, fn, **kw):
    async with RolloutClient([url], api_key=KEY, **kw) as client:
        return await fn(client)


async def raw(url, method, path, body=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.request(method, url + path, json=body) as r:
            return r.status, await r.json(content_type=None)


def hf_teacher_forced(path, tokens):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    topk = [torch.topk(r.float(), 2, -1).indices.sort(-1).values for r in out.router_logits]
    return logp, torch.stack(topk, 1)  # [T, V], [T, L, k]


def check_against_hf(path, samples):
    for s in samples:
        full = s.prompt_ids + s.tokens
        logp, topk_TLk = hf_teacher_forced(path, full)
        p = len(s.prompt_ids)
        want = logp[p - 1 : -1].gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=1e-4, rtol=0)
        assert s.routed_experts.shape == (len(full) - 1, 3, 2)  # every layer, as SGLang
        assert not s.routed_experts[:, 0].any()  # layer 0 is dense: zeros
        got = torch.from_numpy(s.routed_experts[:, 1:]).sort(-1).values.long()
        assert torch.equal(got, topk_TLk[:-1])


def test_generate_logprobs_and_routing_equal_hf(server, ckpts):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}

    async def go(c):
        return await c.generate(prompts, n=3, sampling_params=sp, return_routed_experts=True)

    groups = run(with_client(server, go))
    assert [len(g) for g in groups] == [3, 3]
    samples = [s for g in groups for s in g]
    assert all(len(s.tokens) == 8 and s.finish_reason == "length" for s in samples)
    assert all(s.weight_version == "default" for s in samples)
    assert len({tuple(s.tokens) for s in groups[0]}) > 1  # seeds differ per sample
    check_against_hf(ckpts[0], samples)
    again = run(with_client(server, go))  # seeded: reproducible
    assert [s.tokens for g in again for s in g] == [s.tokens for s in samples]


def test_grouped_requests_give_the_samples_of_one_request_each(server, ckpts):
    """generate(grouped=True): one batch request per prompt, its samples each with their own
    rid and seed: the same tokens as one request per sample, log-probs and routing as HF's."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}

    def go(grouped):
        async def call(c):
            return await c.generate(prompts, n=3, sampling_params=sp,
                                    return_routed_experts=True, grouped=grouped)  # fmt: skip

        return run(with_client(server, call))

    each, grouped = go(False), go(True)
    assert [[s.tokens for s in g] for g in grouped] == [[s.tokens for s in g] for g in each]
    assert [s.sample_index for s in grouped[1]] == [0, 1, 2]
    assert len({s.rid for g in grouped for s in g}) == 6
    check_against_hf(ckpts[0], [s for g in grouped for s in g])


def test_raw_generate_shapes(server):
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "rid": ["r1", "r2"],
    }
    status, out = run(raw(server, "POST", "/generate", body))
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["r1", "r2"]
    meta = out[0]["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7]
    assert [e[1] for e in meta["output_token_logprobs"]] == out[0]["output_ids"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert "routed_experts" not in meta  # not asked for
    status, out = run(raw(server, "POST", "/generate", {"text": "1 + 2 =", "sampling_params": {}}))
    assert status == 200 and isinstance(out["text"], str) and out["meta_info"]["prompt_tokens"] == 4


BAD_REQUESTS = [
    ("POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokenz": 3}}),
    ("POST", "/generate", {"sampling_params": {}}),
    ("POST", "/generate", {"input_ids": [5, 100000]}),
    ("POST", "/generate", {"input_ids": [5], "sampling_params": {"temperature": -1}}),
    ("POST", "/generate", {"input_ids": [5] * 2048}),  # no room left in the context
    ("POST", "/generate", {"input_ids": [[5], [6]], "rid": "same-for-both"}),
    ("POST", "/abort_request", {"rid": 5}),
    ("POST", "/pause_generation", {"mode": "sideways"}),
    ("POST", "/update_weight_version", {}),
    ("POST", "/update_weights_from_disk", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "load_format": "gguf"}),
]


@pytest.mark.parametrize("method,path,body", BAD_REQUESTS)
def test_bad_requests_get_sglang_error_shape(server, method, path, body):
    status, out = run(raw(server, method, path, body))
    assert status == 400, out
    assert out["success"] is False and out["message"] and out["error"]["message"] == out["message"]


def test_info_endpoints_and_api_key(server, ckpts):
    status, info = run(raw(server, "GET", "/model_info"))
    assert status == 200 and info["architectures"] == ["Qwen3MoeForCausalLM"]
    assert info["model_path"] == str(ckpts[0].resolve()) and info["weight_version"]
    status, info = run(raw(server, "GET", "/server_info"))
    assert status == 200 and info["enable_return_routed_experts"] is True
    assert info["device"] == "cpu"
    assert "api_key" not in str(info) and KEY not in str(info)
    assert run(raw(server, "GET", "/health_generate"))[0] == 200
    assert run(raw(server, "GET", "/health", key=None))[0] == 200
    assert run(raw(server, "GET", "/model_info", key=None))[0] == 401
    assert run(raw(server, "POST", "/generate", {"input_ids": [5]}, key="wrong"))[0] == 401
    status, out = run(raw(server, "GET", "/no_such_endpoint"))
    assert status == 404 and out["success"] is False


def test_engine_busy_time_counts_generation_and_not_idle_time(server):
    """/get_server_info's engine_busy_s (the trainer's time/servers_idle_s comes from it), the
    engine thread's CPU seconds, grows by at most a 1000-token request's wall time while it
    generates (less where the OS gives the thread less than a core), and not while idle."""

    def busy() -> float:
        return run(raw(server, "GET", "/get_server_info"))[1]["internal_states"][0]["engine_busy_s"]

    before = busy()
    time.sleep(1.0)
    idle = busy()
    assert idle - before < 0.01
    t = time.perf_counter()
    sp = {"max_new_tokens": 1000, "ignore_eos": True}  # (long against the HTTP round trip)
    status, _ = run(raw(server, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": sp}))
    wall = time.perf_counter() - t
    worked = busy() - idle
    assert status == 200 and 0.2 * wall < worked <= wall, (worked, wall)

    async def go(client):
        return await client.busy_seconds()

    assert run(with_client(server, go)) == pytest.approx(busy(), abs=1e-9)


def test_abort_returns_partial_output_and_flush_refuses_while_busy(server):
    sp = {"max_new_tokens": 1500, "ignore_eos": True}

    async def go(c):
        start = lambda: c.generate([[5, 6]], n=2, sampling_params=sp)  # noqa: E731
        task = await hold_running(c, server, start, n=2)
        flush = await raw(server, "POST", "/flush_cache")
        await c.abort()
        await c.resume()
        return flush, await task

    (flush_status, flush_body), [group] = run(with_client(server, go))
    assert flush_status == 400 and flush_body["success"] is False
    assert all(s.aborted and 0 < len(s.tokens) < 1500 for s in group)
    assert all(len(s.logprobs) == len(s.tokens) for s in group)

    async def abort_all(c):
        task = await hold_running(c, server, lambda: c.generate([[7]], sampling_params=sp))
        assert (await raw(server, "POST", "/abort_request", {"abort_all": True}))[0] == 200
        await c.resume()
        return await task

    [[sample]] = run(with_client(server, abort_all))
    assert sample.aborted and len(sample.tokens) < 1500
    assert run(raw(server, "POST", "/flush_cache"))[0] == 200


def test_update_weights_from_disk_changes_outputs_and_version(server, ckpts):
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def gen(c):
        return await c.generate([[5, 6, 7]], sampling_params=sp, return_routed_experts=True)

    [[before]] = run(with_client(server, gen))

    async def update(c, path, version):
        await c.update_weights_from_disk(str(path), version)
        return await gen(c)

    [[after]] = run(with_client(server, lambda c: update(c, ckpts[1], "v2")))
    assert after.weight_version == "v2" and after.logprobs != before.logprobs
    check_against_hf(ckpts[1], [after])
    assert run(raw(server, "GET", "/model_info"))[1]["weight_version"] == "v2"
    status, _ = run(raw(server, "POST", "/update_weight_version", {"new_version": "v3"}))
    assert status == 200 and run(raw(server, "GET", "/model_info"))[1]["weight_version"] == "v3"
    [[restored]] = run(with_client(server, lambda c: update(c, ckpts[0], "v4")))
    assert restored.tokens == before.tokens and restored.weight_version == "v4"


def test_client_retries_on_another_server_and_reports_dead_ones(server):
    dead = "http://127.0.0.1:9"  # discard port: connection refused

    async def go(c):
        t0 = time.monotonic()
        [[s]] = await c.generate([[5]], sampling_params={"max_new_tokens": 2})
        return s, time.monotonic() - t0

    # The dead server is tried first (both have load 0; it comes first), then the live one.
    async def both():
        async with RolloutClient([dead, server], api_key=KEY, backoff_s=0.01) as c:
            return await go(c)

    s, _ = run(both())
    assert s.server == server and len(s.tokens) == 2

    async def group_on_both():  # a prompt's group, one batch request: retried whole
        async with RolloutClient([dead, server], api_key=KEY, backoff_s=0.01) as c:
            return await c.generate([[5]], n=3, sampling_params={"max_new_tokens": 2},
                                    grouped=True)  # fmt: skip

    [group] = run(group_on_both())
    assert [x.server for x in group] == [server] * 3 and all(len(x.tokens) == 2 for x in group)

    async def only_dead():
        async with RolloutClient([dead], retries=1, backoff_s=0.01) as c:
            await c.generate([[5]], sampling_params={"max_new_tokens": 2})

    with pytest.raises(RolloutError, match="after 2 attempts"):
        run(only_dead())


def test_weight_update_waits_for_running_requests_unless_paused(server, ckpts):
    """A weight update waits for the running requests; under an in-place pause it runs at once
    and the held request goes on with the new weights. A request on the tiny model can finish
    between two looks (the C decode kernel writes 2000 tokens in milliseconds), so each phase
    starts a request until one is seen running (at most ATTEMPTS times, never an endless wait),
    and the paused phase until the update reports the request it held."""
    sp = {"max_new_tokens": 2000, "ignore_eos": True}
    attempts = 20

    async def started(c):
        """A generate task whose request was seen running, or None if it ended unseen."""
        task = asyncio.create_task(c.generate([[5, 6]], sampling_params=sp))
        while not task.done():
            info = await c.get(server, "/server_info")
            if info["internal_states"][0]["num_running_reqs"]:
                return task
            await asyncio.sleep(0.002)
        await task
        return None

    async def go(c):
        for _ in range(attempts):
            if task := await started(c):
                break
        else:
            pytest.fail(f"no request was seen running in {attempts} tries")
        await c.update_weights_from_disk(str(ckpts[0]), "w-idle")  # waits for the request
        [[waited]] = await task
        body = {"model_path": str(ckpts[0]), "weight_version": "w-paused"}
        for _ in range(attempts):
            if not (task := await started(c)):
                continue
            await c.pause("in_place")
            [answer] = await c.broadcast("/update_weights_from_disk", body)
            await c.resume()
            [[paused]] = await task
            if answer.get("num_paused_requests"):  # else it ended before the pause: again
                return waited, answer, paused
        pytest.fail(f"no update held a paused request in {attempts} tries: {answer}")

    waited, answer, paused = run(with_client(server, go))
    assert waited.finish_reason == "length" and waited.weight_version != "w-idle"
    assert answer["success"] and answer["num_paused_requests"] == 1
    assert paused.finish_reason == "length" and paused.weight_version == "w-paused"


def test_weight_sync_packs_on_cpu_for_a_cpu_server(server):
    """A trainer on a GPU syncing into this CPU server packs buckets in CPU memory (shared memory
    or gloo, not CUDA IPC or NCCL); a server that cannot be asked leaves them on the trainer's."""
    from megatron_gspo.weight_sync.config import ServerRef
    from megatron_gspo.weight_sync.placement import bucket_device
    from megatron_gspo.weight_sync.servers import Servers

    gpu = torch.device("cuda", 0)  # only the device's name: no GPU is touched
    assert bucket_device(gpu, Servers([ServerRef(server, api_key=KEY)])) == torch.device("cpu")
    assert bucket_device(gpu, Servers(["http://127.0.0.1:9"], timeout_s=5)) == gpu
    cpu = torch.device("cpu")
    assert bucket_device(cpu, Servers([ServerRef(server, api_key=KEY)])) == cpu
