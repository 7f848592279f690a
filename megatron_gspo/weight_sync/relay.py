"""Per-node relays: the tensor transport when the rollout servers sit on several nodes.

The tensor transport hands a server a shared-memory file name (CPU) or a CUDA IPC handle (GPU),
which only a process on the server's own host can open. So on several nodes each stage sender
posts its buckets to the servers of its own node only, and every other node with servers has a
relay, its lowest global trainer rank, which posts the same buckets from a buffer of its own:

    stage sender --broadcast--> relay of node n --/update_weights_from_tensor--> node n's servers
                 (gloo on CPU, NCCL on GPU)      (its own shared memory / IPC handle)

One process group per pipeline stage that has relays (its sender and the relays of the nodes
other than the sender's), made once, when the WeightSync is built. Per bucket the sender
broadcasts a header (index, size, metadata), the members agree (a one-number all-reduce) that
every relay has a buffer for it, and then the sender broadcasts the bytes; a None header ends the
stage, also after a failure, so a relay never waits for a bucket that will not come. A relay that
cannot take a bucket (its buffer failed, e.g. out of memory) says so in that agreement: the bytes
are not sent, the sender's stage fails naming the relay, and the relay goes on reading headers
until the end of the stage, so the group stays in step for the next sync (without the agreement
the sender would sit in a broadcast the relay never joins: on NCCL until the watchdog ends the
job). The group's timeout is twice the HTTP timeout: a relay whose server hangs holds its buffers
(and so the sender's next broadcast) for up to one HTTP timeout. A relay receives on a
thread of its own (its main thread drives the gathers of its own stage: collectives that the
sender of another stage may be waiting for) and posts each bucket on a second thread while it
receives the next, as a sender does. Its outcome (servers failed and touched, bucket checksums)
reaches the coordinator with the senders'; the checksums must equal the sender's.

Nodes are the launcher's node indices: `ServerRef.node` of each server (`rollout.url_nodes`) and
each trainer rank's own (launch/torchrun.sh exports it as MEGATRON_GSPO_NODE_RANK).
"""

from __future__ import annotations

import datetime
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.weight_sync import gather
from megatron_gspo.weight_sync.bucket import Bucket, BufferPool
from megatron_gspo.weight_sync.servers import Servers
from megatron_gspo.weight_sync.transports.base import TransportError

NODE_ENV = "MEGATRON_GSPO_NODE_RANK"  # the launcher's index of the node a trainer rank runs on


@dataclass
class RelayPlan:
    """Who sends which stage to which node's servers; the same on every rank."""

    rank_nodes: list[int]  # node of each global rank
    server_nodes: list[int]  # node of each server, by server index
    senders: dict[int, int]  # stage -> global rank of its sender
    relays: dict[int, int]  # node with servers -> its relay (lowest global rank on it)
    members: dict[int, list[int]] = field(default_factory=dict)  # stage -> sender, relays
    groups: dict[int, object] = field(default_factory=dict)  # stage -> its process group
    device: torch.device = torch.device("cpu")
    timeout_s: float = 600.0  # one HTTP request (the group's own timeout is twice that)

    def servers_on(self, node: int, indices: list[int]) -> list[int]:
        return [i for i in indices if self.server_nodes[i] == node]

    def relayed_by(self, rank: int) -> list[int]:
        """The stages whose buckets `rank` relays to its node's servers."""
        return [s for s, m in sorted(self.members.items()) if rank in m[1:]]

    def describe(self, servers: Servers) -> str:
        def urls(node: int) -> str:
            return " ".join(servers.url(i) for i in self.servers_on(node, range(len(servers))))

        parts = []
        for s, src in sorted(self.senders.items()):
            home = self.rank_nodes[src]
            text = f"stage {s} from rank {src} to node {home}'s servers ({urls(home) or 'none'})"
            for r in self.members.get(s, [])[1:]:
                n = self.rank_nodes[r]
                text += f", relayed by rank {r} to node {n}'s ({urls(n)})"
            parts.append(text)
        return "tensor buckets through per-node relays: " + "; ".join(parts)


