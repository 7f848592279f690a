"""The rollout client's decoding of SGLang answers, without a server; and its wait for servers
to come up, against a port nothing listens on and a server that is not healthy at first."""

import asyncio
import base64
import contextlib
import itertools
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.client import RolloutClient, RolloutError, Sample, decode_routed_experts
from tests.helpers import authorization_recorder, redirector, serving

pytestmark = pytest.mark.unit


@contextlib.asynccontextmanager
async def fake_server(routes: dict):
    """A local aiohttp server for an injected fault: {"/path" (GET) or "POST /path": handler};
    yields its URL."""
    from aiohttp import web

    app = web.Application()
    for key, handler in routes.items():
        method, _, path = key.rpartition(" ")
        app.router.add_route(method or "GET", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def answer(tokens, routed=None, reason="length"):
    meta = {
        "finish_reason": {"type": reason},
        "weight_version": "v7",
        "output_token_logprobs": [[-0.5, t, None] for t in tokens],
    }
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.astype(np.int32).tobytes()).decode()
    return {"output_ids": tokens, "meta_info": meta}


def test_fill_decodes_routed_experts_as_tokens_layers_topk():
    client = RolloutClient("http://127.0.0.1:1", topk=2)
    routed = np.arange(4 * 3 * 2).reshape(4, 3, 2)  # prompt 3 + output 2 - 1 tokens
    s = client._fill(Sample(0, 0, [1, 2, 3]), answer([4, 5], routed), "u", 0.1, want_routed=True)
    assert s.tokens == [4, 5] and s.logprobs == [-0.5, -0.5] and s.weight_version == "v7"
    assert s.finish_reason == "length" and not s.aborted
    np.testing.assert_array_equal(s.routed_experts, routed)


def test_missing_routed_experts_is_an_error_unless_the_sample_is_not_trained_on():
    """(Aborted, or ended for a reason the client does not know.)"""
    client = RolloutClient("http://127.0.0.1:1", topk=2)
    with pytest.raises(RolloutError, match="enable-return-routed-experts"):
        client._fill(Sample(0, 0, [1]), answer([4]), "u", 0.1, want_routed=True)
    s = client._fill(Sample(0, 0, [1]), answer([], reason="abort"), "u", 0.1, want_routed=True)
    assert s.aborted and s.routed_experts is None
    s = client._fill(Sample(0, 0, [1]), answer([4], reason="new"), "u", 0.1, want_routed=True)
    assert s.ended_unknown and s.routed_experts is None


def test_decode_routed_experts_checks_the_size():
    raw = base64.b64encode(np.zeros(10, np.int32).tobytes()).decode()
    with pytest.raises(RolloutError, match="not a multiple"):
        decode_routed_experts(raw, num_tokens=3, topk=2)


def test_wait_healthy_fails_fast_where_nothing_listens():
    from megatron_gspo.comm import free_port

    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with RolloutClient(url) as client:
            await client.wait_healthy(timeout_s=300, refused_s=1.0)

    t0 = time.monotonic()
    with pytest.raises(RolloutError, match=f"nothing answers at {url} .* after 1 s"):
        asyncio.run(go())
    assert time.monotonic() - t0 < 5  # not the 300 s health timeout


NOBODY_HOME = """
import asyncio, sys
from megatron_gspo.rollout.client import RolloutClient, RolloutError
client = RolloutClient(sys.argv[1])  # not closed by its caller, as a trainer that stops on it
try:
    asyncio.run(client.wait_healthy(timeout_s=30, refused_s=0.2))
except RolloutError as e:
    print("error:", e, file=sys.stderr)
"""


