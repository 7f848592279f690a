"""Server supervision: two built-in servers under a ServerGroup; one is SIGKILLed mid-batch and the
batch still completes with every sample exactly once; the dead one is restarted on its port and
brought to the current weights; leaving the group, SIGTERM and Ctrl-C stop every child."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient, RolloutError
from megatron_gspo.rollout.launcher import ServerConfig, ServerFailed, ServerGroup
from megatron_gspo.rollout.server_config import redacted
from megatron_gspo.server import kernels

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_model(TinySpec(init_std=0.2), tmp_path_factory.mktemp("lckpt") / "m")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def builtin(ckpt, **kw) -> ServerConfig:
    return ServerConfig(model_path=str(ckpt), threads=1, env={"OMP_NUM_THREADS": "1"}, **kw)


def test_server_killed_mid_batch_batch_completes_and_server_restarts(ckpt, tmp_path):
    prompts = [[5 + i, 6, 7] for i in range(4)]
    sp = {"max_new_tokens": 64, "ignore_eos": True, "sampling_seed": 3}
    group = ServerGroup([builtin(ckpt), builtin(ckpt)], tmp_path / "logs", poll_s=0.1)
    with group:
        group.set_current_weights(model_path=str(ckpt), weight_version="v7")
        victim = group.servers[0]
        first_pid = victim.pid

        async def go():
            async with RolloutClient(group.urls, backoff_s=0.2, retries=4) as c:
                # The victim holds the requests it gets (paused in place), so the kill lands
                # while it has some, however fast the other server works through the rest:
                # waiting for it to be seen generating was a race (under load the batch could
                # end between two looks, and the test then waited forever).
                await c.post(victim.url, "/pause_generation", {"mode": "in_place"})
                task = asyncio.create_task(c.generate(prompts, n=4, sampling_params=sp))
                while True:
                    info = await c.get(victim.url, "/server_info")
                    state = info["internal_states"][0]
                    if state["num_running_reqs"] + state["num_waiting_reqs"] > 0:
                        break
                    assert not task.done(), "the batch ended without reaching the victim"
                    await asyncio.sleep(0.01)
                os.kill(first_pid, signal.SIGKILL)
                groups = await task
                while victim.restarts == 0 or not victim.alive():
                    await asyncio.sleep(0.1)
                async with RolloutClient([victim.url]) as probe:
                    await probe.wait_healthy(60)
                for _ in range(100):  # the restart ends with the weight update
                    info = await c.get(victim.url, "/model_info")
                    if info["weight_version"] == "v7":
                        break
                    await asyncio.sleep(0.1)
                return groups, info

        groups, info = asyncio.run(asyncio.wait_for(go(), 300))
        samples = [s for g in groups for s in g]
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (i, j) for i in range(4) for j in range(4)
        ]
        assert len({s.rid for s in samples}) == 16
        assert all(s.finish_reason == "length" and len(s.tokens) == 64 for s in samples)
        assert all(len(s.logprobs) == 64 for s in samples)
        assert victim.pid != first_pid and info["weight_version"] == "v7"
        assert "start #1" in victim.log_path.read_text()
        pids = [s.pid for s in group.servers]
    assert all(gone(p) for p in [*pids, first_pid])


def test_requests_wait_for_the_restart_of_the_only_server(ckpt, tmp_path):
    """The only server killed -9 with requests in flight: they wait for its supervisor's
    restart (outage_s) and finish there, each sample once; without the wait they failed after
    the quick retries, which end long before a server is back."""
    prompts = [[5 + i, 6, 7] for i in range(3)]
    sp = {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 5}
    with ServerGroup([builtin(ckpt)], tmp_path / "logs", poll_s=0.1) as group:
        victim = group.servers[0]
        first_pid = victim.pid
        with pytest.raises(RuntimeError, match="started already"):
            group.start()  # (a second server would run unsupervised)
        assert victim.pid == first_pid and len(group.servers) == 1

        async def go(outage_s):
            async with RolloutClient(group.urls, backoff_s=0.05, retries=1,
                                     outage_s=outage_s) as c:  # fmt: skip
                await c.post(victim.url, "/pause_generation", {"mode": "in_place"})
                task = asyncio.create_task(c.generate(prompts, n=2, sampling_params=sp))
                while True:
                    state = (await c.get(victim.url, "/server_info"))["internal_states"][0]
                    if state["num_waiting_reqs"] == 6:  # every request held by the victim
                        break
                    assert not task.done()
                    await asyncio.sleep(0.01)
                os.kill(victim.pid, signal.SIGKILL)
                return await task

        groups = asyncio.run(asyncio.wait_for(go(outage_s=120), 300))
        samples = [s for g in groups for s in g]
        assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
            (i, j) for i in range(3) for j in range(2)
        ]
        assert len({s.rid for s in samples}) == 6
        assert all(len(s.tokens) == 16 and len(s.logprobs) == 16 for s in samples)
        assert victim.pid != first_pid and victim.restarts == 1
        # the same kill without the wait: the batch fails, naming the server
        while not victim.ready:
            time.sleep(0.1)
        with pytest.raises(RolloutError, match="no server took it within 0 s"):
            asyncio.run(asyncio.wait_for(go(outage_s=0), 300))


def faulty(ckpt, tmp_path, fault: str) -> ServerConfig:
    """The built-in server with one injected fault (tests/e2e/faulty_server.py), through a python
    wrapper that drops "-m megatron_gspo.server"."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    wrapper = tmp_path / f"python-{fault}"
    wrapper.write_text(
        f'#!/bin/sh\nshift 2\nexec {sys.executable} -m tests.e2e.faulty_server {fault} "$@"\n'
    )
    wrapper.chmod(0o755)
    cfg = builtin(ckpt, python=str(wrapper))
    cfg.env = {**cfg.env, "PYTHONPATH": str(root)}
    return cfg


