"""What the built-in rollout server does with requests beside their sampling values: flags that
abort requests are booleans or a 400, a client that goes away stops its work, top-level fields
it does not serve are a 400, and request ids are strings that never collide. Real servers over
real HTTP."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from tests.e2e.server_process import running_server
from tests.e2e.test_server_hardening import FLAGS, VALID, assert_refused, generate, post

pytestmark = pytest.mark.e2e

LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(TinySpec(layers=2), tmp_path_factory.mktemp("req") / "m")


@pytest.fixture(scope="module")
def server(model):
    with running_server(model, *FLAGS) as url:
        yield url


def load(url: str) -> tuple[int, int]:
    """(running, waiting) requests of the server."""
    info = json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())
    state = info["internal_states"][0]
    return state["num_running_reqs"], state["num_waiting_reqs"]


def wait_for_load(url: str, want, timeout: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while (now := load(url)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


@contextlib.contextmanager
def held_request(url: str, rid: str = "held"):
    """A request waiting in a paused server (it cannot finish on its own); yields the dict its
    answer lands in, after the block aborts it and resumes generation."""
    answer: dict = {}
    assert post(url, "/pause_generation", {"mode": "in_place"})[0] == 200

    def send() -> None:
        answer["status"], answer["body"] = generate(url, VALID, timeout=30, rid=rid)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        assert wait_for_load(url, (0, 1)) == (0, 1)
        yield answer
    finally:
        post(url, "/abort_request", {"abort_all": True})
        post(url, "/continue_generation", {})
        thread.join(timeout=30)


# ---- flags that abort requests -------------------------------------------------------------

NOT_FLAGS = ["false", [0], {}, 2, "true"]


@pytest.mark.parametrize("value", NOT_FLAGS, ids=repr)
def test_abort_flags_that_are_not_booleans_are_a_400_and_abort_nothing(server, tmp_path, value):
    with held_request(server) as answer:
        for path, body, field in [
            ("/abort_request", {"abort_all": value}, "abort_all must be true or false"),
            ("/update_weight_version", {"new_version": "v2", "abort_all_requests": value},
             "abort_all_requests must be true or false"),
            ("/update_weights_from_disk", {"model_path": str(tmp_path),
             "abort_all_requests": value}, "abort_all_requests must be true or false"),
            ("/update_weights_from_disk", {"model_path": str(tmp_path), "flush_cache": value},
             "flush_cache must be true or false"),
        ]:  # fmt: skip
            status, out = post(server, path, body)
            assert_refused(status, out, field)
        assert load(server) == (0, 1)  # still there: nothing was aborted
        assert json.loads(urllib.request.urlopen(server + "/get_model_info").read())[
            "weight_version"] != "v2"  # fmt: skip
    assert answer["status"] == 200
    assert answer["body"]["meta_info"]["finish_reason"]["type"] == "abort"


# ---- a client that goes away ---------------------------------------------------------------


def test_a_client_that_disconnects_has_its_samples_aborted(server):
    """Its 8 samples wait in a paused server, so only the abort can end them."""
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {**LONG, "n": 8}}).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    assert post(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with socket.create_connection((host, int(port))) as client:
            client.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert wait_for_load(server, (0, 8)) == (0, 8)
            t0 = time.monotonic()
        assert wait_for_load(server, (0, 0), timeout=3) == (0, 0)  # the client closed: aborted
        print(f"aborted {time.monotonic() - t0:.2f} s after the client disconnected")
    finally:
        post(server, "/abort_request", {"abort_all": True})
        post(server, "/continue_generation", {})
    status, out = generate(server)
    assert status == 200 and len(out["output_ids"]) == 3  # and the server serves on


# ---- top-level fields ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"top_logprobs_num": 5}, "top_logprobs_num is not supported by the built-in server"),
        ({"top_logprobs_num": -3}, "top_logprobs_num is not supported"),
        ({"token_ids_logprob": [1, 2]}, "token_ids_logprob is not supported"),
        ({"return_hidden_states": True}, "return_hidden_states is not supported"),
        ({"stream": "no"}, "stream must be true or false, got 'no'"),
        ({"stream": True}, "stream=true is not supported"),
        ({"sampling_params": {**VALID, "stream_interval": "x"}}, "sampling_params.stream_interval"),
        ({"sampling_params": {**VALID, "spaces_between_special_tokens": [1]}},
         "sampling_params.spaces_between_special_tokens must be true or false"),
        ({"sampling_params": {**VALID, "custom_params": 3}},
         "sampling_params.custom_params must be a JSON object"),
    ],
)  # fmt: skip
def test_fields_the_server_does_not_serve_are_a_400(server, body, words):
    status, out = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": VALID,
                                              **body})  # fmt: skip
    assert_refused(status, out, words)


def test_fields_that_ask_for_nothing_are_served(server):
    # (as sglang-router forwards a request: `model` and every flag at its default added)
    quiet = {"top_logprobs_num": 0, "token_ids_logprob": None, "return_hidden_states": False,
             "stream": False, "log_metrics": True, "data_parallel_rank": 0, "model": None,
             "return_text_in_logprobs": False, "background": False, "return_bytes": False,
             "return_entropy": False, "no_logs": False}  # fmt: skip
    sp = {**VALID, "stream_interval": 1, "spaces_between_special_tokens": True,
          "custom_params": {"a": 1}}  # fmt: skip
    status, out = generate(server, sp, **quiet)
    assert status == 200 and len(out["output_ids"]) == 3, out


def test_an_unknown_field_is_ignored_and_named_once_in_the_log(model, tmp_path):
    """A misspelt `return_logprobs` used to come back without log-probs and no word why; the
    field is still ignored (sglang-router adds `model`), named once per server, not per
    request, with the known field it is close to."""
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log, running_server(model, *FLAGS, stderr=log) as url:
        for _ in range(2):
            status, out = generate(url, return_logprobs=True, model="m")
            assert status == 200 and "output_token_logprobs" not in out["meta_info"], out
    lines = [ln for ln in log_path.read_text().splitlines() if "ignored" in ln]
    assert [ln.split(" megatron_gspo.server.app ", 1)[1] for ln in lines] == [
        "/generate: ignored the unknown field 'model', as SGLang ignores it",
        "/generate: ignored the unknown field 'return_logprobs' (did you mean 'return_logprob'?),"
        " as SGLang ignores it",
    ], lines


# ---- request ids ---------------------------------------------------------------------------


def test_ids_that_collide_in_one_batch_are_a_400(server):
    body = {"input_ids": [[3, 4], [5, 6]], "rid": ["x_0", "x"],
            "sampling_params": [{"n": 1, "max_new_tokens": 2}, {"n": 2, "max_new_tokens": 2}]}  # fmt: skip
    status, out = post(server, "/generate", body)
    assert_refused(status, out, "the request's rids give colliding ids 'x_0'")


def test_a_rid_in_use_is_a_400_and_free_again_once_aborted(server):
    with held_request(server, rid="busy"):
        for rid, n in (("busy", 1), ("busy", 2)):
            status, out = generate(server, {**VALID, "n": n}, rid=rid)
            assert_refused(status, out, "rid 'busy' is in use by a request not finished yet")
        assert load(server) == (0, 1)  # the held one is untouched
    status, out = generate(server, rid="busy")  # aborted: the rid is free again
    assert status == 200 and out["meta_info"]["id"] == "busy", out


@pytest.mark.parametrize("rid", [5, 5.0, True, None])
def test_rid_is_a_string_in_generate_and_abort_alike(server, rid):
    if rid is None:
        assert generate(server, rid="s")[0] == 200
        assert post(server, "/abort_request", {"rid": "s"})[0] == 200
        return
    for path, body in (("/generate", {"input_ids": [5], "sampling_params": VALID, "rid": rid}),
                       ("/abort_request", {"rid": rid})):  # fmt: skip
        status, out = post(server, path, body)
        assert_refused(status, out, f"rid must be a string, got {rid!r}")
