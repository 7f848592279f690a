"""Distributed (disaggregated): one group per pipeline stage, the stage sender as rank 0 and every
server TP rank after it (rank_offset), rendezvous over PrefixStore(group_name) as SGLang requires;
per bucket, /update_weights_from_distributed is posted to every server and then the bucket is
broadcast once (gloo on CPU, NCCL on GPU). The answers to a bucket are awaited after the next
bucket's broadcast (or when the stage closes), so a server loads one bucket while it receives
the next; an error answer during a broadcast ends it (that server never joins it). Stages send
in turn, in stage order (`stages_in_turn`). A server that failed a bucket has still received
the one after it, so that broadcast does not hang; then the stage stops (the group is broken)
or, after the last bucket, that server alone is dropped. A stage's group is kept from one sync to
the next, as long as nothing failed in it and its members are the same servers (opening one is
an NCCL communicator's setup across the trainer and every server rank, each time). Before the
kept group is used, each member is asked, with an update of no tensors over it, whether it still
holds it: a restarted server does not, and a new group is opened for every member. A group that
saw a failure is destroyed at once; the kept ones at close().
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from urllib.parse import urlparse

import torch

from megatron_gspo.rollout import weight_payload as wp
from megatron_gspo.weight_sync.bucket import Bucket
from megatron_gspo.weight_sync.servers import LOCAL_HOSTS, Servers, collect
from megatron_gspo.weight_sync.transports.base import StageContext, Transport, TransportError

log = logging.getLogger(__name__)


class DistributedTransport(Transport):
    name = "distributed"
    gapless = True  # the receiver recomputes offsets from names, dtypes and shapes
    # A server receives one group's broadcast at a time (SGLang's scheduler, the built-in
    # server's lock). Were stages sent at once, two servers could take their requests in
    # opposite orders, each waiting in one group for the other: on NCCL (whose broadcast needs
    # every member) that hangs for good. So the stages take turns.
    stages_in_turn = True

    def __init__(self):
        self.kept: dict[int, dict] = {}  # stage -> its group, name and members, between syncs

    def open_stage(self, ctx: StageContext) -> None:
        kept = self.kept.pop(ctx.stage, None)
        if kept is not None:
            if self._still_held(kept, ctx):
                ctx.state.update(kept)
                return
            # A member is gone or changed: abort (NCCL) rather than wait for it, and go on.
            self._destroy(kept, ctx.servers, abort=True)
        cfg, servers = ctx.config, ctx.servers
        address = cfg.master_address or master_address(servers)
        name = f"megatron-gspo-s{ctx.stage}-{uuid.uuid4().hex[:8]}"
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        offsets, world = {}, 1
        for i in ctx.live:
            offsets[i], world = world, world + servers.refs[i].tp_size
        store, port = wp.host_update_store(address, world, cfg.timeout_s)
        futures = {
            i: servers.submit(
                i, "/init_weights_update_group",
                wp.init_group_body(address, port, world, name, backend, rank_offset=offsets[i]),
            )
            for i in ctx.live
        }  # fmt: skip
        try:
            group = wp.open_update_group(address, port, world, 0, name, backend, cfg.timeout_s,
                                         store=store)  # fmt: skip
        except Exception as e:
            _, errors = collect(futures)
            ctx.fail(errors)
            raise TransportError(f"could not open update group {name!r}: {e}") from None
        _, errors = collect(futures)
        members = {i: servers.refs[i] for i in ctx.live}
        ctx.state.update(group=group, name=name, members=members)
        if errors:  # the group cannot run without every member
            ctx.fail(errors)
            ctx.state["broken"] = True
            raise TransportError(f"servers did not join update group {name!r}")

    def _still_held(self, kept: dict, ctx: StageContext) -> bool:
        """Whether the kept group can carry this sync: the same servers (with the same TP sizes)
        are its members, and each still holds it, which an update of no tensors over it asks
        (a server restarted since has no such group, and says so)."""
        if kept["members"] != {i: ctx.servers.refs[i] for i in ctx.live}:
            return False
        # No load_format: no tensors means no broadcast at all (a flattened_bucket of none
        # would still be one, of 0 bytes, that nobody sends).
        body = {"names": [], "dtypes": [], "shapes": [], "group_name": kept["name"],
                "flush_cache": False, "selector": "target"}  # fmt: skip
        _, errors = ctx.servers.post_many(ctx.live, "/update_weights_from_distributed", body)
        for msg in errors.values():
            log.warning("weight sync: a new update group for stage %d: %s", ctx.stage, msg)
        return not errors

    def send(self, bucket: Bucket, ctx: StageContext) -> dict[int, str]:
        names = [m.name for m in bucket.metadata]
        body = {
            "names": names,
            "dtypes": [wp.dtype_name(m.dtype) for m in bucket.metadata],
            "shapes": [list(m.shape) for m in bucket.metadata],
            "group_name": ctx.state["name"],
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": ctx.version_for_bucket(),
        }
        ctx.touched.update(ctx.live)
        futures = {
            i: ctx.servers.submit(i, "/update_weights_from_distributed", body) for i in ctx.live
        }
        try:
            work = torch.distributed.broadcast(
                bucket.flat, group=ctx.state["group"], group_src=0, async_op=True
            )
            self._await(work, {**ctx.state.get("pending", {}), **futures}, ctx, bucket.index)
        except Exception as e:
            ctx.state["broken"] = True
            _, errors = collect({**ctx.state.pop("pending", {}), **futures})
            ctx.fail(errors)
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"broadcast of bucket {bucket.index} failed: {e}") from None
        bucket.sum()  # while the servers receive and load
        pending, ctx.state["pending"] = ctx.state.pop("pending", {}), futures
        return self._check(pending, ctx, bucket.index - 1)

    def _await(self, work, futures: dict, ctx: StageContext, index: int) -> None:
        """Wait for a broadcast while watching the servers' answers. A member that answers with
        an error never joins the broadcast: on NCCL the broadcast would wait for it until the
        watchdog kills the trainer, and on gloo a bucket larger than the socket buffers waits
        until the group's timeout. So its error (or the timeout) ends the wait: the group is
        aborted (NCCL) or left to the members' destroy (gloo), and the stage stops."""
        deadline = time.monotonic() + ctx.config.timeout_s
        while not work.is_completed():
            failed = {i: f for i, f in futures.items() if f.done() and f.exception()}
            late = time.monotonic() > deadline
            if failed or late:
                ctx.state["aborted"] = True
                _abort(ctx.state["group"])
                why = (
                    "servers failed during"
                    if failed
                    else f"timed out ({ctx.config.timeout_s:g} s) in"
                )
                raise TransportError(f"{why} the broadcast of bucket {index}; the group is broken")
            time.sleep(0.001)
        work.wait()  # a failed broadcast raises here

    def _check(self, futures: dict, ctx: StageContext, index: int) -> dict[int, str]:
        _, errors = collect(futures)
        if errors:  # a member that failed may have left the group: later broadcasts would hang
            ctx.fail(errors)
            raise TransportError(f"servers failed bucket {index}; the group is broken")
        return errors

    def close_stage(self, ctx: StageContext) -> None:
        _, errors = collect(ctx.state.pop("pending", {}))  # the last bucket's answers
        ctx.fail(errors)
        if "group" not in ctx.state:
            return
        kept = {k: ctx.state[k] for k in ("group", "name", "members")}
        whole = not ctx.state.get("broken") and set(kept["members"]) <= set(ctx.live)
        if whole and ctx.config.keep_groups:  # the next sync broadcasts over it again
            self.kept[ctx.stage] = kept
            return
        self._destroy(kept, ctx.servers, aborted=ctx.state.get("aborted", False))

    def close(self, servers: Servers) -> None:
        """Destroy the kept groups (also when the job is failing: a server that does not
        answer within 30 s is left to its restart)."""
        for stage in sorted(self.kept):
            try:
                self._destroy(self.kept.pop(stage), servers, timeout_s=30.0)
            except Exception as e:  # noqa: BLE001 - the other groups are still destroyed
                log.warning("weight sync: destroying stage %d's update group: %s", stage, e)

    @staticmethod
    def _destroy(kept: dict, servers: Servers, aborted=False, abort=False, timeout_s=None):
        """Destroy a group on its members (those that still hold it) and here. `abort`: a
        member may be gone, so an NCCL group is aborted first, and a failure is only logged."""
        body = {"group_name": kept["name"]}
        path = "/destroy_weights_update_group"
        collect({i: servers.submit(i, path, body, timeout_s) for i in kept["members"]})
        try:
            if abort:
                _abort(kept["group"])
            wp.close_update_group(kept["group"])
        except Exception as e:
            if not (aborted or abort):  # an aborted group may be gone already
                raise
            log.warning("weight sync: destroying update group %s: %s", kept["name"], e)


def _abort(group) -> None:
    """Abort an NCCL group whose broadcast cannot finish; a gloo one is unblocked when its
    members destroy their ends (close_stage)."""
    from torch.distributed import distributed_c10d as c10d

    if torch.distributed.get_backend(group) == "nccl":
        c10d._abort_process_group(group)


def master_address(servers: Servers) -> str:
    """Where the servers reach this rank's group store: loopback when they are all local, else
    the address this host sends from towards them (its host name may resolve to 127.0.1.1)."""
    hosts = {urlparse(r.url).hostname for r in servers.refs}
    if hosts <= LOCAL_HOSTS:
        return "127.0.0.1"
    remote = sorted(h for h in hosts if h not in LOCAL_HOSTS)[0]
    try:
        family, _, _, _, addr = socket.getaddrinfo(remote, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: nothing is sent, the route picks the source address
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