@pytest.mark.parametrize("where", ["dead", "no such host"])
def test_a_failed_wait_leaves_no_unclosed_session_behind(where):
    """The trainer's error for a dead rollout.urls used to be followed by aiohttp's "Unclosed
    client session" lines: the client the error stopped kept its session open."""
    import subprocess
    import sys

    from megatron_gspo.comm import free_port

    url = f"http://127.0.0.1:{free_port()}" if where == "dead" else "http://nohost.invalid:1"
    proc = subprocess.run(
        [sys.executable, "-c", NOBODY_HOME, url], capture_output=True, text=True, timeout=60
    )
    assert proc.stderr.startswith(f"error: nothing answers at {url}"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_wait_healthy_waits_for_a_server_that_answers_but_is_not_ready():
    """A server that answers 503 (starting) is waited for past the refused grace period."""
    from aiohttp import web

    calls = []

    async def health(request):
        calls.append(time.monotonic())
        return web.Response(status=200 if len(calls) > 8 else 503)  # ~1.6 s of 503s

    async def go():
        async with fake_server({"/health": health}) as url, RolloutClient(url) as client:
            await client.wait_healthy(timeout_s=30, refused_s=0.5)

    asyncio.run(go())
    assert len(calls) == 9 and calls[-1] - calls[0] > 0.5


def failing_server(health: int, messages, posts: list):
    """Routes of a server whose /health answers `health` and whose /generate answers 500 with
    the next of `messages` (an injected fault: an engine that fails every request), each try's
    time in `posts`."""
    from aiohttp import web

    async def health_(request):
        return web.Response(status=health)

    async def generate(request):
        posts.append(time.monotonic())
        text = next(messages)
        return web.json_response({"error": {"message": text}}, status=500)

    return {"/health": health_, "POST /generate": generate}


def generate_one(routes: dict, urls=lambda url: url, logs=lambda url: None, **kw):
    """One sample from a client of the fake server of `routes`; from its URL, the client's
    servers (`urls`) and their logs (`logs`), and the client's options `kw`. 60 s at most."""

    async def go():
        async with fake_server(routes) as url:
            async with RolloutClient(urls(url), server_logs=logs(url), backoff_s=0.01, **kw) as c:
                return await c.generate([[5]], sampling_params={"max_new_tokens": 2})

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_the_same_500_from_a_healthy_server_stops_the_request_in_one_line():
    """A server whose /health is fine while /generate answers the same 500 to a request again
    and again (the built-in server's KV-cache bug: a prompt as long as its cache) is not down:
    the request used to be retried for the whole outage wait (rollout.health_timeout_s, 300 s)
    and end "check that the servers are up". It stops after 5 such answers (~6 s with the
    default back-off), quoting the server's message and naming its log."""
    posts: list[float] = []
    boom = "forward failed: RuntimeError: unsupported operation: boom"
    routes = failing_server(200, itertools.repeat(boom), posts)
    logs = lambda url: {url + "/": "/runs/r/logs/server-0.log"}  # noqa: E731 (any slash)
    t0 = time.monotonic()
    with pytest.raises(RolloutError) as e:
        generate_one(routes, logs=logs, retries=3, outage_s=300)
    line = str(e.value)
    assert time.monotonic() - t0 < 30 and len(posts) == 5  # not the 300 s outage wait
    assert "/generate answered request " in line and "with the same error 5 times" in line
    assert f"while its /health answers 200 (HTTP 500: {boom})" in line, line
    assert line.endswith("traceback is in /runs/r/logs/server-0.log") and "\n" not in line


def test_the_same_500_from_a_server_whose_health_fails_is_waited_for():
    """The built-in server whose engine died answers every /generate the same 500 and /health
    503 until its supervisor restarts it: an outage. Six such answers in the quick retries do
    not stop the request (its /health fails); it waits, and is generated once the server is
    back (after 1 s here)."""
    from aiohttp import web

    posts: list[float] = []
    down = "the generation engine is not running (failed: RuntimeError: boom)"

    def is_down() -> bool:
        return not posts or time.monotonic() < posts[0] + 1.0

    async def health(request):
        return web.Response(status=503 if is_down() else 200)

    async def generate(request):
        failing = is_down()
        posts.append(time.monotonic())
        if failing:
            return web.json_response({"error": {"message": down}}, status=500)
        return web.json_response(_result((7, 8)))

    routes = {"/health": health, "POST /generate": generate}
    [[sample]] = generate_one(routes, retries=5, outage_s=30)
    assert sample.tokens == [7, 8] and len(posts) == 7  # 6 quick tries, then once it is back


def test_500s_of_another_message_each_time_are_waited_for():
    """500s that differ (an out-of-memory that says how much it tried to allocate) may pass:
    waited for up to outage_s as before, the line at the end naming the last one."""
    posts: list[float] = []
    texts = (f"CUDA out of memory; tried to allocate {i} MiB" for i in itertools.count())
    routes = failing_server(200, texts, posts)
    with pytest.raises(RolloutError, match=r"after \d+ attempts \(last: HTTP 500: CUDA out of"):
        generate_one(routes, retries=2, outage_s=2.0)
    assert len(posts) > 5, len(posts)  # past the 5 that stop the same 500 of a healthy server


@pytest.mark.parametrize("text", [
    "CUDA out of memory. Tried to allocate 2.00 GiB", "Not enough memory for the KV cache", "OOM",
])  # fmt: skip
def test_the_same_out_of_memory_500_from_a_healthy_server_is_waited_for(text):
    """An out-of-memory answer may be the load of the moment (other requests holding the
    memory): the same one from a healthy server is waited for up to outage_s, not stopped on
    after 5 as another repeated 500 is."""
    posts: list[float] = []
    routes = failing_server(200, itertools.repeat(text), posts)
    with pytest.raises(RolloutError, match=r"after \d+ attempts \(last: HTTP 500: "):
        generate_one(routes, retries=2, outage_s=2.0)
    assert len(posts) > 5, len(posts)


def test_the_line_that_gives_up_quotes_the_last_5xx_answer():
    """A request whose last try found nothing listening (a server that went away) ended with
    that connection error alone; the 500 an earlier try got, the server's own words, is quoted
    too."""
    from megatron_gspo.comm import free_port

    routes = failing_server(503, itertools.repeat("engine step failed: boom"), [])
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutError) as e:
        generate_one(routes, lambda url: [url, gone], retries=1)
    assert "; the last 5xx answer: HTTP 500: engine step failed: boom)" in str(e.value), e.value


