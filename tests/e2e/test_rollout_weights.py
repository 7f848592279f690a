"""Weight transfer into the built-in server, driven as a trainer drives SGLang: tensors through
shared memory (direct and flattened bucket), a gloo broadcast group, memory release/resume, a
pickle that tries to run code, and SGLang's error shape for every wrong request."""

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.comm import free_port
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout import weight_payload as wp
from megatron_gspo.rollout.client import RolloutClient
from tests.e2e.server_process import running_server
from tests.helpers import hold_running

pytestmark = pytest.mark.e2e

SPEC = TinySpec(arch="qwen3_moe", layers=2, dense_layers=[0], init_std=0.2)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]
DEVICE = torch.device("cpu")
# Shared-memory updates need the server's API key (a keyless server refuses them: any local
# process could name another's objects), as the trainer's servers always have one.
KEY = "weights-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wckpt")
    other = TinySpec(**{**SPEC.__dict__, "seed": 7})
    return make_tiny_model(SPEC, root / "a"), make_tiny_model(other, root / "b")


@pytest.fixture(scope="module")
def server(ckpts):
    with running_server(ckpts[0], env={"MEGATRON_GSPO_API_KEY": KEY}) as url:
        yield url


def named_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(path / "model.safetensors")).items())


async def post(url, path, body=None):
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(url + path, json=body or {}) as r:
            return r.status, await r.json(content_type=None)


def call(url, path, body=None):
    return asyncio.run(post(url, path, body))


def keyed(url: str):
    from megatron_gspo.weight_sync.config import ServerRef

    return ServerRef(url, api_key=KEY)


def greedy_tokens(url) -> tuple[list[int], str]:
    async def go():
        async with RolloutClient([url], api_key=KEY) as c:
            [[s]] = await c.generate([PROMPT], sampling_params=GREEDY)
            return s.tokens, s.weight_version

    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(server, ckpts):
    """Greedy outputs on checkpoint b (loaded from disk), then the server back on a."""
    assert call(server, "/update_weights_from_disk", {"model_path": str(ckpts[1])})[0] == 200
    on_b = greedy_tokens(server)[0]
    assert call(server, "/update_weights_from_disk", {"model_path": str(ckpts[0])})[0] == 200
    on_a = greedy_tokens(server)[0]
    assert on_a != on_b
    return on_a, on_b


def load_by_tensor(url, named, load_format, version):
    with wp.TensorSharing():
        body = wp.tensor_update_body(named, load_format=load_format, weight_version=version)
    assert call(url, "/begin_weight_update", wp.begin_body())[0] == 200
    status, out = call(url, "/update_weights_from_tensor", body)
    assert call(url, "/end_weight_update", {})[0] == 200
    assert status == 200 and out["success"], out


@pytest.mark.parametrize("load_format", [None, "direct", "flattened_bucket"])
def test_update_weights_from_tensor(server, ckpts, reference, load_format):
    on_a, on_b = reference
    load_by_tensor(server, named_tensors(ckpts[1]), load_format, f"b-{load_format}")
    assert greedy_tokens(server) == (on_b, f"b-{load_format}")
    mixed = [(n, t.to(torch.bfloat16)) for n, t in named_tensors(ckpts[0])]  # cast on load
    load_by_tensor(server, mixed[:3], load_format, None)  # a partial update keeps the version
    load_by_tensor(server, named_tensors(ckpts[0]), load_format, "a")
    assert greedy_tokens(server) == (on_a, "a")


