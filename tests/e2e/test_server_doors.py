"""The built-in server's last open doors (issue 49), each a request that used to get in, change
state it had no right to, or answer 5xx: seeded random hostile requests, headers it must not
guess at (two Authorization or Host headers, a Host of another name: DNS rebinding), bodies it
cannot decode, an empty text/plain POST, shared memory of another process, group inits on a
silent master, oversized receive buffers, non-finite weights, malformed shapes and configs.
Real servers over real HTTP and real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.comm import free_port
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout import weight_payload as wp
from tests.e2e.server_process import running_server

pytestmark = pytest.mark.e2e

KEY = "doors-test-key"
FLAGS = ("--read-timeout", "5", "--max-n", "8", "--max-batch-size", "16")
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(TinySpec(layers=2, init_std=0.2), tmp_path_factory.mktemp("d") / "m")


@pytest.fixture(scope="module")
def server(model):
    """No API key: `megatron-gspo serve`'s default, the one with doors to close."""
    with running_server(model, *FLAGS, "--weight-group-timeout", "1") as url:
        yield url


@pytest.fixture(scope="module")
def keyed(model):
    """An API key, as the trainer's servers have: shared-memory updates are allowed."""
    flags = (*FLAGS, "--weight-group-timeout", "3")
    with running_server(model, *flags, env={"MEGATRON_GSPO_API_KEY": KEY}) as url:
        yield url


# ---- raw HTTP ------------------------------------------------------------------------------


def request(url: str, method: str, path: str, headers=(), body: bytes = b"", host=True,
            timeout: float = 20.0) -> tuple[int | None, bytes]:  # fmt: skip
    """(status, body) of one request sent byte for byte as given (any header, any number of
    times); None when no answer came."""
    hostport = url.removeprefix("http://")
    head = [f"{method} {path} HTTP/1.1"]
    if host is True:
        head.append(f"Host: {hostport}")
    head += [f"{k}: {v}" for k, v in headers]
    if not any(k.lower() == "transfer-encoding" for k, _ in headers):
        head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1", "replace") + body
    h, p = hostport.rsplit(":", 1)
    data = b""
    try:
        with socket.create_connection((h, int(p)), timeout=timeout) as s:
            s.sendall(raw)
            while chunk := s.recv(1 << 16):
                data += chunk
    except OSError:
        pass
    while data.startswith(b"HTTP/1.1 100 "):  # (Expect: 100-continue) the answer follows
        data = data.partition(b"\r\n\r\n")[2]
    if not data.startswith(b"HTTP/1."):
        return None, data
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def post(url, path, body, headers=(), key=None, timeout=20.0) -> tuple[int | None, dict]:
    hs = [("Content-Type", "application/json"), *headers]
    if key:
        hs.append(("Authorization", f"Bearer {key}"))
    status, raw = request(url, "POST", path, hs, json.dumps(body).encode(), timeout=timeout)
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"raw": raw[:200]}


def greedy(url, key=None) -> list[int]:
    status, out = post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY},
                       key=key)  # fmt: skip
    assert status == 200, out
    return out["output_ids"]


def version(url, key=None) -> str:
    hs = [("Authorization", f"Bearer {key}")] if key else []
    status, raw = request(url, "GET", "/get_model_info", hs)
    assert status == 200, raw
    return json.loads(raw)["weight_version"]


# ---- headers and bodies --------------------------------------------------------------------