def test_busy_seconds_stops_asking_a_server_that_does_not_report_them():
    """SGLang's /get_server_info has no engine_busy_s and takes ~20 ms: asked once, then the
    step's idle time comes from the trainer's view without another call. A server that reports
    them is asked every time, and one that does not answer is asked again next time. A NaN or
    negative count says nothing (a NaN used to read as an idle time of 0)."""
    from aiohttp import web

    calls = {"sglang": 0, "builtin": 0, "nan": 0, "negative": 0}

    def info(kind, body):
        async def handler(request):
            calls[kind] += 1
            return web.json_response(body)

        return handler

    async def go():
        sglang = {"/get_server_info": info("sglang", {"internal_states": [{"last_gen": 1.0}]})}
        builtin = {"/get_server_info": info("builtin", {"internal_states": [{"engine_busy_s": 2}]})}
        async with fake_server(sglang) as a, fake_server(builtin) as b:
            async with RolloutClient(a) as c:
                assert [await c.busy_seconds() for _ in range(3)] == [None] * 3
            async with RolloutClient([b, b]) as c:
                assert [await c.busy_seconds() for _ in range(3)] == [4.0] * 3
        async with RolloutClient(b) as c:  # nothing listens there now
            assert await c.busy_seconds() is None and not c._busy_unsaid
        for kind, busy in (("nan", float("nan")), ("negative", -1.0)):
            said = {"/get_server_info": info(kind, {"internal_states": [{"engine_busy_s": busy}]})}
            async with fake_server(said) as n, RolloutClient(n) as c:
                assert [await c.busy_seconds() for _ in range(2)] == [None] * 2

    asyncio.run(go())
    assert calls == {"sglang": 1, "builtin": 6, "nan": 1, "negative": 1}


def _result(tokens=(4, 5), lps=None, reason="length", **meta):
    lps = [-0.5] * len(tokens) if lps is None else lps
    entries = [[lp, t, None] for lp, t in zip(lps, tokens)]
    meta = {"finish_reason": {"type": reason}, "output_token_logprobs": entries, **meta}
    return {"output_ids": list(tokens), "meta_info": meta}


