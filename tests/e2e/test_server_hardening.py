"""No request wedges the built-in rollout server (issue 25): every field is checked before the
engine sees it (400, SGLang's failure shape, the field named), the engine fails a broken request
alone, /health says when the engine thread is gone, slow or idle sockets are closed, and SIGTERM
stops the server even with its engine thread stuck. Real servers over real HTTP; the one test
double is the injected engine fault of tests/e2e/faulty_server.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from tests.e2e.server_process import running_server

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("--read-timeout", "2", "--max-n", "8", "--max-batch-size", "16")
VALID = {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(TinySpec(layers=2), tmp_path_factory.mktemp("hard") / "m")


@pytest.fixture(scope="module")
def server(model):
    with running_server(model, *FLAGS) as url:
        yield url


def post(url: str, path: str, body, timeout: float = 20.0, headers=None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if headers is None else headers
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, path: str, timeout: float = 20.0) -> int:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def generate(url: str, sp: dict | None = None, timeout: float = 20.0, **body) -> tuple[int, dict]:
    body = {"input_ids": [5, 6, 7], "sampling_params": sp or VALID, **body}
    return post(url, "/generate", body, timeout)


def assert_refused(status: int, out: dict, field: str) -> None:
    assert status == 400, out
    assert out["success"] is False and field in out["message"], out["message"]
    assert out["error"]["message"] == out["message"]


# Each used to kill the engine thread (every later /generate hung while /health said 200), give
# NaN log-probs with a 200, build an answer of tens of MB, or answer 500.
REFUSED = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"sampling_seed": 2**63}, "sampling_seed"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"max_new_tokens": float("inf")}, "max_new_tokens"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"top_p": float("nan")}, "top_p"),
    ({"n": 200_000}, "sampling_params.n"),
    ({"stop": [1, 2]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize("sp, field", REFUSED, ids=[str(sp) for sp, _ in REFUSED])
def test_bad_sampling_value_is_400_naming_it(server, sp, field):
    t0 = time.perf_counter()
    status, out = generate(server, {**VALID, **sp})
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert_refused(status, out, field)
    print(f"{sp}: 400 in {elapsed_ms:.1f} ms")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"logprob_start_len": "x"}, "logprob_start_len"),
        ({"logprob_start_len": [1, 2]}, "logprob_start_len"),
        ({"return_logprob": "no"}, "return_logprob"),
        ({"return_routed_experts": 2}, "return_routed_experts"),
        ({"routed_experts_start_len": -1}, "routed_experts_start_len"),
        ({"rid": {"a": 1}}, "rid"),
        ({"input_ids": {"a": 1}}, "input_ids"),
        ({"input_ids": [[5]] * 17}, "--max-batch-size"),
        ({"input_ids": [[5]] * 3, "sampling_params": {"n": 6}}, "--max-batch-size"),
        ({"input_ids": [5], "deep": json.loads("[" * 50 + "]" * 50)}, "nested"),
    ],
)
def test_bad_request_field_is_400_naming_it(server, body, field):
    status, out = post(server, "/generate", {"input_ids": [5, 6, 7], **body})
    assert_refused(status, out, field)


def test_a_request_past_the_models_context_is_400(server):
    """As SGLang 0.5.23 (without --allow-auto-truncate), in a context of 2048 tokens: its
    TokenizerManager refuses a prompt that leaves no room for a new token, and an explicit
    max_new_tokens past the context; its scheduler refuses a prompt of 2048 - 6 tokens or more and
    cuts max_new_tokens, without a word, to leave prompt and answer at 2048 - 2 tokens. The
    built-in server used to take a prompt of 2047 tokens and generate up to the context."""
    ids = [5] * 2000
    status, out = generate(server, {**VALID, "max_new_tokens": 1}, input_ids=[5] * 2048)
    assert_refused(status, out, "the prompt has 2048 tokens")
    assert "context length of 2048 tokens; shorten it to at most 2041 tokens" in out["message"]
    status, out = generate(server, {**VALID, "max_new_tokens": 49}, input_ids=ids)
    assert_refused(status, out, "2000 tokens + sampling_params.max_new_tokens 49 = 2049 tokens")
    assert "lower max_new_tokens to at most 46 " in out["message"]
    status, out = generate(server, {**VALID, "max_new_tokens": 1}, input_ids=[[5], [5] * 2048])
    assert_refused(status, out, "the prompt has 2048 tokens")  # one of a batch
    for prompt in (2042, 2047):  # the scheduler's refusal
        status, out = generate(server, {**VALID, "max_new_tokens": 1}, input_ids=[5] * prompt)
        assert_refused(status, out, f"the prompt has {prompt} tokens; in the model's context")
        assert "a prompt has at most 2041 " in out["message"]
    status, out = generate(server, {**VALID, "max_new_tokens": 5}, input_ids=[5] * 2041)
    assert status == 200 and len(out["output_ids"]) == 5, out
    default = {k: v for k, v in VALID.items() if k != "max_new_tokens"}  # (128)
    for sp in ({**VALID, "max_new_tokens": 48}, {**VALID, "max_new_tokens": 47}, default):
        status, out = generate(server, sp, input_ids=ids)  # cut to 2048 - 2 - 2000
        assert status == 200 and len(out["output_ids"]) == 46, out
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 46}


def test_body_too_deep_or_not_json_is_400(server):
    status, out = post(server, "/generate", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert_refused(status, out, "nested")
    status, out = post(server, "/generate", b'{"input_ids": [1' + b"0" * 5000 + b"]}")
    assert_refused(status, out, "not valid JSON")


WEB_PAGE = [  # what a page in a browser can send to 127.0.0.1 without a preflight
    ({"Content-Type": "text/plain"}, 415),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({}, 415),  # a body without a type
    ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403),
    ({"Content-Type": "text/plain", "Origin": "null"}, 403),
]


@pytest.mark.parametrize("headers,status", WEB_PAGE)
def test_state_changing_requests_from_a_web_page_are_refused(server, headers, status):
    before = json.loads(urllib.request.urlopen(server + "/get_model_info").read())
    body = {"new_version": "hijacked"}
    code, out = post(server, "/update_weight_version", body, headers=headers)
    assert code == status and out["success"] is False, (code, out)
    assert ("cross-origin" if status == 403 else "Content-Type must be application/json") in (
        out["message"]
    )
    after = json.loads(urllib.request.urlopen(server + "/get_model_info").read())
    assert after["weight_version"] == before["weight_version"] != "hijacked"
    code, _ = post(server, "/pause_generation", b"", headers={"Origin": "http://evil.example"})
    assert code == 403
    # the same origin, and a bodiless POST without a type (curl -X POST), stay allowed
    host = server.split("//", 1)[1]
    code, _ = post(server, "/continue_generation", {}, headers={
        "Content-Type": "application/json", "Origin": f"http://{host}"})  # fmt: skip
    assert code == 200
    code, _ = post(server, "/continue_generation", None, headers={})
    assert code == 200


def test_server_keeps_serving_after_every_bad_request(server):
    for sp, _ in REFUSED:
        generate(server, {**VALID, **sp})
    status, out = generate(server, timeout=10)
    assert status == 200 and len(out["output_ids"]) == 3
    status, out = generate(server, {**VALID, "n": 8}, return_logprob=True)  # at --max-n
    assert status == 200 and len(out) == 8
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 3 for o in out)
    assert get(server, "/health") == 200


def test_engine_fails_a_broken_request_alone(model):
    """Requests that reach the engine unchecked (its Python API) and break it: the one that
    overflows the seed and the one that overflows top-k fail; the one beside them is served."""
    from megatron_gspo.server.engine import Engine, Request
    from megatron_gspo.server.model import RolloutModel
    from megatron_gspo.server.sampling import SamplingParams

    engine = Engine(RolloutModel.from_pretrained(model), eos_ids=set(), decode_kernel="torch")
    done = threading.Semaphore(0)
    reqs = [
        Request([5, 6], SamplingParams(max_new_tokens=4, sampling_seed=2**64)),
        Request([5, 6], SamplingParams(max_new_tokens=4, top_k=2**63)),
        Request([5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True)),
    ]
    engine.start()
    try:
        for r in reqs:
            r.on_done = lambda _: done.release()
            engine.submit(r)
        assert all(done.acquire(timeout=30) for _ in reqs)
        assert "could not start" in reqs[0].error and "sampling failed" in reqs[1].error
        assert reqs[2].error is None and len(reqs[2].output_ids) == 4
        assert engine.alive
    finally:
        engine.stop()
    assert not engine.alive


def test_idle_and_slow_sockets_are_closed(server):
    host, port = server.removeprefix("http://").split(":")

    def wait_closed(sock) -> tuple[float, bytes]:
        t0 = time.monotonic()
        sock.settimeout(20)
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        return time.monotonic() - t0, data

    with socket.create_connection((host, int(port))) as idle:
        elapsed, data = wait_closed(idle)
        assert data == b"" and elapsed < 5  # --read-timeout 2: closed without a word
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        elapsed, data = wait_closed(slow)
        assert data == b"" and elapsed < 5
    with socket.create_connection((host, int(port))) as slow:
        head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        slow.sendall(head + b"Content-Length: 100\r\n\r\n{")
        elapsed, data = wait_closed(slow)
        assert data.startswith(b"HTTP/1.1 408") and elapsed < 5, data


@contextlib.contextmanager
def faulty_server(model: Path, fault: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.e2e.faulty_server", fault, "--model", str(model)]
    cmd += ["--port", "0", "--threads", "1", "--shutdown-timeout", "4"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, f"server did not start: {line!r}"
        yield proc, line.split()[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)


def test_dead_engine_thread_fails_requests_and_health(model):
    with faulty_server(model, "die") as (proc, url):
        assert get(url, "/health") == 200
        t0 = time.monotonic()
        status, out = generate(url, timeout=10)  # the request it died on: failed, not hung
        assert status == 500 and "injected fault" in out["message"], out
        assert get(url, "/health") == 503  # a supervisor restarts it
        status, out = generate(url, timeout=10)
        assert status == 503 and "restart the server" in out["message"], out
        assert time.monotonic() - t0 < 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_sigterm_stops_a_server_whose_engine_is_stuck(model):
    with faulty_server(model, "stuck") as (proc, url):

        def wait_for_answer():
            with contextlib.suppress(OSError):  # the connection closed: an answer too
                generate(url, timeout=30)

        pending = threading.Thread(target=wait_for_answer, daemon=True)
        pending.start()
        time.sleep(1.0)  # the request is in the stuck engine
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        print(f"stuck engine: SIGTERM -> exit {code} after {elapsed:.1f} s")
        assert elapsed < 8  # --shutdown-timeout 4
        pending.join(timeout=10)
        assert not pending.is_alive()  # the client got its answer or a closed connection