def make_plan(
    servers: Servers, node: int | None, device: torch.device, timeout_s: float
) -> RelayPlan | None:
    """The relay plan when the servers are on several nodes, else None (every rank calls it:
    it gathers each rank's node and makes the groups)."""
    nodes = [r.node for r in servers.refs]
    if len(set(nodes)) <= 1:
        return None  # one node: the stage senders reach every server themselves
    if None in nodes:
        raise UserError(
            "some rollout servers have a node index and others do not; give every URL its node "
            "in rollout.url_nodes"
        )
    infos = gather.all_gather_objects((node, gather.stage_index(), gather.is_stage_sender()))
    if any(n is None for n, _, _ in infos):
        raise UserError(
            f"the rollout servers are on nodes {sorted(set(nodes))} and sync.method=tensor relays "
            "buckets through a trainer rank on each node, but a trainer rank does not know its "
            f"node; set {NODE_ENV} on every node (launch/torchrun.sh does) or sync.method="
            "distributed"
        )
    rank_nodes = [n for n, _, _ in infos]
    plan = RelayPlan(
        rank_nodes=rank_nodes,
        server_nodes=nodes,
        senders={s: r for r, (_, s, sender) in enumerate(infos) if sender},
        relays={},
        device=device,
        timeout_s=timeout_s,
    )
    for n in sorted(set(nodes)):
        ranks = [r for r, m in enumerate(rank_nodes) if m == n]
        if not ranks:
            urls = " ".join(servers.url(i) for i in plan.servers_on(n, range(len(servers))))
            raise UserError(
                f"node {n}'s rollout servers ({urls}) have no trainer rank on their node to "
                "receive the tensor transport's buckets; use sync.method=distributed"
            )
        plan.relays[n] = ranks[0]
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=2 * timeout_s)  # above one HTTP timeout (see top)
    for s, src in sorted(plan.senders.items()):
        others = sorted(r for n, r in plan.relays.items() if n != rank_nodes[src])
        if others:
            plan.members[s] = [src, *others]
            # Every rank makes every group, in the same order (new_group is a collective).
            plan.groups[s] = dist.new_group(
                sorted(plan.members[s]), timeout=timeout, backend=backend
            )
    return plan


class Fanout:
    """A stage sender's side: every bucket of its stage to the relays of the other nodes."""

    def __init__(self, plan: RelayPlan, stage: int):
        self.plan, self.stage = plan, stage
        self.group, self.src = plan.groups[stage], plan.senders[stage]
        self.broken = False

    def send(self, bucket: Bucket) -> None:
        relays = self.plan.members[self.stage][1:]
        try:
            self._header((bucket.index, bucket.nbytes, bucket.pooled, bucket.metadata))
            ready = _agree(True, self.group, self.plan.device)
            if ready:
                dist.broadcast(bucket.flat, src=self.src, group=self.group)
                bucket.seal()  # on a GPU: sent before the buffer goes back to be packed again
        except Exception as e:
            self.broken = True  # the group cannot be trusted with another collective
            raise TransportError(
                f"broadcast of bucket {bucket.index} to the relays (ranks {relays}) failed: {e}"
            ) from None
        if not ready:  # the group is in step: close() ends the stage for the relays
            raise TransportError(
                f"a relay (ranks {relays}) could not take bucket {bucket.index}; its error "
                "is reported with it"
            )

    def close(self) -> None:
        """The end of the stage, also after a failure (unless the group itself broke)."""
        if not self.broken:
            self._header(None)

    def _header(self, header) -> None:
        box = [header]
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.plan.device)


def receive(plan: RelayPlan, stage: int, pool: BufferPool) -> Iterator[Bucket]:
    """A relay's side: the stage's buckets as its sender broadcasts them, each in a buffer of
    `pool` (the consumer releases it), until the sender ends the stage. A bucket it cannot
    take a buffer for ends its buckets, and the error is raised when the sender ends the stage."""
    group, src = plan.groups[stage], plan.senders[stage]
    failure = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=plan.device)
        if box[0] is None:
            if failure is not None:
                raise failure
            return
        index, nbytes, pooled, metadata = box[0]
        buffer = None
        if failure is None:
            try:  # a buffer comes back once its bucket is posted: within an HTTP timeout
                buffer = pool.take(plan.timeout_s) if pooled else pool.take_big(nbytes)
            except Exception as e:  # noqa: BLE001 - told to the sender, raised at the end
                why = (
                    f"no buffer came back within {plan.timeout_s:g} s"
                    if isinstance(e, queue.Empty)
                    else f"{type(e).__name__}: {e}"
                )
                failure = TransportError(
                    f"relay could not take bucket {index} of stage {stage}: {why}"
                )
        if not _agree(buffer is not None, group, plan.device):
            if buffer is not None:  # another relay could not take it
                (pool.give if pooled else pool.give_big)(buffer)
            continue  # the sender ends the stage
        bucket = Bucket(stage, index, buffer, nbytes, metadata, pooled=pooled)
        try:
            dist.broadcast(bucket.flat, src=src, group=group)
        except Exception as e:
            (pool.give if pooled else pool.give_big)(buffer)
            raise TransportError(f"receiving bucket {index} from rank {src} failed: {e}") from None
        yield bucket.seal()


def _agree(ok: bool, group, device: torch.device) -> bool:
    """True when every member of `group` says ok (a one-number all-reduce)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0