WRONG_ANSWERS = {  # what a proxy, another SGLang version or another model's server may send
    "an HTML page with 200": ("<html>\n<body>Bad gateway</body>\n</html>", "not SGLang's"),
    "JSON that is cut off": ('{"output_ids": [4,', "not SGLang's"),
    "a list for an object": ([_result()], "not SGLang's"),
    "no meta_info": ({"output_ids": [4, 5], "text": "hi"}, "not SGLang's"),
    "fewer log-probs than tokens": (
        _result((4, 5, 6), lps=[-0.5]),
        "1 output_token_logprobs for 3",
    ),
    "a token outside the vocabulary": (_result((4, 1000)), "token id 1000, not one of the model's"),
    "a negative token id": (_result((4, -3)), "token id -3"),
    "NaN log-probs": (_result(lps=[float("nan"), -0.1]), r"\[0\] = \[NaN, 4, null\]"),
    "positive log-probs": (_result(lps=[2.5, -0.1]), r"\[0\] = \[2.5, 4, null\]; a log-prob is"),
    "log-probs as strings": (_result(lps=["-0.5", "-0.1"]), r'\[0\] = \["-0.5", 4, null\]'),
    "log-probs of other tokens": (
        {
            "output_ids": [4, 5],
            "meta_info": {
                "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.1, 4], [-0.1, 9]],
            },
        },
        r"\[1\] for token 9, but output_ids\[1\] is 5",
    ),  # fmt: skip
    "a finish reason that is no name": (
        _result(reason=7),
        r'finish_reason \{"type": 7\}, not a name',
    ),
    "routed experts that are not base64": (
        _result(routed_experts="not base64!"),
        "routed_experts is not base64",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_a_wrong_generate_answer_is_a_one_line_error_naming_the_server(case):
    """Each used to raise KeyError/TypeError/ValueError (a traceback), or to pass into a sample
    silently (wrong-length log-probs, token ids the embedding cannot hold, NaN or positive
    log-probs, a finish reason nothing counts): now one RolloutError (a UserError: one line,
    exit 2) naming the server and rollout.urls."""
    from aiohttp import web

    body, expected = WRONG_ANSWERS[case]

    async def generate(request):
        if isinstance(body, str):
            return web.Response(text=body, content_type="text/html")
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def go():
        async with fake_server({"POST /generate": generate}) as url:
            async with RolloutClient(url, vocab_size=100, topk=2) as client:
                with pytest.raises(RolloutError) as e:
                    await client.generate([[1, 2]], sampling_params={"max_new_tokens": 3})
                return url, str(e.value)

    url, error = asyncio.run(asyncio.wait_for(go(), 30))
    assert isinstance(RolloutError(), UserError)
    assert error.startswith(f"{url}/generate answered ") and "\n" not in error, error
    assert re.search(expected, error), error
    assert error.endswith("check that rollout.urls points at an SGLang-compatible server (not a "
                          "proxy's page) serving the model being trained")  # fmt: skip


def _generate_route(answer_of):
    """A /generate handler answering each prompt with the (finish reason, tokens)
    `answer_of(input_ids)`; a batch request (a prompt's group) gets a list."""
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        batch = isinstance(body["rid"], list)
        prompts = body["input_ids"] if batch else [body["input_ids"]]
        results = [_result(answer_of(ids)[1], reason=answer_of(ids)[0]) for ids in prompts]
        return web.json_response(results if batch else results[0])

    return generate


def test_a_finish_reason_the_client_does_not_know_ends_its_sample_with_one_warning(caplog):
    """A server newer than the client (SGLang adding a finish reason) stopped the run at its
    first such answer. Now such a sample ends there, as the server said, marked
    `ended_unknown`; the server and the reason are named in one warning, once."""
    route = _generate_route(lambda ids: ("content_filter", (5, 6)))

    async def go():
        async with fake_server({"POST /generate": route}) as url:
            async with RolloutClient(url, vocab_size=100) as client:
                first = await client.generate([[1, 2], [3]], n=2, grouped=True)
                again = await client.generate([[4]], n=3)
                return url, [s for g in first + again for s in g]

    url, samples = asyncio.run(asyncio.wait_for(go(), 30))
    assert len(samples) == 7
    for s in samples:
        assert (s.tokens, s.logprobs, s.finish_reason) == ([5, 6], [-0.5, -0.5], "content_filter")
        assert s.ended_unknown and not s.aborted and s.server == url
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", (
        f'{url}/generate answered finish_reason "content_filter", not one this trainer knows '
        "(stop, length, abort; a newer SGLang's?): each such sample ends there and its group "
        "is not trained on (said once for this server and reason)"
    ))]  # fmt: skip


def test_a_group_with_a_finish_reason_the_trainer_does_not_know_is_dropped(tmp_path, caplog):
    """The step's batch, from a server that ends prompt 0's samples, before any token, for a
    reason the trainer does not know: that group is dropped (counted as a failed reward, whose
    line names the server and the reason, and no log: reward.log has nothing of it), not taken
    for an empty rollout that stops the run; the other group is trained on."""
    from megatron_gspo.config import load_config
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
    from megatron_gspo.train.generate import Generation
    from megatron_gspo.train.io_thread import IoThread
    from megatron_gspo.train.producer import BatchProducer, PromptSet

    hf = make_tiny_model(TinySpec(), tmp_path / "model")
    cfg = load_config(None, [f"model.path={hf}", "rollout.group_size=2",
                             "rollout.prompts_per_step=2"])  # fmt: skip
    prompts = PromptSet(cfg, hf)
    ids = [prompts.encode(row.prompt) for row in prompts.train.rows[:2]]
    assert ids[0] != ids[1]
    route = _generate_route(
        lambda got: ("content_filter", ()) if got == ids[0] else ("stop", (5, 6))
    )
    # (a run directory: its reward.log has none of these, so the line names no log)
    io, gen = IoThread(), Generation(cfg, prompts.tokenizer, tmp_path / "run")
    server = fake_server({"POST /generate": route})  # (on the loop the client runs on)
    try:
        url = io.run(server.__aenter__())
        client = RolloutClient(url, vocab_size=128)
        facts = BatchProducer(cfg, prompts, gen, client, io).produce([0, 1], step=1)
        io.run(client.close())
    finally:
        io.run(server.__aexit__(None, None, None))
        gen.close()
        io.close()
    assert facts.batch is not None and len(facts.batch) == 2
    assert facts.batch.row_values("tokens") == [ids[1] + [5, 6]] * 2
    assert facts.metrics["reward/failed_samples"] == 2.0
    assert facts.metrics["rollout/reward_failed_groups_dropped"] == 1.0
    step_line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1")]
    assert step_line == [
        "step 1: the reward failed on 2 of 4 samples; their groups are dropped (first: "
        f'{url} ended its generation with finish reason "content_filter", which this trainer '
        "does not know)"
    ]