def test_two_authorization_headers_are_a_400(server, keyed):
    """(right, then wrong) used to be accepted: the server must not pick one."""
    body = json.dumps({"new_version": "two-auth"}).encode()
    for url, key in ((keyed, KEY), (server, "x")):
        for pair in ((key, "wrong"), ("wrong", key), (key, key)):
            hs = [("Content-Type", "application/json")]
            hs += [("Authorization", f"Bearer {k}") for k in pair]
            status, out = request(url, "POST", "/update_weight_version", hs, body)
            assert status == 400 and b"at most one Authorization header" in out, (status, out)
        assert version(url, KEY if url == keyed else None) != "two-auth"
    hs = [("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}")]
    assert request(keyed, "POST", "/update_weight_version", hs, body)[0] == 200
    assert version(keyed, KEY) == "two-auth"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_body_that_cannot_be_decoded_is_a_400(server, encoding):
    """A `Content-Encoding: gzip` body that is not gzip used to be a 500 "internal error"."""
    body = json.dumps({"input_ids": [5, 6], "sampling_params": GREEDY}).encode()
    hs = [("Content-Type", "application/json"), ("Content-Encoding", encoding)]
    status, out = request(server, "POST", "/generate", hs, body)
    assert status == 400 and (b"cannot be read" in out or b"Brotli" in out), (status, out)
    if encoding == "gzip":  # real gzip is read
        status, out = request(server, "POST", "/generate", hs, gzip.compress(body))
        assert status == 200, out


def test_only_host_names_of_the_server_are_served(server):
    """DNS rebinding: a page at evil.example, its name rebound to 127.0.0.1, sends its own Host
    and a matching Origin; that used to pass the cross-origin check and change the weight
    version. Names of this server (and loopback names) are served, whatever the port."""
    port = server.rsplit(":", 1)[1]
    body = json.dumps({"new_version": "rebound"}).encode()
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}",
                 f"0.0.0.0:{port}", f"10.1.2.3:{port}", "", f"127.0.0.1:{port}@evil.example",
                 f"[::1]:{port}@evil.example", "[::1]evil", "127.0.0.1:", "127.0.0.1:x1",
                 "127.0.0.1:\u0661"):  # fmt: skip
        hs = [("Host", host), ("Origin", f"http://{host}"), ("Content-Type", "application/json")]
        status, out = request(server, "POST", "/update_weight_version", hs, body, host=False)
        assert status in (400, 403), (host, status, out)
        status, out = request(server, "GET", "/get_model_info", [("Host", host)], host=False)
        assert status in (400, 403), (host, status, out)
    two = [("Host", f"127.0.0.1:{port}"), ("Host", f"evil.example:{port}")]
    assert request(server, "GET", "/health", two, host=False)[0] == 400
    assert version(server) != "rebound"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", f"[::1]:{port}",
                 "127.0.0.1:8080", "localhost"):  # fmt: skip
        hs = [("Host", host), ("Origin", f"http://{host}"), ("Content-Type", "application/json")]
        status, out = request(server, "POST", "/continue_generation", hs, b"{}", host=False)
        assert status == 200, (host, status, out)


def test_an_empty_text_plain_post_does_not_pause_generation(server):
    """The JSON-only rule used to skip bodiless requests: an empty text/plain POST (what a web
    page can send anywhere) paused generation."""
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, out = request(server, "POST", "/pause_generation", [("Content-Type", ctype)])
        assert status == 415 and b"must be application/json" in out, (ctype, status, out)
    t0 = time.monotonic()
    assert len(greedy(server)) == 4 and time.monotonic() - t0 < 10  # not paused
    assert request(server, "POST", "/continue_generation")[0] == 200  # no type, no body: allowed
    octet = [("Content-Type", "application/octet-stream")]  # aiohttp's name for an empty POST
    assert request(server, "POST", "/continue_generation", octet)[0] == 200


# ---- the fuzz ------------------------------------------------------------------------------

HOSTILE = [None, -1, 0, 1, 3, 2**31, 2**64, 10**400, 1e308, "x", "", [], {}, [1, "a"],
           {"a": {"b": [None]}}, True, 0.5, "nan", float("nan"), float("inf"), "\udcff"]  # fmt: skip
ROUTES = ["/generate", "/health", "/health_generate", "/model_info", "/get_model_info",
          "/server_info", "/get_server_info", "/flush_cache", "/pause_generation",
          "/continue_generation", "/abort_request", "/update_weight_version",
          "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update",
          "/update_weights_from_tensor", "/init_weights_update_group",
          "/update_weights_from_distributed", "/destroy_weights_update_group",
          "/release_memory_occupation", "/resume_memory_occupation"]  # fmt: skip