def test_update_weights_from_distributed(server, ckpts, reference):
    on_a, on_b = reference
    port, group = free_port(), "wsync-test"

    async def go():
        named = named_tensors(ckpts[1])
        init = asyncio.create_task(
            post(
                server,
                "/init_weights_update_group",
                wp.init_group_body("127.0.0.1", port, 2, group),
            )
        )
        pg = await asyncio.to_thread(wp.open_update_group, "127.0.0.1", port, 2, 0, group)
        assert (await init)[0] == 200
        answers = []
        for fmt, version in (("flattened_bucket", "b-dist"), (None, "b-dist2")):
            body = wp.distributed_update_body(named, group, load_format=fmt, weight_version=version)
            assert (await post(server, "/begin_weight_update", {}))[0] == 200
            upd = asyncio.create_task(post(server, "/update_weights_from_distributed", body))
            await asyncio.to_thread(wp.broadcast_named, pg, named, fmt)
            answers.append(await upd)
            assert (await post(server, "/end_weight_update", {}))[0] == 200
        status, out = await post(server, "/destroy_weights_update_group", {"group_name": group})
        wp.close_update_group(pg)
        return answers, status

    answers, destroyed = asyncio.run(go())
    assert [a[0] for a in answers] == [200, 200] and destroyed == 200, answers
    assert greedy_tokens(server) == (on_b, "b-dist2")
    load_by_tensor(server, named_tensors(ckpts[0]), None, "a")


def test_server_refusing_a_bucket_mid_broadcast_stops_the_stage_without_waiting(server, reference):
    """A server that answers /update_weights_from_distributed with an error never joins its
    broadcast (here: no begin_weight_update, a real refusal). The trainer's broadcast of a
    bucket larger than the socket buffers would then block until the group's timeout (on NCCL
    until the watchdog kills the trainer); it must stop on the answer and name the server."""
    import types

    from megatron_gspo.weight_sync.bucket import Bucket
    from megatron_gspo.weight_sync.config import SyncConfig
    from megatron_gspo.weight_sync.servers import Servers
    from megatron_gspo.weight_sync.transports import (
        DistributedTransport,
        StageContext,
        TransportError,
    )

    cfg = SyncConfig(method="distributed", timeout_s=30)
    ctx = StageContext(Servers([keyed(server)], cfg.timeout_s), cfg, "v-refused", 0, [0])
    transport = DistributedTransport()
    transport.open_stage(ctx)
    n = 64 << 20
    meta = types.SimpleNamespace(name="model.norm.weight", shape=torch.Size([n]),
                                 dtype=torch.uint8, start_idx=0, end_idx=n, numel=n)  # fmt: skip
    bucket = Bucket(0, 0, torch.zeros(n, dtype=torch.uint8), n, [meta])
    with pytest.raises(TransportError, match="servers failed during the broadcast of bucket 0"):
        transport.send(bucket, ctx)
    transport.close_stage(ctx)  # returns: the server's end is destroyed, then ours
    assert "begin_weight_update" in ctx.failed[0] and ctx.live == []
    assert greedy_tokens(server)[0] == reference[0]  # it serves on, its weights untouched


@pytest.fixture
def session(server):
    assert call(server, "/begin_weight_update", wp.begin_body())[0] == 200
    yield
    assert call(server, "/end_weight_update", {})[0] == 200


def test_pickle_with_code_is_refused(server, session, tmp_path):
    import base64
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()
    body = {"serialized_named_tensors": [payload]}
    status, out = call(server, "/update_weights_from_tensor", body)
    assert status == 400 and "refused" in out["message"] and not marker.exists()

    class Eval:
        def __reduce__(self):
            return (eval, (f"__import__('os').system('touch {marker}')",))

    # builtins.eval, and tensors shared by the fd strategy: refused the same way
    body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps(Eval())).decode()]}
    status, out = call(server, "/update_weights_from_tensor", body)
    assert status == 400 and "builtins.eval" in out["message"] and not marker.exists()
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_descriptor")
    try:
        from multiprocessing.reduction import ForkingPickler

        raw = bytes(ForkingPickler.dumps([("model.norm.weight", torch.ones(SPEC.hidden))]))
    finally:
        mp.set_sharing_strategy(before)
    status, out = call(
        server, "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(raw).decode()]},
    )  # fmt: skip
    assert status == 400 and "file_system" in out["message"]