def test_server_whose_engine_died_is_restarted(ckpt, tmp_path):
    """A server that is alive but answers /health 503 (its engine thread is gone: the injected
    fault of tests/e2e/faulty_server.py, run through a python wrapper) is killed by the monitor
    and started again, like one that died."""
    import urllib.error
    import urllib.request

    cfg = faulty(ckpt, tmp_path, "die")
    with ServerGroup([cfg], tmp_path / "logs", poll_s=0.1) as group:
        server = group.servers[0]
        first_pid = server.pid
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        req = urllib.request.Request(server.url + "/generate", body.encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError):  # the request its engine died on
            urllib.request.urlopen(req, timeout=30)
        deadline = time.monotonic() + 60
        while not (server.restarts == 1 and server.ready):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        assert server.pid != first_pid and gone(first_pid)
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200


def test_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    group = ServerGroup([ServerConfig(model_path=str(tmp_path / "nope"))], tmp_path / "logs")
    with pytest.raises(ServerFailed, match="exited with code"):
        group.start()
    assert all(gone(s.pid) for s in group.servers)


@contextlib.contextmanager
def first_pick_taken(monkeypatch):
    """The port the launcher picks first is held by a listener that accepts and never answers
    (another process that got the same free port: the fault injected)."""
    import socket

    from megatron_gspo.comm import free_port
    from megatron_gspo.rollout import launcher

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(launcher, "free_port", lambda: next(picks, None) or free_port())
        yield taken


def test_a_picked_port_taken_before_the_bind_is_replaced(ckpt, tmp_path, monkeypatch):
    """Another process gets the free port picked for a server before the server binds it (a
    fault injected here by holding it): the server starts again on another port. A port the
    config names is the user's choice: taken, the start fails, saying so."""
    with first_pick_taken(monkeypatch) as taken:
        with ServerGroup([builtin(ckpt)], tmp_path / "logs", monitor=False) as group:
            server = group.servers[0]
            assert server.port != taken and server.url.endswith(f":{server.port}")
            with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
                assert r.status == 200
        log = (tmp_path / "logs" / "server-0.log").read_text()
        assert f"--port {taken}" in log and "address already in use" in log
        assert f"--port {server.port}" in log
        named = ServerGroup([builtin(ckpt, port=taken)], tmp_path / "named", monitor=False)
        with pytest.raises(ServerFailed) as failed:
            named.start()
        assert "address already in use" in failed.value.summary()


def test_a_server_that_outlives_its_failed_bind_is_ended_and_moved(ckpt, tmp_path, monkeypatch):
    """SGLang does not exit when its port was taken: its warmup polls the port's holder (here a
    listener that accepts and never answers, as a TCP store does) for up to 12 minutes before it
    ends itself; the whole log is then its warmup's tracebacks. The launcher reads what this start
    logged, ends the server at once and starts it on another port."""
    with first_pick_taken(monkeypatch) as taken:
        cfg = faulty(ckpt, tmp_path, "linger")
        group = ServerGroup([cfg], tmp_path / "logs", monitor=False, health_timeout_s=120)
        with group:
            server = group.servers[0]
            assert server.port != taken
            with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
                assert r.status == 200
            lingering = [
                pid for pid in os.listdir("/proc") if pid.isdigit()
                and f"--port\0{taken}\0".encode() in _cmdline(pid)
            ]  # fmt: skip
            assert lingering == []
    log = (tmp_path / "logs" / "server-0.log").read_text()
    assert f"--port {taken}" in log and "address already in use" in log


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_api_key_is_left_out_of_the_server_log(tmp_path):
    """A server's output goes to its log with the API key's value shown as *** (SGLang logs its
    server_args, key included; here the key is in the path a failing start prints)."""
    key = "k3y-" + os.urandom(8).hex()
    model = tmp_path / f"nope-{key}"
    group = ServerGroup([ServerConfig(model_path=str(model), api_key=key)], tmp_path / "logs")
    with pytest.raises(ServerFailed, match="exited with code") as failed:
        group.start()
    text = (tmp_path / "logs" / "server-0.log").read_text()
    assert "nope-***" in text and "nope-***" in str(failed.value)  # its output, redacted
    assert key not in text and key not in str(failed.value)