ODD_PATHS = ["/", "/nope", "/generate/", "/generate?x=1&x=2", "//generate", "/%2e%2e/etc",
             "/generate%00", "/" + "a" * 3000, "/health?" + "b=" * 500]  # fmt: skip
FIELDS = ["input_ids", "text", "sampling_params", "rid", "return_logprob", "logprob_start_len",
          "mode", "new_version", "model_path", "selector", "shared_memory_senders", "tags",
          "serialized_named_tensors", "load_format", "weight_version", "master_address",
          "master_port", "rank_offset", "world_size", "group_name", "backend", "names",
          "dtypes", "shapes", "abort_all", "abort_all_requests", "flush_cache"]  # fmt: skip
SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids",
            "logit_bias", "sampling_seed", "ignore_eos", "min_p", "repetition_penalty"]  # fmt: skip


def _pick(rng: random.Random) -> object:
    return copy.deepcopy(rng.choice(HOSTILE))  # (a copy: the body may be changed in place)


def _hostile_body(rng: random.Random, path: str, model_dirs: list[str]) -> object:
    base: dict = {"input_ids": [5, 6, 7], "sampling_params": dict(GREEDY)}
    for _ in range(rng.randint(0, 4)):
        key = rng.choice(FIELDS)
        base[key] = rng.choice([*model_dirs, _pick(rng)]) if key == "model_path" else (
            _pick(rng))  # fmt: skip
    if rng.random() < 0.5 and isinstance(base.get("sampling_params"), dict):
        for _ in range(rng.randint(1, 3)):
            base["sampling_params"][rng.choice(SAMPLING)] = _pick(rng)
        if isinstance(base["sampling_params"].get("max_new_tokens"), int):  # keep it short
            base["sampling_params"]["max_new_tokens"] %= 8
    if path == "/init_weights_update_group" and rng.random() < 0.15:  # reachable form, no master
        base.update(wp.init_group_body("127.0.0.1", 1, 2, f"g{rng.random()}"))
    if path == "/update_weights_from_distributed" and rng.random() < 0.5:
        n = rng.choice([2**62, 10**30, -5, 3])
        base.update(names=["model.norm.weight"], dtypes=[rng.choice(["float32", "int64", "x"])],
                    shapes=[[n, n]], group_name="g")  # fmt: skip
    return base


def _encode(rng: random.Random, obj: object) -> bytes:
    text = json.dumps(obj, allow_nan=True, default=str)
    kind = rng.random()
    if kind < 0.7:
        return text.encode("utf-8", "surrogatepass")
    if kind < 0.8:
        return rng.randbytes(rng.randint(0, 300))
    if kind < 0.9:
        return b"[" * rng.randint(1, 5000) + b"]" * rng.randint(0, 5000)
    return b'{"input_ids": [1' + b"0" * rng.randint(1, 6000) + b"]}"


