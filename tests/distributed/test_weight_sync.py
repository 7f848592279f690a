"""Weight sync from Megatron trainers (gloo, 1-4 ranks) into two built-in rollout servers.

Judged: after a sync of perturbed weights, by each transport (tensor, distributed, disk) and from
TP1, TP2, EP2, PP2 and TP2xEP2 trainers, every server serves the new weight_version and returns
the trainer's probe log-probs within 1e-4 (fp32). A failure injected mid-sync (a server killed, a
transport error, the trainer killed) leaves every server on one whole version.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("weight_sync_worker.py")
KEY = "sync-test-key"  # shared-memory (tensor) updates need the servers' API key
TOL = 1e-4


def start_servers(checkpoint: Path, log_dir: Path, n: int = 2) -> list[tuple]:
    """n built-in servers, each with its output in a file (a pipe nobody reads could fill up)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_GSPO_API_KEY": KEY}
    procs = []
    for i in range(n):
        log = log_dir / f"server-{i}-{time.monotonic_ns()}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(
                [sys.executable, "-m", "megatron_gspo.server", "--model", str(checkpoint),
                 "--port", "0", "--threads", "1"],
                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        procs.append((p, log))
    out = []
    for p, log in procs:
        deadline = time.monotonic() + 120
        while not (m := re.search(r" on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        out.append((p, m.group(1)))
    return out


def stop_servers(servers) -> None:
    for p, _ in servers:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p, _ in servers:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def servers(tiny_models, tmp_path_factory):
    started = start_servers(tiny_models["moe4"], tmp_path_factory.mktemp("servers"))
    yield [url for _, url in started]
    stop_servers(started)


def run_worker(tmp_path, checkpoint, urls, nproc=1, flags=(), expect_rc=0, tag="run"):
    out = tmp_path / f"{tag}.json"
    args = (str(checkpoint), str(out), ",".join(urls), "--dir", str(tmp_path / "sync"),
            "--api-key", KEY, *flags)  # fmt: skip
    # Output to a file, not a pipe: torch's shared-memory manager, a child of the worker, lives
    # on while servers hold the worker's shared buffers, and would keep a pipe open.
    log = tmp_path / f"{tag}.log"
    return run_distributed(WORKER, nproc, *args, out=out, log=log, expect_rc=expect_rc)


def run_restarting_worker(tmp_path, checkpoint, started, nproc, flags) -> dict:
    """run_worker on `started` servers, the first of which the worker restarts itself; every
    one of them (the restarted one by the pid the worker wrote) is stopped afterwards."""
    try:
        return run_worker(tmp_path, checkpoint, [url for _, url in started], nproc, flags)
    finally:
        pid = tmp_path / "run.json.pid"
        if pid.exists():
            os.killpg(int(pid.read_text()), signal.SIGKILL)
        stop_servers(started)


def assert_serves(result: dict, url: str, version: str) -> None:
    s = result["serving"][url]
    assert s.get("version") == version, s
    assert s["diffs"][version] < TOL, s
    others = [d for v, d in s["diffs"].items() if v != version]
    assert min(others) > 100 * TOL, s  # the versions are far apart: the check means something


LAYOUTS = {  # name: (processes, flags)
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
    # As training holds the model (DDP buffer): every transport lends it (all at TP1; at EP2
    # the sender's own experts and the replicated tensors, the other rank's are copied).
    "tp1-ddp": (1, ["--ddp"]),
    "ep2-ddp": (2, ["--ep", "2", "--ddp"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_transport_brings_every_server_to_the_trainer(tmp_path, tiny_models, servers, layout):
    nproc, flags = LAYOUTS[layout]
    result = run_worker(
        tmp_path, tiny_models["moe4"], servers, nproc,
        [*flags, "--transports", "tensor,distributed,disk"],
    )  # fmt: skip
    assert [s["transport"] for s in result["syncs"]] == ["tensor", "distributed", "disk"]
    for s in result["syncs"]:
        assert s["buckets"] > 5  # small buckets: many per sync
        # Lent only from a DDP buffer, by every transport (tensor: to the servers; distributed:
        # to the broadcast; disk: to the shard writer).
        lends = layout.endswith("-ddp")
        assert (s["lent"] > 0) == lends, s
        if lends and layout == "tp1-ddp":
            assert s["lent"] > 0.8 * s["bytes"], s  # all but the split q/k/v (14% here)
        for r in s["verify"]:
            assert r["error"] is None and r["version"] == s["version"], r
            assert r["max_diff"] < TOL, (s["transport"], r)
        times = {int(k): v for k, v in s["stage_times"].items()}
        assert sorted(times) == list(range(2 if layout == "pp2" else 1)), times
        if s["transport"] == "distributed" and len(times) == 2:
            # Stages take turns: a server receiving both at once could deadlock on NCCL.
            assert times[1][0] >= times[0][1], times
    for url in servers:
        assert_serves(result, url, "3")
    # Only the first data-parallel replica gathers (expert-DP for experts): at tp2xep2, ranks
    # of DP rank 1 skip the dense TP gathers and take part in every expert one (expert-DP 1).
    for r in result["gathers"]:
        assert (r["dense"] > 0) == (r["dp"] == 0) and (r["expert"] > 0) == (r["edp"] == 0), r
    if layout == "tp2xep2":
        assert {r["dp"] for r in result["gathers"]} == {0, 1}, result["gathers"]


@pytest.mark.parametrize("held", ["plain", "ddp"])  # ddp: borrowed buckets, two in flight
def test_killed_server_is_named_and_the_others_finish(tmp_path, tiny_models, held):
    started = start_servers(tiny_models["moe4"], tmp_path)
    try:
        (victim, dead_url), (_, live_url) = started
        flags = ["--transports", "tensor", "--fail", "kill-server", "--kill-pid", str(victim.pid)]
        flags += ["--ddp"] if held == "ddp" else []
        result = run_worker(tmp_path, tiny_models["moe4"], [dead_url, live_url], flags=flags)
    finally:
        stop_servers(started)
    assert dead_url in result["error"] and live_url not in result["report"]["failures"]
    assert result["report"]["servers"][dead_url].startswith("lost")
    assert "error" in result["serving"][dead_url]  # down: its supervisor restarts it
    assert_serves(result, live_url, "2")  # the sync went on for the rest


def test_distributed_groups_are_kept_between_syncs_and_renewed_for_a_restarted_server(
    tmp_path, tiny_models
):
    """PP2, one WeightSync, three distributed syncs; the first server is killed and started
    again on its port before the third. Each stage's group carries syncs 1 and 2 (no new
    group: on GPUs that is an NCCL setup across every server rank, per stage, per sync); the
    restarted server no longer holds it, so sync 3 opens new ones, and every sync reaches both
    servers. close() destroys the groups it kept: a server asked afterwards holds none."""
    started = start_servers(tiny_models["moe4"], tmp_path)
    urls = [url for _, url in started]
    flags = ["--pp", "2", "--transports", "distributed,distributed,distributed", "--one-sync",
             "--restart-before", "3", "--kill-pid", str(started[0][0].pid)]  # fmt: skip
    result = run_restarting_worker(tmp_path, tiny_models["moe4"], started, 2, flags)
    groups = [s["groups"] for s in result["syncs"]]
    assert sorted(groups[0]) == ["0", "1"] and groups[0]["0"] != groups[0]["1"], groups
    assert groups[1] == groups[0], groups  # kept
    assert not set(groups[2].values()) & set(groups[1].values()), groups  # renewed
    for s in result["syncs"]:
        for r in s["verify"]:
            assert r["error"] is None and r["max_diff"] < TOL, r
        times = {int(k): v for k, v in s["stage_times"].items()}
        assert times[1][0] >= times[0][1], times  # the stages still take turns
    for url in urls:
        assert_serves(result, url, "3")
    answers = result["destroy_after_close"]
    assert sorted(answers) == sorted({*groups[0].values(), *groups[2].values()}), answers
    for name, per_server in answers.items():
        assert all("no weights update group named" in a for a in per_server), (name, answers)


def test_a_group_whose_broadcast_failed_is_not_used_again(tmp_path, tiny_models, servers):
    """The trainer's broadcast of a bucket raises (after it ran: the servers answer, so only
    the trainer knows). The sync fails and the group is destroyed, not kept; the next sync opens
    a new one and reaches both servers."""
    flags = ["--transports", "distributed", "--fail", "broadcast-error", "--after"]
    result = run_worker(
        tmp_path, tiny_models["moe4"], servers, 1, [*flags, "--snapshot-every", "1"]
    )
    assert "broadcast of bucket 1 failed: injected broadcast failure" in result["error"], result
    before, after = result["syncs"][0]["groups"], result["after"]["groups"]
    assert sorted(before) == sorted(after) == ["0"] and after["0"] != before["0"], (before, after)
    for url in servers:
        assert_serves(result, url, "3")
    for name, per_server in result["destroy_after_close"].items():
        assert all("no weights update group named" in a for a in per_server), (name, per_server)


def test_groups_are_not_kept_when_the_config_says_so(tmp_path, tiny_models, servers):
    flags = ["--transports", "distributed,distributed", "--one-sync", "--no-keep-groups"]
    result = run_worker(tmp_path, tiny_models["moe4"], servers, 1, flags)
    first, second = (s["groups"]["0"] for s in result["syncs"])
    assert first != second
    for url in servers:
        assert_serves(result, url, "2")
    for name, per_server in result["destroy_after_close"].items():
        assert all("no weights update group named" in a for a in per_server), (name, per_server)


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_catch_up_syncs_the_server_restarted_on_older_weights_and_no_other(
    tmp_path, tiny_models, transport
):
    """After a sync, the first server is started again on its base weights (as its supervisor
    restarts it). catch_up finds it on another weight_version and syncs it alone; a second
    catch_up finds nothing to do; both servers then serve the trainer's weights."""
    started = start_servers(tiny_models["moe4"], tmp_path)
    urls = [url for _, url in started]
    flags = ["--transports", transport, "--catch-up", "--kill-pid", str(started[0][0].pid)]
    result = run_restarting_worker(tmp_path, tiny_models["moe4"], started, 1, flags)
    assert result["caught_up"] == [urls[0]] and result["caught_up_again"] == [], result
    assert result["catch_up_syncs"] == [{urls[0]: "1", urls[1]: "not in this sync"}], result
    for url in urls:
        assert_serves(result, url, "1")


def test_transport_error_restores_every_server_to_the_snapshot(tmp_path, tiny_models, servers):
    flags = ["--pp", "2", "--transports", "distributed", "--snapshot-every", "1"]
    flags += ["--fail", "transport-error"]
    result = run_worker(tmp_path, tiny_models["moe4"], servers, 2, flags)
    assert "injected transport failure" in result["error"]
    assert result["report"]["trainer_error"]
    for url in servers:
        assert result["report"]["servers"][url] == "1 (restored)"
        assert_serves(result, url, "1")  # the snapshot of version 1, both stages


def test_packing_failure_keeps_the_stage_gathering_and_restores_the_servers(
    tmp_path, tiny_models, servers
):
    """Packing fails on the stage sender's main thread after one bucket was sent (as a GPU out
    of memory in take_big would). Its TP peer is still in the stage's gathers: the sender goes
    on with them, so every rank reaches the end of the sync, which fails naming the packing
    error, and the servers it touched go back to the snapshot. Without that the sender raised
    and its peer waited in a gather for the group's timeout."""
    flags = ["--tp", "2", "--transports", "tensor", "--snapshot-every", "1", "--fail", "packing"]
    result = run_worker(tmp_path, tiny_models["moe4"], servers, 2, flags)
    assert "packing stage 0: OutOfMemoryError: injected" in result["error"], result["error"]
    for url in servers:
        assert result["report"]["servers"][url] == "1 (restored)"
        assert_serves(result, url, "1")


def test_trainer_killed_mid_sync_is_recovered(tmp_path, tiny_models, servers):
    flags = ["--transports", "tensor", "--snapshot-every", "1", "--fail", "crash"]
    assert run_worker(tmp_path, tiny_models["moe4"], servers, 1, flags, expect_rc=1) is None
    from megatron_gspo.weight_sync.config import ServerRef
    from megatron_gspo.weight_sync.servers import Servers

    left = Servers([ServerRef(url, api_key=KEY) for url in servers])
    versions = [left.get(i, "/model_info")["weight_version"] for i in range(len(servers))]
    assert versions == ["partial:2"] * 2  # mid-update, and saying so
    result = run_worker(tmp_path, tiny_models["moe4"], servers, 1, ["--recover"], tag="recover")
    assert set(result["recovered"].values()) == {"1 (restored)"}
    for url in servers:
        assert_serves(result, url, "1")