def test_an_episode_ends_at_a_turn_with_a_finish_reason_the_trainer_does_not_know():
    """Such a turn went on to the environment and the episode on to its next turn, which
    ended it as "stop" (trained on with the environment's reward). Now the episode ends at
    that turn, with its reason, and is scored as a failed reward (its group is dropped)."""
    from transformers import PreTrainedTokenizerFast

    from megatron_gspo.data.prompts import PromptRow
    from megatron_gspo.hf.tiny import CHAT_TEMPLATE, build_tokenizer
    from megatron_gspo.rollout.env import EnvCalls
    from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits
    from megatron_gspo.train.generate import Generation

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(128, "chars"),
                                  chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>")  # fmt: skip
    calls = EnvCalls("tests.unit.user_code:Echo", timeout_s=30.0, vocab_size=128, workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), Limits(3, 8, 64))
    route = _generate_route(lambda ids: ("content_filter", (40, 41)))
    row = PromptRow("p", "a")

    async def go():
        async with fake_server({"POST /generate": route}) as url:
            async with RolloutClient(url, vocab_size=128) as client:
                return url, await runner.run(client, row, [40], {}, False, (0, 0), 1)

    try:
        url, sample = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        calls.close()
    assert (sample.finish_reason, sample.turns, sample.tokens) == ("content_filter", 1, [40, 41])
    scored = Generation(Config(), tok, run_dir=None).score([row], [sample])
    assert scored.rewards == [None] and scored.failures == [
        f'{url} ended its generation with finish reason "content_filter", which this trainer '
        "does not know"
    ]


def _served_check(info: dict):
    """check_served_models against a server whose /model_info and /get_model_info answer what
    `info` gives each (absent: 404), for a trained model of 128 tokens; its error, or None."""
    from aiohttp import web

    from megatron_gspo.rollout.served_model import check_served_models

    def route(path):
        async def handler(request):
            if isinstance(info[path], str):
                return web.Response(text=info[path], content_type="text/html")
            return web.json_response(info[path])

        return handler

    async def go():
        routes = {path: route(path) for path in info}
        async with fake_server(routes) as url, RolloutClient(url) as client:
            try:
                await check_served_models(client, Path("/models/trained"), 128)
            except RolloutError as e:
                return url, str(e)
            return url, None

    return asyncio.run(asyncio.wait_for(go(), 30))