def _hostile_request(rng: random.Random, port: str, model_dirs: list[str]):
    method = rng.choice(["GET", "POST", "POST", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
    path = rng.choice(ROUTES * 3 + ODD_PATHS)
    body = _encode(rng, _hostile_body(rng, path, model_dirs)) if rng.random() < 0.8 else b""
    hs = []
    r = rng.random()
    hs.append(
        (
            "Host",
            f"127.0.0.1:{port}"
            if r < 0.7
            else rng.choice(
                [f"localhost:{port}", "evil.example", f"[::1]:{port}", "", "a" * 300, "[::1", ":"]
            ),
        )
    )
    if rng.random() < 0.05:
        hs.append(("Host", "evil.example"))
    if rng.random() < 0.8:
        hs.append(
            (
                "Content-Type",
                rng.choice(
                    [
                        "application/json",
                        "application/json; charset=latin-1",
                        "text/plain",
                        "x/y",
                        "multipart/form-data; boundary=z",
                        "application/x-www-form-urlencoded",
                        "",
                    ]
                ),
            )
        )
    if rng.random() < 0.25:
        enc = rng.choice(["gzip", "deflate", "br", "identity", "bogus", "gzip, deflate"])
        hs.append(("Content-Encoding", enc))
        if enc == "gzip" and rng.random() < 0.5:
            body = gzip.compress(body)
        elif enc == "deflate" and rng.random() < 0.5:
            body = zlib.compress(body)
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        hs.append(("Authorization", rng.choice(["Bearer x", "Bearer", "Basic eA==", "\x01"])))
    if rng.random() < 0.2:
        hs.append(("Origin", rng.choice([f"http://127.0.0.1:{port}", "http://evil.example",
                                         "null", "http://[", "file://"])))  # fmt: skip
    if rng.random() < 0.05 and body:  # chunked, well formed or not
        hs.append(("Transfer-Encoding", "chunked"))
        body = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if rng.random() < 0.5 \
            else body  # fmt: skip
    if rng.random() < 0.05:
        hs.append(("Expect", "100-continue"))
    return method, path, hs, body


def test_no_request_of_any_shape_gets_a_5xx(server, model, tmp_path):
    """2,000 seeded random hostile requests (methods, paths, headers, encodings, bodies, field
    values): every one answered, none with a 5xx, and the server serves on. (Before: 30 of
    2,700 such requests got a 500.)"""
    bad_config = tmp_path / "nan_config"
    shutil.copytree(model, bad_config)
    cfg = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": float("nan")}))
    dirs = [str(model), str(bad_config), str(tmp_path), "/", "/etc"]
    rng = random.Random(49)
    port = server.rsplit(":", 1)[1]
    seen: dict[int | None, int] = {}
    t0 = time.monotonic()
    for i in range(2000):
        method, path, hs, body = _hostile_request(rng, port, dirs)
        status, out = request(server, method, path, hs, body, host=False, timeout=10)
        seen[status] = seen.get(status, 0) + 1
        assert status is not None and status < 500, (i, method, path, hs, body[:300], out[:300])
        if path == "/pause_generation" and status == 200:
            assert request(server, "POST", "/continue_generation")[0] == 200
    print(f"2000 hostile requests in {time.monotonic() - t0:.1f} s: {dict(sorted(seen.items()))}")
    assert request(server, "POST", "/continue_generation")[0] == 200
    request(server, "POST", "/end_weight_update", [("Content-Type", "application/json")], b"{}")
    assert len(greedy(server)) == 4 and request(server, "GET", "/health")[0] == 200


# ---- weights -------------------------------------------------------------------------------

VICTIM = """
import sys, time, json, torch
from megatron_gspo.rollout import weight_payload as wp
norm = torch.full((int(sys.argv[1]),), 7.0)  # this process's tensor, in its shared memory
with wp.TensorSharing():
    fmt = None if sys.argv[2] == "None" else sys.argv[2]
    body = wp.tensor_update_body([("model.norm.weight", norm)], load_format=fmt)
print(json.dumps(body), flush=True)
time.sleep(300)
"""


@contextlib.contextmanager
def another_process_tensor(hidden: int, load_format: str | None):
    """The update body naming another local process's shared-memory tensor, while it lives."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, str(hidden), str(load_format)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        yield proc.pid, json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_a_client_cannot_load_shared_memory_it_did_not_create(server, load_format):
    """A keyless server used to load another local process's torch shared-memory tensor into
    its weights when a client named that process at /begin_weight_update (the output changed).
    Shared memory now needs the API key: refused, and the weights stay as they were."""
    before = greedy(server)
    with another_process_tensor(64, load_format) as (pid, body):
        begin = {"selector": "target", wp.SENDERS: [pid]}
        assert post(server, "/begin_weight_update", begin)[0] == 200
        status, out = post(server, "/update_weights_from_tensor", body)
        assert post(server, "/end_weight_update", {})[0] == 200
    assert status == 400 and "only for a client holding its API key" in out["message"], out
    assert "--api-key" in out["message"]
    assert greedy(server) == before


def test_the_key_holder_still_loads_shared_memory(keyed, model):
    """The trainer's path: a server with a key loads its key holder's tensors."""
    before = greedy(keyed, KEY)
    named = sorted(load_file(str(model / "model.safetensors")).items())
    head = [(n, t) for n, t in named if n == "lm_head.weight"]
    for fmt, update in ((None, [(n, t.flip(0)) for n, t in head]), ("flattened_bucket", head)):
        with wp.TensorSharing():
            body = wp.tensor_update_body(update, load_format=fmt)
        assert post(keyed, "/begin_weight_update", wp.begin_body(), key=KEY)[0] == 200
        status, out = post(keyed, "/update_weights_from_tensor", body, key=KEY)
        assert post(keyed, "/end_weight_update", {}, key=KEY)[0] == 200
        assert status == 200, out
        if fmt is None:
            assert greedy(keyed, KEY) != before  # the vocabulary's rows reversed
    assert greedy(keyed, KEY) == before


@pytest.mark.parametrize(
    "value, words",
    [(float("nan"), "NaN or inf"), (float("inf"), "NaN or inf"), (-float("inf"), "NaN or inf"),
     (1e38, "at most 1e+18 in magnitude"), (1e19, "at most 1e+18 in magnitude")],
)  # fmt: skip
def test_non_finite_or_huge_weights_are_refused_naming_the_tensor(keyed, value, words):
    """NaN, inf and 1e38 weights used to be accepted, after which every /generate was a 500
    (the tiny model's float32 forward gives NaN log-probs from 1e38)."""
    before = greedy(keyed, KEY)
    bad = torch.ones(64)
    bad[17] = value
    for fmt in (None, "flattened_bucket"):
        for dtype in (torch.float32, torch.bfloat16):
            with wp.TensorSharing():
                body = wp.tensor_update_body(
                    [("model.norm.weight", bad.to(dtype))], load_format=fmt
                )
            assert post(keyed, "/begin_weight_update", wp.begin_body(), key=KEY)[0] == 200
            status, out = post(keyed, "/update_weights_from_tensor", body, key=KEY)
            assert post(keyed, "/end_weight_update", {}, key=KEY)[0] == 200
            assert status == 400 and "'model.norm.weight'" in out["message"], out
            assert words in out["message"], out
    assert greedy(keyed, KEY) == before


def test_malformed_bucket_shapes_are_a_400(keyed):
    """A flattened bucket's metadata claiming 2^62 x 2^62 (or a negative size, or more bytes
    than it has) is refused with a 400, never a 500."""
    import base64
    import types
    from multiprocessing.reduction import ForkingPickler

    flat = torch.zeros(256, dtype=torch.uint8)
    for shape in ((2**62, 2**62), (-1, 64), (10**30,), (64, 64), ()):
        meta = types.SimpleNamespace(name="model.norm.weight", shape=shape, dtype=torch.float32,
                                     start_idx=0, end_idx=256, numel=256)  # fmt: skip
        with wp.TensorSharing():
            raw = bytes(ForkingPickler.dumps({"flattened_tensor": flat, "metadata": [meta]}))
        body = {"serialized_named_tensors": [base64.b64encode(raw).decode()],
                "load_format": "flattened_bucket"}  # fmt: skip
        assert post(keyed, "/begin_weight_update", wp.begin_body(), key=KEY)[0] == 200
        status, out = post(keyed, "/update_weights_from_tensor", body, key=KEY)
        assert post(keyed, "/end_weight_update", {}, key=KEY)[0] == 200
        assert status == 400, (shape, out)


class _Reduce:
    """Pickles as the call `fn(*args)`: what a hostile payload can ask the unpickler for."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_a_payload_cannot_make_a_tensor_of_bytes_nobody_wrote(server):
    """torch.Tensor(n) and an empty storage grown by the view rebuilt on it both gave a tensor
    of uninitialized server memory, which a keyless server loaded as weights (no shared memory
    needed). Now a 400 naming why, and the weights stay as they were."""
    import base64
    import pickle

    from torch.multiprocessing import reductions as r

    hidden = 64
    empty = _Reduce(r.rebuild_typed_storage, _Reduce(r.rebuild_storage_empty, torch.UntypedStorage),
                    torch.float32)  # fmt: skip
    grown = _Reduce(r.rebuild_tensor, torch.Tensor, empty, (0, (hidden,), (1,), False))
    payloads = {
        "weight payload calls torch.Tensor: refused (a tensor's bytes come only from the "
        "shared memory its sender wrote)": _Reduce(torch.Tensor, hidden),
        f"a tensor of size ({hidden},) needs {hidden} elements of its storage, which holds 0": (
            grown
        ),
    }
    before = greedy(server)
    for message, tensor in payloads.items():
        raw = pickle.dumps([("model.norm.weight", tensor)], protocol=4)
        body = {"serialized_named_tensors": [base64.b64encode(raw).decode()]}
        assert post(server, "/begin_weight_update", {"selector": "target"})[0] == 200
        status, out = post(server, "/update_weights_from_tensor", body)
        assert post(server, "/end_weight_update", {})[0] == 200
        assert (status, out["message"]) == (400, message), out
    assert greedy(server) == before


def test_a_checkpoint_with_a_malformed_config_is_a_400(server, model, tmp_path):
    """config.json holding NaN used to be a 500 at /update_weights_from_disk."""
    cfg = json.loads((model / "config.json").read_text())
    for i, (key, value) in enumerate([("rms_norm_eps", float("nan")), ("rope_theta", -1),
                                      ("num_hidden_layers", -2), ("hidden_size", "64"),
                                      ("vocab_size", 2**70), ("dtype", "int8"),
                                      ("num_experts_per_tok", 99), ("decoder_sparse_step", 0),
                                      ("rope_parameters", [1]), ("mlp_only_layers", "0")]):  # fmt: skip
        bad = tmp_path / f"bad{i}"
        shutil.copytree(model, bad)
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        status, out = post(server, "/update_weights_from_disk", {"model_path": str(bad)})
        assert status == 400 and key in out["message"], (key, out)
    bad = tmp_path / "missing"
    shutil.copytree(model, bad)
    (bad / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "vocab_size"})
    )
    status, out = post(server, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and "vocab_size" in out["message"], out
    assert post(server, "/update_weights_from_disk", {"model_path": str(model)})[0] == 200


def test_an_index_cannot_send_the_server_outside_its_checkpoint(server, model, tmp_path):
    """The directory of /update_weights_from_disk is checked (its user, its mode), but the files
    its index named were read wherever they were: "../elsewhere/model.safetensors" loaded a
    checkpoint nobody checked, "/etc/passwd" was opened. Only files of that directory are read
    now, and a weight_map of the wrong kind is a 400 too (it was a 500)."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(model, elsewhere)
    before = greedy(server)
    names = list(load_file(str(model / "model.safetensors")))
    for i, file in enumerate(["../elsewhere/model.safetensors", "/etc/passwd", "sub/x", "..", 5]):
        ckpt = tmp_path / f"c{i}"
        ckpt.mkdir()
        shutil.copy(model / "config.json", ckpt)
        index = ckpt / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": {n: file for n in names}}))
        status, out = post(server, "/update_weights_from_disk", {"model_path": str(ckpt)})
        assert (status, out["message"]) == (400, (
            f"Failed to update weights: {index} puts {names[0]!r} in {str(file)!r}, not a file "
            "of the checkpoint's own directory; re-copy the checkpoint"
        )), out  # fmt: skip
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    status, out = post(server, "/update_weights_from_disk", {"model_path": str(ckpt)})
    assert (status, out["message"]) == (400, (
        f"Failed to update weights: {index}'s weight_map is no mapping; re-copy the checkpoint"
    )), out  # fmt: skip
    assert greedy(server) == before


# ---- distributed groups and their buffers --------------------------------------------------


@contextlib.contextmanager
def silent_master():
    """A port that accepts connections and never says a word (torch's store waits on it)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(lsock.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield lsock.getsockname()[1]
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        lsock.close()


_POOL = ThreadPoolExecutor(64)  # (asyncio's own pool has a few threads: calls would queue)


async def _async_post(url, path, body, key=None, timeout=60.0):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, post, url, path, body, (), key, timeout)


def test_group_inits_are_bounded_and_never_block_other_updates(keyed, model):
    """Eight /init_weights_update_group calls waiting on a silent master used to hold a tensor
    update for over 40 s and the next group init for over 60 s, and never failed."""
    named = sorted(load_file(str(model / "model.safetensors")).items())
    norm = [(n, t) for n, t in named if n == "model.norm.weight"]

    async def go(master: int):
        silent = [asyncio.create_task(_async_post(keyed, "/init_weights_update_group",
                                                  wp.init_group_body("127.0.0.1", master, 2,
                                                                     f"silent{i}"), KEY))
                  for i in range(8)]  # fmt: skip
        await asyncio.sleep(0.5)  # they are waiting
        t0 = time.monotonic()
        with wp.TensorSharing():
            body = wp.tensor_update_body(norm)
        assert (await _async_post(keyed, "/begin_weight_update", wp.begin_body(), KEY))[0] == 200
        upd = await _async_post(keyed, "/update_weights_from_tensor", body, KEY)
        assert (await _async_post(keyed, "/end_weight_update", {}, KEY))[0] == 200
        tensor_s = time.monotonic() - t0
        port, t1 = free_port(), time.monotonic()  # the next init, with a real master
        init = asyncio.create_task(_async_post(keyed, "/init_weights_update_group",
                                               wp.init_group_body("127.0.0.1", port, 2, "real"),
                                               KEY))  # fmt: skip
        pg = await asyncio.to_thread(wp.open_update_group, "127.0.0.1", port, 2, 0, "real")
        real = await init
        init_s = time.monotonic() - t1
        destroyed = await _async_post(keyed, "/destroy_weights_update_group",
                                      {"group_name": "real"}, KEY)  # fmt: skip
        wp.close_update_group(pg)
        return (
            upd,
            tensor_s,
            real,
            init_s,
            destroyed,
            [await s for s in silent],
            time.monotonic() - t0,
        )

    with silent_master() as master:
        upd, tensor_s, real, init_s, destroyed, silent, total_s = asyncio.run(go(master))
    print(f"beside 8 pending inits: tensor update {tensor_s:.2f} s, group init {init_s:.2f} s")
    assert upd[0] == 200 and tensor_s < 5, upd
    assert real[0] == 200 and destroyed[0] == 200 and init_s < 5, real
    for status, out in silent:  # each failed at the bound (--weight-group-timeout 3)
        assert status == 400 and "no group formed" in out["message"] and "3 s" in out["message"]
    assert total_s < 15


def test_pending_inits_are_capped(keyed):
    """At most 32 inits wait at once (each holds a thread while torch's store waits): the 33rd
    is a 429; once the master lets go, a new init is taken again."""
    from megatron_gspo.server.state import MAX_PENDING_INITS

    async def go(master: int, first: int):
        calls = [asyncio.create_task(_async_post(keyed, "/init_weights_update_group",
                                                 wp.init_group_body("127.0.0.1", master, 2,
                                                                    f"cap{first + i}"), KEY))
                 for i in range(MAX_PENDING_INITS + 1)]  # fmt: skip
        return [await c for c in calls]

    with silent_master() as master:
        answers = asyncio.run(go(master, 0))
    codes = sorted(s for s, _ in answers)
    assert codes == [400] * MAX_PENDING_INITS + [429], codes
    time.sleep(1.0)  # the master closed every connection: the stuck threads end
    with silent_master() as master:
        status, out = post(keyed, "/init_weights_update_group",
                           wp.init_group_body("127.0.0.1", master, 2, "after"), key=KEY)  # fmt: skip
    assert status == 400 and "no group formed" in out["message"], out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A model of about 60 MB, so that a bucket of its size shows in the server's RSS."""
    spec = TinySpec(hidden=512, heads=4, kv_heads=2, head_dim=128, ffn=1024, moe_ffn=512)
    path = make_tiny_model(spec, tmp_path_factory.mktemp("big") / "m")
    cmd = [sys.executable, "-m", "megatron_gspo.server", "--model", str(path), "--port", "0",
           "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, line
        yield proc.pid, line.split()[-1], path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_receive_buffers_are_bounded_by_the_model_and_freed_after_a_failure(big):
    """A 1 GB distributed bucket for an unknown name used to be received into a 1 GB buffer the
    server kept (RSS 255 -> 1280 MB). Now a request for more elements than the model holds is
    refused before any byte is received, and the buffer of an update that fails is freed."""
    pid, url, path = big
    port, group = free_port(), "buffers"
    total = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    n = int(total * 0.9)  # fits the model's size, names no weight of it

    async def go():
        init = asyncio.create_task(
            _async_post(
                url, "/init_weights_update_group", wp.init_group_body("127.0.0.1", port, 2, group)
            )
        )
        pg = await asyncio.to_thread(wp.open_update_group, "127.0.0.1", port, 2, 0, group)
        assert (await init)[0] == 200
        assert (await _async_post(url, "/begin_weight_update", {}))[0] == 200
        answers, rss = [], [_rss_mb(pid)]
        for shape, dtype in (([1 << 28], "float32"), ([2**62, 2**62], "float32"),
                             ([total + 1], "bfloat16"), ([4], "int64")):  # fmt: skip
            body = {"group_name": group, "names": ["model.nope.weight"], "dtypes": [dtype],
                    "shapes": [shape], "load_format": "flattened_bucket"}  # fmt: skip
            answers.append(await _async_post(url, "/update_weights_from_distributed", body))
        rss.append(_rss_mb(pid))
        bucket = {"flattened_tensor": torch.ones(n * 4, dtype=torch.uint8), "metadata": []}
        body = {"group_name": group, "names": ["model.nope.weight"], "dtypes": ["float32"],
                "shapes": [[n]], "load_format": "flattened_bucket"}  # fmt: skip
        upd = asyncio.create_task(_async_post(url, "/update_weights_from_distributed", body))
        await asyncio.to_thread(torch.distributed.broadcast, bucket["flattened_tensor"], 0,
                                pg)  # fmt: skip
        answers.append(await upd)
        await asyncio.sleep(0.5)
        rss.append(_rss_mb(pid))
        assert (await _async_post(url, "/end_weight_update", {}))[0] == 200
        await _async_post(url, "/destroy_weights_update_group", {"group_name": group})
        wp.close_update_group(pg)
        return answers, rss

    answers, rss = asyncio.run(go())
    print(
        f"server RSS: {rss[0]:.0f} MB, after refusals {rss[1]:.0f}, after a failed "
        f"{n * 4 / 2**20:.0f} MB update {rss[2]:.0f}"
    )
    for status, out in answers[:3]:
        assert status == 400 and "more elements than the model" in out["message"], out
    assert answers[3][0] == 400 and "floating-point" in answers[3][1]["message"]
    assert answers[4][0] == 400 and "does not belong" in answers[4][1]["message"], answers[4]
    assert rss[1] < rss[0] + 20  # nothing allocated for the refused ones
    assert rss[2] < rss[0] + n * 4 / 2**20 / 2  # the failed update's buffer is not kept