def _storage_payload(handle: bytes, nbytes: int, manager: bytes = b"/tmp/any.sock") -> str:
    """A payload whose one tensor is torch shared memory named `handle`: what a hostile client
    sends to make the server open (and, with torch's own rebuild, grow, write or unlink) it."""
    import base64
    import pickle

    from torch.multiprocessing import reductions

    class Storage:
        def __reduce__(self):
            return (reductions.rebuild_storage_filename,
                    (torch.UntypedStorage, manager, handle, nbytes))  # fmt: skip

    class Typed:
        def __reduce__(self):
            return (reductions.rebuild_typed_storage, (Storage(), torch.float32))

    class Tensor:
        def __reduce__(self):
            return (reductions.rebuild_tensor,
                    (torch.Tensor, Typed(), (0, (max(nbytes, 0) // 4,), (1,), False)))  # fmt: skip

    return base64.b64encode(pickle.dumps([("model.norm.weight", Tensor())])).decode()


def test_shared_memory_names_a_peer_chooses_are_confined(server, session, ckpts, tmp_path):
    """Names outside torch's form, objects of the wrong size, links: refused; an object of
    torch's form is mapped read-only, never written, grown or unlinked by the server, and only
    when the process its name gives is one the session's begin_weight_update named."""
    victim = Path("/dev/shm") / f"victim_{os.getpid()}"
    victim.write_bytes(b"precious" * 64)
    fake = Path("/dev/shm") / f"torch_{os.getpid()}_4242_0"  # torch's form, made by us
    fake.write_bytes(bytes(64) + torch.ones(SPEC.hidden).numpy().tobytes())
    link = Path("/dev/shm") / f"torch_{os.getpid()}_4242_1"
    link.symlink_to(victim)
    try:
        refused = [
            (f"/{victim.name}".encode(), 512, "is not torch's"),
            (f"/../../{tmp_path}/x".encode(), 512, "is not torch's"),
            (b"/torch_1_2_3/../../etc/passwd", 512, "is not torch's"),
            (f"/{fake.name}".encode(), 1 << 20, "not torch's header + 1048576"),  # "grow it"
            (f"/{link.name}".encode(), 512, "cannot be opened"),
            (f"/torch_{os.getpid()}_4242_9".encode(), 512, "cannot be opened"),
            (f"/{fake.name}".encode(), -1, "out of range"),
        ]
        for handle, nbytes, words in refused:
            body = {"serialized_named_tensors": [_storage_payload(handle, nbytes)]}
            status, out = call(server, "/update_weights_from_tensor", body)
            assert status == 400 and words in out["message"], (handle, out)
        fake_bytes = fake.read_bytes()
        body = {"serialized_named_tensors": [_storage_payload(f"/{fake.name}".encode(),
                                                              4 * SPEC.hidden)]}  # fmt: skip
        status, out = call(server, "/update_weights_from_tensor", body)
        assert status == 200, out  # read as the weight it claims to be (as any payload could)
        # the same object in a session that named other senders, or none: refused unopened
        for begin in ({wp.SENDERS: [os.getpid() + 1]}, {}):
            assert call(server, "/end_weight_update", {})[0] == 200
            assert call(server, "/begin_weight_update", begin)[0] == 200
            status, out = call(server, "/update_weights_from_tensor", body)
            assert status == 400 and "not made by a sender named" in out["message"], out
        assert call(server, "/end_weight_update", {})[0] == 200
        assert call(server, "/begin_weight_update", wp.begin_body())[0] == 200
        assert fake.read_bytes() == fake_bytes  # header (torch's refcount) and data untouched
        assert victim.read_bytes() == b"precious" * 64
    finally:
        for f in (link, fake, victim):
            f.unlink(missing_ok=True)
    norm = [(n, t) for n, t in named_tensors(ckpts[0]) if n == "model.norm.weight"]
    with wp.TensorSharing():  # the real norm back, for the tests after this one
        body = wp.tensor_update_body(norm, load_format=None)
    assert call(server, "/update_weights_from_tensor", body)[0] == 200


def test_disk_updates_load_only_directories_no_other_user_could_write(server, ckpts, tmp_path):
    """A peer that can reach the port (any local user, on a shared node) must not make the
    server serve weights it wrote: a directory, or a file in it, that another user owns or
    anyone can write is refused (400, the fix named); the server's own user's directory loads
    (group-writable too: a umask of 002 makes it so)."""
    import shutil

    new = tmp_path / "v"
    shutil.copytree(ckpts[1], new)
    weights = new / "model.safetensors"
    body = {"model_path": str(new)}
    for target, mode in ((new, 0o777), (weights, 0o666), (new / "config.json", 0o646)):
        before = target.stat().st_mode
        target.chmod(mode)
        status, out = call(server, "/update_weights_from_disk", body)
        target.chmod(before)
        assert status == 400 and "others cannot write (chmod o-w)" in out["message"], out
        assert f"mode {mode:o}" in out["message"], out
    if os.getuid() == 0:  # (only root can give a file away)
        os.chown(weights, 12345, -1)
        status, out = call(server, "/update_weights_from_disk", body)
        os.chown(weights, 0, -1)
        assert status == 400 and "owned by uid 12345" in out["message"], out
    new.chmod(0o775)
    assert call(server, "/update_weights_from_disk", body)[0] == 200
    assert call(server, "/update_weights_from_disk", {"model_path": str(ckpts[0])})[0] == 200


def test_shared_memory_comes_only_from_this_machine(ckpts, tmp_path):
    """A shared-memory payload from a peer on this machine loads, whether it connects by
    loopback or by the machine's own address (a trainer rank relaying to the server of its node
    does); the server's check of which peers are local is the one it uses (a peer from another
    machine is refused: tests/unit/test_weight_sync.py, no second machine here)."""
    import ipaddress
    import subprocess
    import sys
    import urllib.request

    from megatron_gspo.server.validate import is_local_address
    from megatron_gspo.weight_sync.servers import Servers
    from megatron_gspo.weight_sync.transports.distributed import master_address

    # the address a relaying rank's requests come from (TEST-NET: routed, never contacted)
    address = master_address(Servers(["http://203.0.113.7:1"]))
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this machine has no non-loopback address")
    assert is_local_address(address) and is_local_address("127.0.0.1")
    fake = Path("/dev/shm") / f"torch_{os.getpid()}_4343_0"  # torch's form and size
    fake.write_bytes(bytes(64) + torch.ones(SPEC.hidden).numpy().tobytes())
    port = free_port()
    cmd = [sys.executable, "-m", "megatron_gspo.server", "--model", str(ckpts[0]), "--host",
           "0.0.0.0", "--port", str(port), "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_GSPO_API_KEY": "k"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}

    def post_json(host: str, path: str, body: dict) -> int:
        req = urllib.request.Request(f"http://{host}:{port}{path}", json.dumps(body).encode(),
                                     headers)  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status

    try:
        assert " on http://" in proc.stdout.readline()
        payload = _storage_payload(f"/{fake.name}".encode(), 4 * SPEC.hidden)
        for host in (address, "127.0.0.1"):
            assert post_json(host, "/begin_weight_update", wp.begin_body()) == 200
            body = {"serialized_named_tensors": [payload]}
            assert post_json(host, "/update_weights_from_tensor", body) == 200
            assert post_json(host, "/end_weight_update", {}) == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        fake.unlink(missing_ok=True)


def test_tensor_transport_gives_back_the_shared_memory_references(server, ckpts, reference):
    """The built-in server maps a bucket's shared memory read-only and leaves torch's reference
    count alone (it says so in its answer); the sender gives back the references its pickles
    took, so a bucket's memory is freed with the bucket, sync after sync, not at exit."""
    import struct

    from megatron_gspo.weight_sync.bucket import Bucket
    from megatron_gspo.weight_sync.config import SyncConfig
    from megatron_gspo.weight_sync.servers import Servers
    from megatron_gspo.weight_sync.transports import StageContext, TensorTransport

    named = named_tensors(ckpts[1])
    transport = TensorTransport()
    buffer = transport.alloc(sum(t.numel() * t.element_size() for _, t in named), DEVICE)
    with wp.TensorSharing():
        shm = Path("/dev/shm" + buffer.untyped_storage()._share_filename_cpu_()[1].decode())

    def references() -> int:  # torch's count, in the object's header
        return struct.unpack("q", shm.read_bytes()[:8])[0]

    servers = Servers([keyed(server)], timeout_s=60)
    try:
        for version in ("x1", "x2", "x3"):
            bucket = Bucket(0, 0, buffer)
            for name, t in named:
                bucket.add(name, t)
            ctx = StageContext(servers, SyncConfig(), version, 0, [0])
            servers.post(0, "/begin_weight_update", wp.begin_body())
            assert transport.send(bucket, ctx) == {}
            servers.post(0, "/end_weight_update", {})
            assert references() == 1  # the buffer's own, whatever the number of syncs
        assert servers.keeps_shared_refs == {server}
        assert greedy_tokens(server)[0] == reference[1]  # checkpoint b's weights arrived
    finally:
        servers.close()
        assert call(server, "/update_weights_from_disk", {"model_path": str(ckpts[0])})[0] == 200
    del bucket, buffer
    assert not shm.exists()  # freed with the buffer


def test_release_and_resume_memory(server, reference):
    on_a, _ = reference
    assert call(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})[0] == 200
    assert call(server, "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})[0] == 200
    assert greedy_tokens(server)[0] == on_a
    assert call(server, "/release_memory_occupation", {})[0] == 200
    assert greedy_tokens(server)[0] == on_a  # the cache comes back on demand
    assert call(server, "/resume_memory_occupation", {})[0] == 200

    async def busy():
        async with RolloutClient([server], api_key=KEY) as c:
            sp = {"max_new_tokens": 1500, "ignore_eos": True}
            task = await hold_running(c, server, lambda: c.generate([[5]], sampling_params=sp))
            answer = await post(server, "/release_memory_occupation", {})
            await c.abort()
            await c.resume()
            await task
            return answer

    status, out = asyncio.run(busy())
    assert status == 400 and out["success"] is False


def test_memory_tags_empty_mean_all_and_repeated_mean_once(server, reference):
    """`tags: []` released and resumed nothing ("Released memory: ."), and a repeated tag was
    named twice. As in SGLang, no tags (absent, null or []) is all of them; a repeat is one."""
    on_a, _ = reference
    everything = "weights, kv_cache, cuda_graph"
    for path, done in (("/release_memory_occupation", "Released"),
                       ("/resume_memory_occupation", "Resumed")):  # fmt: skip
        status, out = call(server, path, {"tags": []})
        assert (status, out["message"]) == (200, f"{done} memory: {everything}."), out
    for path, done in (("/release_memory_occupation", "Released"),
                       ("/resume_memory_occupation", "Resumed")):  # fmt: skip
        status, out = call(server, path, {"tags": ["kv_cache", "weights", "kv_cache"]})
        assert (status, out["message"]) == (200, f"{done} memory: kv_cache, weights."), out
    status, out = call(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert (status, out["message"]) == (400, "cannot resume kv_cache: not released"), out
    assert greedy_tokens(server)[0] == on_a


def test_the_sync_flushes_a_server_busy_at_its_end_once_it_is_idle(server):
    """The sync's last request, /flush_cache (the prefix cache holds KV of the old weights), is
    refused while a request runs (on SGLang also its /health probe's generation): it is asked
    again until the server is idle, or for at most wait_s."""
    from megatron_gspo.weight_sync.servers import Servers
    from megatron_gspo.weight_sync.session import Coordinator

    coordinator = Coordinator()
    coordinator.servers = Servers([keyed(server)], timeout_s=60)  # type: ignore[attr-defined]

    async def busy():
        async with RolloutClient([server], api_key=KEY) as c:
            sp = {"max_new_tokens": 1500, "ignore_eos": True}
            task = await hold_running(c, server, lambda: c.generate([[5]], sampling_params=sp))
            kept = await asyncio.to_thread(coordinator._flush, [0], 0.3)  # busy throughout
            flushing = asyncio.create_task(asyncio.to_thread(coordinator._flush, [0], 60))
            await asyncio.sleep(0.5)
            waited = not flushing.done()
            await c.abort()
            await c.resume()
            await task
            return kept, waited, await flushing

    kept, waited, after = asyncio.run(busy())
    coordinator.servers.close()  # type: ignore[attr-defined]
    assert kept == [0] and waited and after == []


def _garbage_b64() -> str:
    return "bm90IGEgcGlja2xl"  # "not a pickle"


BAD_REQUESTS = [
    ("/begin_weight_update", {"selector": "everything"}),
    ("/begin_weight_update", {}),  # the session fixture holds one open
    ("/update_weights_from_tensor", {}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [_garbage_b64()]}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "load_format": "gguf"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "weight_version": 3}),
    ("/init_weights_update_group", {}),
    ("/init_weights_update_group", {**wp.init_group_body("127.0.0.1", 1234, 2, "g"), "backend": "nccl"}),
    ("/init_weights_update_group", {**wp.init_group_body("127.0.0.1", 1234, 2, "g"), "rank_offset": 2}),
    ("/update_weights_from_distributed", {"group_name": "nope", "names": [], "dtypes": [], "shapes": []}),
    ("/destroy_weights_update_group", {"group_name": "nope"}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/resume_memory_occupation", {"tags": "kv_cache"}),
]  # fmt: skip


@pytest.mark.parametrize("senders", ["12", [0], [1 << 40], [True], [1.5], list(range(1, 5000))])
def test_begin_weight_update_checks_the_senders_it_is_given(server, senders):
    status, out = call(server, "/begin_weight_update", {wp.SENDERS: senders})
    assert status == 400 and f"{wp.SENDERS} must be a list" in out["message"], out
    assert call(server, "/begin_weight_update", wp.begin_body())[0] == 200  # none was opened
    assert call(server, "/end_weight_update", {})[0] == 200


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_bad_requests_get_sglang_error_shape(server, session, path, body):
    status, out = call(server, path, body)
    assert status == 400, out
    assert out["success"] is False and out["message"] and out["error"]["message"] == out["message"]


def test_tensor_payload_with_wrong_names_or_shapes(server, ckpts, reference):
    for named in ([("model.nope.weight", torch.ones(3))], [("model.norm.weight", torch.ones(3))]):
        for fmt in (None, "flattened_bucket"):
            with wp.TensorSharing():
                body = wp.tensor_update_body(named, load_format=fmt)
            assert call(server, "/begin_weight_update", wp.begin_body())[0] == 200
            status, out = call(server, "/update_weights_from_tensor", body)
            assert call(server, "/end_weight_update", {})[0] == 200
            assert status == 400 and out["success"] is False, out
            assert "Failed to update weights" in out["message"]
    assert greedy_tokens(server)[0] == reference[0]  # nothing was half-loaded


def test_weight_update_session_is_required_and_not_nested(server, ckpts):
    with wp.TensorSharing():
        body = wp.tensor_update_body(named_tensors(ckpts[0])[:1])
    status, out = call(server, "/update_weights_from_tensor", body)
    assert status == 400 and "begin_weight_update" in out["message"]
    assert call(server, "/end_weight_update", {})[0] == 400
    assert call(server, "/begin_weight_update", {})[0] == 200
    assert call(server, "/begin_weight_update", {})[0] == 400
    assert call(server, "/end_weight_update", {})[0] == 200
    assert call(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 400


def test_unflatten_round_trip():
    named = [
        ("a", torch.randn(3, 4)),
        ("b", torch.arange(5)),
        ("c", torch.ones(2, dtype=torch.bfloat16)),
    ]
    bucket = wp.flatten_bucket(named)
    assert bucket["flattened_tensor"].dtype == torch.uint8
    back = wp.unflatten_bucket(bucket["flattened_tensor"], bucket["metadata"])
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