def _checkpoint(where: Path, vocab: int) -> Path:
    where.mkdir()
    (where / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return where


def test_a_server_of_another_vocabulary_is_refused_in_one_line(tmp_path):
    """rollout.urls at servers serving another model went unchecked: their token ids, from
    another vocabulary, were trained on. SGLang's /model_info says no vocabulary: the one of
    the checkpoint at the model path it names, readable here, is compared; a server that says
    its own (the built-in one; here under the older name /get_model_info) is taken at its
    word."""
    other = _checkpoint(tmp_path / "other", 160)
    url, error = _served_check({"/model_info": {"model_path": str(other), "weight_version": "3"}})
    assert error == (
        f"{url} serves {other} (a vocabulary of 160 tokens), not the model being trained, "
        "/models/trained (128 tokens): its token ids would be another vocabulary's; point "
        "rollout.urls at servers of /models/trained"
    )
    url, error = _served_check({"/get_model_info": {"model_path": "m", "vocab_size": 64}})
    assert error == (
        f"{url} serves m (a vocabulary of 64 tokens), not the model being trained, "
        "/models/trained (128 tokens): its token ids would be another vocabulary's; point "
        "rollout.urls at servers of /models/trained"
    )


@pytest.mark.parametrize("case", ["a copy", "a hub name", "not here", "old", "a page", "silent"])
def test_a_server_not_certainly_of_another_model_is_not_refused(tmp_path, case):
    """Only a certain difference refuses: another directory of the same vocabulary (a copy,
    or this run's weights on disk a resumed run's servers report), a model path that is a hub
    name or that this machine does not have, a server without /model_info (an older one), one
    that answers a page there, or one that says no model path, all go on."""
    info = {
        "a copy": {"/model_info": {"model_path": str(_checkpoint(tmp_path / "copy", 128))}},
        "a hub name": {"/model_info": {"model_path": "Qwen/Qwen3-0.6B"}},
        "not here": {"/model_info": {"model_path": str(tmp_path / "elsewhere")}},
        "old": {},
        "a page": {"/model_info": "<html>model</html>", "/get_model_info": "<html>x</html>"},
        "silent": {"/model_info": {"weight_version": "default", "vocab_size": True}},
    }[case]
    assert _served_check(info)[1] is None


@pytest.mark.parametrize("declared", [False, True])
def test_an_answer_larger_than_its_request_can_need_is_not_read(declared):
    """A server answering a request of 3 new tokens with 64 MB (an answer padded with text,
    sent in chunks or with its Content-Length) used to be read whole, at several times its size
    in the trainer's memory, and trained on: now its reading stops at the 1.3 MB that request
    can need (or before it starts, where the Content-Length says more) with one line naming
    the server and the sizes; the rest is never read (the server could not send it)."""
    head = json.dumps(_result())[:-1].encode() + b', "pad": "'
    sent: list[int] = []
    generate = _long_failure(200, head, sent, declared, tail=b'"}', kind="application/json")

    async def go():
        async with fake_server({"POST /generate": generate}) as url:
            async with RolloutClient(url, vocab_size=100) as client:
                with pytest.raises(RolloutError) as e:
                    await client.generate([[1, 2]], sampling_params={"max_new_tokens": 3})
                await asyncio.sleep(0.2)  # (the server sees the connection closed)
                return url, str(e.value)

    url, error = asyncio.run(asyncio.wait_for(go(), 60))
    size = (
        "a body of 67.1 MB (its Content-Length), more than" if declared else "a body of more than"
    )
    assert error == (
        f"{url}/generate answered {size} the 1.3 MB its request can need "
        f"({'not read' if declared else 'not read past that'}); check that rollout.urls points "
        "at an SGLang-compatible server (not a proxy's page) serving the model being trained"
    )
    assert sum(sent) < 16 << 20, sum(sent)  # (what the sockets' buffers hold, at most)


def test_a_batch_answer_of_another_size_names_what_came():
    """A grouped request answered with one object (a server that takes no batches, a proxy's
    page) used to say only "answered 1 results for a batch of 2"."""
    from aiohttp import web

    async def generate(request):
        return web.Response(text="<html>\n<h1>502</h1>\n</html>", content_type="text/html")

    async def go():
        async with fake_server({"POST /generate": generate}) as url:
            async with RolloutClient(url) as client:
                with pytest.raises(RolloutError) as e:
                    await client.generate([[1]], n=2, grouped=True)
                return url, str(e.value)

    url, error = asyncio.run(asyncio.wait_for(go(), 30))
    assert error.startswith(
        f'{url}/generate answered {{"message": "<html>\\n<h1>502</h1>\\n</html>"}}, not a list of '
        "2 results; check that rollout.urls"
    ), error


def test_a_server_that_answers_503_is_backed_off_and_its_page_kept_to_one_line():
    """A server whose /health is fine while /generate answers 503 with an HTML page (overloaded,
    or a proxy in front of a dead one) used to be sent ~200 requests a second for the whole
    outage wait, and its page broke the error (and each warning) over several lines."""
    from aiohttp import web

    posts = []

    async def health(request):
        return web.Response(status=200)

    async def generate(request):
        posts.append(time.monotonic())
        page = "<html>\n<h1>503 Service Unavailable</h1>\n</html>"
        return web.Response(status=503, text=page, content_type="text/html")

    async def go():
        async with fake_server({"/health": health, "POST /generate": generate}) as url:
            async with RolloutClient(url, retries=2, backoff_s=0.05, outage_s=2.0) as client:
                await client.generate([[5]])

    with pytest.raises(RolloutError) as e:
        asyncio.run(asyncio.wait_for(go(), 60))
    assert "(last: HTTP 503: <html> <h1>503 Service Unavailable</h1> </html>)" in str(e.value)
    assert "\n" not in str(e.value)
    assert 5 <= len(posts) <= 12, len(posts)  # backing off (0.05 s doubling, at most 2 s apart)


def _long_failure(status: int, head: bytes, sent: list, declared: bool, tail: bytes = b"",
                  kind: str = "text/html"):  # fmt: skip
    """A handler answering `status` with `head`, 64 MB of padding and `tail` (a proxy's error
    page, a traceback dump, a padded answer), in 1 MB writes counted in `sent`, with or without
    its Content-Length; it stops writing when the client hangs up."""
    from aiohttp import web

    pad, chunk = 64 << 20, b"x" * (1 << 20)

    async def generate(request):
        resp = web.StreamResponse(status=status, headers={"Content-Type": kind})
        if declared:
            resp.content_length = len(head) + pad + len(tail)
        await resp.prepare(request)
        try:
            await resp.write(head)
            for _ in range(pad // len(chunk)):
                await resp.write(chunk)
                sent.append(len(chunk))
            await resp.write(tail)
        except (ConnectionError, RuntimeError):  # (the client hung up)
            pass
        return resp

    return generate


CUT = "(its body cut at 64 KiB, the rest not read)"


@pytest.mark.parametrize("declared", [False, True])
def test_a_5xx_longer_than_its_request_can_need_is_retried_on_another_server(declared, caplog):
    """A server that failed answered 503 with 64 MB (more than the 1.3 MB a request of 3 new
    tokens can need): its body was read as an answer and the run stopped, where a 5xx is to be
    retried on another server. Now only its first 64 KiB are read, for the message (said cut),
    the rest not (the server could not send it), and the second server generates the sample."""
    from aiohttp import web

    sent: list[int] = []
    failing = _long_failure(503, b"<html>\n<h1>503 Service Unavailable</h1>\n", sent, declared)

    async def generate(request):
        return web.json_response(_result((7, 8, 9)))

    async def go():
        async with (
            fake_server({"POST /generate": failing}) as bad,
            fake_server({"POST /generate": generate}) as good,
            RolloutClient([bad, good], retries=1, backoff_s=0.01, vocab_size=100) as client,
        ):
            [[sample]] = await client.generate([[1, 2]], sampling_params={"max_new_tokens": 3})
            await asyncio.sleep(0.2)  # (the failing server sees the connection closed)
            return bad, good, sample

    with caplog.at_level("WARNING", logger="megatron_gspo.rollout.client"):
        bad, good, sample = asyncio.run(asyncio.wait_for(go(), 60))
    assert sample.server == good and sample.tokens == [7, 8, 9], sample
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"rollout request {sample.rid} failed on {bad}: HTTP 503: <html> "
                              "<h1>503 Service Unavailable</h1> xxx")  # fmt: skip
    assert warning.endswith(f"xxx {CUT}") and "\n" not in warning, warning
    assert sum(sent) < 16 << 20, sum(sent)  # (what the sockets' buffers hold, at most)


def test_a_4xx_of_any_length_is_refused_in_one_line_without_reading_it_all():
    """A 413 with a 64 MB page used to be read as an answer (its error a body too long for the
    request, not the server's refusal): it is the refusal, its message from the first 64 KiB."""
    sent: list[int] = []
    failing = _long_failure(413, b"<html>\n<h1>413 Request Entity Too Large</h1>\n", sent, False)

    async def go():
        async with fake_server({"POST /generate": failing}) as url, RolloutClient(url) as client:
            with pytest.raises(RolloutError) as e:
                await client.generate([[1, 2]], sampling_params={"max_new_tokens": 3})
            await asyncio.sleep(0.2)
            return url, str(e.value)

    url, error = asyncio.run(asyncio.wait_for(go(), 60))
    page = "<html> <h1>413 Request Entity Too Large</h1> "
    assert error == f"{url} refused the request: {page}{'x' * (300 - len(page))} {CUT}", error
    assert sum(sent) < 16 << 20, sum(sent)


@pytest.mark.parametrize("said", ["eight", None, -2])
def test_a_top_k_the_server_does_not_say_is_an_error_naming_it(said):
    """SGLang's /model_info has no num_experts_per_tok, and a proxy may send anything there:
    "eight" used to raise ValueError from int()."""
    from aiohttp import web

    async def model_info(request):
        return web.json_response({"model_path": "m", "num_experts_per_tok": said})

    async def go():
        async with fake_server({"/model_info": model_info}) as url, RolloutClient(url) as c:
            with pytest.raises(RolloutError) as e:
                await c.generate([[1]], return_routed_experts=True)
            return url, str(e.value)

    url, error = asyncio.run(asyncio.wait_for(go(), 30))
    assert error == (f"{url}/model_info did not say its top-k (its num_experts_per_tok: "
                     f"{json.dumps(said)}); pass RolloutClient(topk=K)")  # fmt: skip


def test_a_control_answer_of_any_length_is_refused_without_reading_it_all():
    """The answers to control requests (/model_info, /abort_request, weight updates: a few lines
    of JSON) were read whole: a server or proxy answering 64 MB made the trainer hold it all.
    They are read up to 16 MiB; past it one line names the server and the path, the rest unread.
    A /get_server_info past it only leaves the engine's busy time unsaid (a metric)."""
    sent: list[int] = []
    long_page = _long_failure(200, b'{"model_path": "', sent, False)

    async def go():
        async with fake_server({"/model_info": long_page, "/get_server_info": long_page}) as url:
            async with RolloutClient(url) as client:
                with pytest.raises(RolloutError) as e:
                    await client.get(url, "/model_info")
                busy = await client.busy_seconds()
                await asyncio.sleep(0.2)  # (the server sees the connection closed)
                return url, str(e.value), busy

    url, err, busy = asyncio.run(asyncio.wait_for(go(), 60))
    assert err.startswith(f"{url}/model_info answered a body of more than 16.8 MB"), err
    assert "\n" not in err and busy is None
    assert sum(sent) < 48 << 20, sum(sent)  # 16 MiB of each and the sockets' buffers, not 128 MB


# ---- no request follows a redirect ----------------------------------------------------------

NOT_FOLLOWED = "which is not followed (the API key would go with it)"


def test_a_generate_redirect_is_refused_in_one_line_and_not_sent_elsewhere():
    """aiohttp followed a 307 of /generate (the API key dropped, the body sent again) to the host
    it named, and the sample was taken from there. Now it is refused in one line naming the
    server and where it pointed: not followed, and not retried on the other server either (a
    server that redirects is misconfigured, as one that answers 4xx)."""
    seen: list[tuple[str, str | None]] = []

    def generate(h) -> None:
        h.rfile.read(int(h.headers.get("Content-Length") or 0))
        seen.append((h.path, h.headers.get("Authorization")))
        body = json.dumps(_result((7, 8, 9))).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    good, good_server = serving(generate)
    bad, asked, bad_server = redirector(good)

    async def go():
        async with RolloutClient([bad, good], api_key="secret", retries=2, backoff_s=0.01,
                                 vocab_size=100) as client:  # fmt: skip
            with pytest.raises(RolloutError) as e:
                await client.generate([[1, 2]], sampling_params={"max_new_tokens": 3})
            return str(e.value)

    try:
        error = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        good_server.shutdown()
        bad_server.shutdown()
    assert error == (f"{bad}: /generate answered HTTP 307, a redirect to {good}/generate, "
                     f"{NOT_FOLLOWED}; point rollout.urls at the server itself")  # fmt: skip
    assert asked == ["/generate"] and seen == []


def test_a_control_request_redirect_is_refused_and_a_health_redirect_is_not_healthy():
    """The control requests (/model_info, a weight update, /get_server_info) and /health followed
    a redirect to the host it named, and took its answer: a weight update "done" by another
    server, a server "healthy" because another was. Now each is refused in one line naming where
    it pointed; /get_server_info's only leaves the busy time unsaid (a metric), /health's counts
    as not healthy (the wait ends naming it). The other server is asked nothing."""
    other, seen, other_server = authorization_recorder()
    url, asked, server = redirector(other, code=302)

    async def go():
        async with RolloutClient(url, api_key="secret") as client:
            errors = []
            for ask in (client.get(url, "/model_info"),
                        client.post(url, "/update_weight_version", {"new_version": "3"})):  # fmt: skip
                with pytest.raises(RolloutError) as e:
                    await ask
                errors.append(str(e.value))
            busy = await client.busy_seconds()
            with pytest.raises(RolloutError) as e:
                await client.wait_healthy(timeout_s=1)
            return errors, busy, str(e.value)

    try:
        errors, busy, unhealthy = asyncio.run(asyncio.wait_for(go(), 30))
    finally:
        other_server.shutdown()
        server.shutdown()
    assert errors == [
        f"{url}: {path} answered HTTP 302, a redirect to {other}{path}, {NOT_FOLLOWED}; point "
        "rollout.urls at the server itself"
        for path in ("/model_info", "/update_weight_version")
    ]
    assert busy is None
    assert unhealthy == (f"{url} did not become healthy in 1 s (last: /health answered HTTP 302, "
                         f"a redirect to {other}/health, {NOT_FOLLOWED})")  # fmt: skip
    assert asked[:4] == ["/model_info", "/update_weight_version", "/get_server_info", "/health"]
    assert set(asked[4:]) == {"/health"} and seen == []