SCRIPT = """
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whoever started us
from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup
group = ServerGroup([ServerConfig(model_path=sys.argv[1], threads=1)], sys.argv[2])
group.start()
print(json.dumps([s.pid for s in group.servers]), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_parent_stops_every_server(ckpt, tmp_path, sig):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(ckpt), str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = parent.stdout.readline()
        assert line, parent.stderr.read()
        pids = json.loads(line)
        assert not any(gone(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert parent.returncode != 0
        assert all(gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()


def test_sglang_command_from_config():
    cfg = ServerConfig(
        model_path="/m", kind="sglang", python="/venv/bin/python", device="cpu",
        disable_cuda_graph=True, max_total_tokens=4096, enable_return_routed_experts=True,
        api_key="k", extra_args=["--log-level", "warning"],
    )  # fmt: skip
    cmd = cfg.command(30001)
    assert cmd[:4] == ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path"]
    for flag in ("--device cpu", "--max-total-tokens 4096", "--port 30001", "--api-key k"):
        assert flag in " ".join(cmd)
    joined = " ".join(cmd)  # SGLang 0.5.23's spelling; it deprecates --disable-cuda-graph
    assert "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled" in joined
    assert "--disable-cuda-graph" not in cmd and "--enable-return-routed-experts" in cmd
    assert cmd[-2:] == ["--log-level", "warning"] and "--threads" not in cmd
    with pytest.raises(ValueError):
        ServerConfig(model_path="/m", kind="vllm")
    assert "--api-key" not in builtin("/m", api_key="k").command(1)
    assert "--enable-deterministic-inference" not in cmd
    for kind in ("sglang", "builtin"):  # the same flag on both servers
        assert "--enable-deterministic-inference" in ServerConfig(
            model_path="/m", kind=kind, deterministic=True
        ).command(1)
    # the log's copy of a command: no key value, however it is given
    shown = redacted(["--api-key", "s3c", "--api-key=k2", "--tag", "x-s3c-y"], "s3c")
    assert shown == ["--api-key", "***", "--api-key=***", "--tag", "x-***-y"]
    assert redacted(["--api-key", "k3"], None) == ["--api-key", "***"]


DETERMINISTIC = {  # (server options, prompts, samples per prompt, its decode steps' kernel)
    # bf16 fp8 (decoding through torch: the compiled step is fp32's), prompts of 2-12 tokens
    "bf16-fp8": ({"dtype": "bfloat16", "quantization": "fp8"},
                 [[5 + i, 6, 7 + 2 * i, 9][: 2 + i % 3] * (1 + i) for i in range(6)], 4, "torch"),
    # fp32 through torch: prompts of one length, 2 samples each, so the rows decoding at a
    # position are 2 to 12 by the requests' timing (20 of 20 staggered runs differed before
    # products of 1-3 rows were padded to 4)
    "fp32-torch": ({"dtype": "float32", "extra_args": ["--decode-kernel", "torch"]},
                   [[5 + i, 6 + i, 7 + 2 * i, 9] for i in range(6)], 2, "torch"),
    # fp32 as served by default: decode steps through the compiled kernel, prefills through torch
    "fp32": ({"dtype": "float32"}, [[5 + i, 6 + i, 7 + 2 * i, 9] for i in range(6)], 2, "c"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DETERMINISTIC))
def test_a_deterministic_server_gives_the_same_samples_however_requests_arrive(
    ckpt, tmp_path, case
):
    """rollout.deterministic (--enable-deterministic-inference): the same seeded samples, sent
    all at once or one prompt at a time at staggered moments (other batches on the server each
    time), come back with the same tokens and log-probs."""
    options, prompts, n, kernel = DETERMINISTIC[case]
    if kernel == "c" and kernels.library() is None:
        pytest.skip("no C compiler here: the decode kernel is not built")
    sp = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11}
    cfg = builtin(ckpt, deterministic=True, **options)
    with ServerGroup([cfg], tmp_path / "logs", monitor=False) as group:

        async def together():
            async with RolloutClient(group.urls) as c:
                return await c.generate(prompts, n=n, sampling_params=sp, grouped=True)

        async def staggered():
            async with RolloutClient(group.urls) as c:

                async def one(i):  # the seeds `generate` gives prompt i's samples above
                    await asyncio.sleep(0.03 * i)
                    mine = dict(sp, sampling_seed=sp["sampling_seed"] + n * i)
                    return (await c.generate([prompts[i]], n=n, sampling_params=mine))[0]

                return await asyncio.gather(*(one(i) for i in range(len(prompts))))

        first, second = asyncio.run(together()), asyncio.run(staggered())

        async def info():
            async with RolloutClient(group.urls) as c:
                return await c.get(group.urls[0], "/server_info")

        shown = asyncio.run(info())
        assert shown["enable_deterministic_inference"] is True
        assert shown["decode_kernel"] == kernel
    assert [[(s.tokens, s.logprobs) for s in g] for g in first] == [
        [(s.tokens, s.logprobs) for s in g] for g in second
    ]
    assert len({tuple(s.tokens) for g in first for s in g}) > 6  # (samples that differ)
