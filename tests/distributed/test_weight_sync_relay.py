"""The tensor weight sync on several (simulated) nodes: per-node relays, gloo, built-in servers.

A 2-rank trainer whose ranks are told they run on nodes 0 and 1, and three servers, one on node 0
and two on node 1. Judged: each server takes its buckets from a trainer rank of its own node (the
stage sender's node directly, the other node through its relay, `SyncReport.sent_by`) and then
serves the trainer's weights (probe log-probs within 1e-4); with PP 2 each rank is the sender of
one stage and the relay of the other, both at once. A server on the relay's node killed mid-sync
is named in the error and lost, while every other server ends on the new version.
"""

from pathlib import Path

import pytest

from tests.distributed.test_weight_sync import KEY, assert_serves, start_servers, stop_servers
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("relay_worker.py")
SERVER_NODES = [0, 1, 1]


def run_relay_worker(tmp_path, checkpoint, urls, flags=(), tag="run") -> dict:
    out = tmp_path / f"{tag}.json"
    nodes = ",".join(map(str, SERVER_NODES))
    args = (
        str(checkpoint),
        str(out),
        ",".join(urls),
        "--server-nodes",
        nodes,
        "--rank-nodes",
        "0,1",
        "--api-key",
        KEY,
    )
    log = tmp_path / f"{tag}.log"  # a file, not a pipe (see test_weight_sync.run_worker)
    result = run_distributed(WORKER, 2, *args, *flags, out=out, log=log)
    assert result is not None
    return result


@pytest.fixture
def node_servers(tiny_models, tmp_path):
    started = start_servers(tiny_models["moe4"], tmp_path, n=len(SERVER_NODES))
    yield started
    stop_servers(started)


def routes(report: dict) -> dict[str, dict[str, int]]:
    return report["sent_by"]  # url -> {stage (a JSON key): rank}


def test_pp2_each_rank_sends_one_stage_and_relays_the_other(tmp_path, tiny_models, node_servers):
    urls = [url for _, url in node_servers]
    result = run_relay_worker(tmp_path, tiny_models["moe4"], urls, ["--pp", "2"])
    synced = result["synced"]
    assert synced["trainer_error"] is None and not synced["failures"]
    on_node0, on_node1 = urls[:1], urls[1:]
    for url in on_node0:
        assert routes(synced)[url] == {"0": 0, "1": 0}  # stage 1 through rank 0, node 0's relay
    for url in on_node1:
        assert routes(synced)[url] == {"0": 1, "1": 1}  # stage 0 through rank 1, node 1's relay
    assert "stage 0 from rank 0" in result["plan"] and "relayed by rank 1" in result["plan"]
    for url in urls:
        assert_serves(result, url, "1")


def test_server_killed_on_the_relays_node_is_named_and_the_others_finish(
    tmp_path, tiny_models, node_servers
):
    urls = [url for _, url in node_servers]
    victim, victim_url = node_servers[2]  # node 1: its buckets come through the relay
    flags = ["--ep", "2", "--kill", victim_url, "--kill-pid", str(victim.pid)]
    result = run_relay_worker(tmp_path, tiny_models["moe4"], urls, flags)

    first = result["synced"]  # version 1, before the failure: every server through its node
    assert first["trainer_error"] is None and not first["failures"]
    assert routes(first) == {urls[0]: {"0": 0}, urls[1]: {"0": 1}, urls[2]: {"0": 1}}

    report = result["report"]
    assert victim_url in result["error"] and list(report["failures"]) == [victim_url]
    assert report["trainer_error"] is None
    assert report["servers"][victim_url].startswith("lost")  # its supervisor restarts it
    assert "error" in result["serving"][victim_url]
    for url in urls[:2]:  # node 0 directly, node 1's other server through the relay
        assert report["servers"][url] == "2"
        assert_serves(result, url, "2")


def test_relay_that_cannot_take_a_bucket_fails_the_sync_and_the_next_one_goes_through(
    tmp_path, tiny_models, node_servers
):
    """The relay's request for its second bucket's buffer fails (as an out-of-memory would).
    The members agree before each bucket's bytes, so the sender does not broadcast them to a
    relay that is not there (on NCCL it would wait until the watchdog ends the job): the sync
    fails naming the relay's error, every server touched goes back to the restore point, and
    the relay group is still in step, so the next sync reaches every server."""
    urls = [url for _, url in node_servers]
    result = run_relay_worker(tmp_path, tiny_models["moe4"], urls, ["--fail-relay-buffer"])
    taken = "relay could not take bucket 1 of stage 0: OutOfMemoryError: injected"
    assert taken in result["error"], result["error"]
    report = result["report"]
    assert report["trainer_error"] and not report["failures"], report
    assert all(v == "default (restored)" for v in report["servers"].values()), report["servers"]
    after = result["after"]
    assert after["trainer_error"] is None and not after["failures"], after
    for url in urls:
        assert_serves(result, url, "3")
