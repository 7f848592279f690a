"""The node of each rollout server (rollout.url_nodes) and the relay plan's bookkeeping; the relays
themselves run in tests/distributed/test_weight_sync_relay.py and tests/e2e/test_multinode.py."""

from __future__ import annotations

import re

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.weight_sync.config import ServerRef
from megatron_gspo.weight_sync.relay import RelayPlan, make_plan
from megatron_gspo.weight_sync.servers import Servers

pytestmark = pytest.mark.unit

URLS = 'rollout.urls=["http://a:1","http://b:1","http://b:2"]'


def test_url_nodes_name_the_node_of_each_url():
    cfg = load_config(None, ["model.path=/m", URLS, "rollout.url_nodes=[0,1,1]"])
    assert cfg.rollout.url_nodes == [0, 1, 1]
    assert load_config(None, ["model.path=/m", URLS]).rollout.url_nodes == []


@pytest.mark.parametrize(
    "nodes, message",
    [
        ("[0,1]", "rollout.url_nodes has 2 entries for 3 rollout.urls"),
        ("[0,-1,1]", "rollout.url_nodes[1] must be an integer >= 0, not -1"),
    ],
)
def test_url_nodes_that_do_not_fit_the_urls_name_the_fix(nodes, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, ["model.path=/m", URLS, f"rollout.url_nodes={nodes}"])


def test_servers_on_one_node_need_no_relay():
    """No node given, or one node for all: the stage senders post to every server, as before
    (make_plan returns before any collective)."""
    for nodes in ([None, None], [3, 3]):
        servers = Servers([ServerRef(f"http://h:{i}", node=n) for i, n in enumerate(nodes)])
        assert make_plan(servers, None, None, 60.0) is None
        servers.close()


def test_servers_with_and_without_a_node_are_refused():
    servers = Servers([ServerRef("http://a:1", node=0), ServerRef("http://b:1")])
    with pytest.raises(UserError, match="give every URL its node in rollout.url_nodes"):
        make_plan(servers, 0, None, 60.0)
    servers.close()


def test_plan_relays_each_stage_to_the_nodes_other_than_its_senders():
    # Two stages on two nodes (ranks 0, 1 on node 0; ranks 2, 3 on node 1), one server per node.
    plan = RelayPlan(
        rank_nodes=[0, 0, 1, 1], server_nodes=[0, 1], senders={0: 0, 1: 2}, relays={0: 0, 1: 2},
        members={0: [0, 2], 1: [2, 0]},
    )  # fmt: skip
    assert plan.relayed_by(0) == [1] and plan.relayed_by(2) == [0]
    assert plan.relayed_by(1) == [] and plan.relayed_by(3) == []
    assert plan.servers_on(1, [0, 1]) == [1]
    servers = Servers(["http://a:1", "http://b:1"])
    assert plan.describe(servers) == (
        "tensor buckets through per-node relays: "
        "stage 0 from rank 0 to node 0's servers (http://a:1), relayed by rank 2 to node 1's "
        "(http://b:1); stage 1 from rank 2 to node 1's servers (http://b:1), relayed by rank 0 "
        "to node 0's (http://a:1)"
    )
    servers.close()
