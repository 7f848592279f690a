"""Worker for the relay tests: a trainer whose ranks and servers are spread over simulated nodes.

torchrun --nproc-per-node N tests/distributed/relay_worker.py CKPT OUT.json URL[,URL..]
    --server-nodes 0,1,1 --rank-nodes 0,1 [--pp/--ep K] [--kill URL --kill-pid PID]
    [--fail-relay-buffer]

Every rank is told its node (`--rank-nodes`, by global rank) and every server its node, so the
tensor transport relays to the servers of the nodes other than a stage sender's. Version "1": the
policy perturbed once, synced with verify_every=1 (each server's probe log-probs against the
trainer's). With --kill, version "2" is synced and the server at URL is killed just before the
second bucket meant for it. With --fail-relay-buffer, version "2" is synced while the relays'
second buffer request fails (as an out-of-memory would), then version "3" with nothing injected.
Rank 0 writes the reports and what each server serves afterwards.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from weight_sync_worker import armed_sync, finish, perturb

from megatron_gspo.model.forward import score
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.weight_sync import verify
from megatron_gspo.weight_sync.bucket import BufferPool
from megatron_gspo.weight_sync.config import ServerRef, SyncConfig
from megatron_gspo.weight_sync.sync import WeightSync
from megatron_gspo.weight_sync.transports import TensorTransport


class KillMidSync(TensorTransport):
    """The tensor transport; once armed, it kills one server before the second bucket to it."""

    def __init__(self, victim: str | None, pid: int | None):
        self.victim, self.pid, self.armed = victim, pid, False

    def send(self, bucket, ctx):
        urls = {ctx.servers.url(i) for i in ctx.live}
        if self.armed and ctx.buckets == 1 and self.victim in urls:
            os.kill(self.pid, signal.SIGKILL)
            time.sleep(0.3)
        return super().send(bucket, ctx)


class FailSecondTake(BufferPool):
    """A relay's pool whose second request for a buffer fails (as an out of memory would),
    once. Counted per request, not per allocation: whether the second bucket needs a second
    buffer depends on when the first one comes back, and a fault that moves to the next sync
    with the timing tests nothing."""

    def __init__(self, pool: BufferPool):
        super().__init__(pool.capacity, pool.size, pool.alloc)
        self.requests = 0

    def _count(self) -> None:
        self.requests += 1
        if self.requests == 2:
            raise torch.OutOfMemoryError("injected: out of memory")

    def take(self, timeout_s=None):
        self._count()
        return super().take(timeout_s)

    def take_big(self, nbytes):
        self._count()
        return super().take_big(nbytes)


def fail_relay_buffer(ws: WeightSync) -> None:
    """On a relay: its pools start afresh, and their second buffer request fails, once."""
    for stage, pool in ws._relay_pools.items():
        ws._relay_pools[stage] = FailSecondTake(pool)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("servers")
    ap.add_argument("--server-nodes", required=True)
    ap.add_argument("--rank-nodes", required=True)
    for name in ("pp", "ep"):
        ap.add_argument("--" + name, type=int, default=1)
    ap.add_argument("--kill", default=None)
    ap.add_argument("--kill-pid", type=int, default=None)
    ap.add_argument("--fail-relay-buffer", action="store_true")
    ap.add_argument("--api-key", required=True)
    a = ap.parse_args()
    dims = ParallelDims(pp=a.pp, ep=a.ep, world_size=world_size_from_env())
    init_distributed(dims)
    chunks = load_policy(a.checkpoint, dims)
    nodes = [int(n) for n in a.server_nodes.split(",")]
    refs = [
        ServerRef(u, node=n, api_key=a.api_key)
        for u, n in zip(a.servers.split(","), nodes, strict=True)
    ]  # tensor (shared-memory) updates need the servers' key
    cfg = SyncConfig(method="tensor", bucket_mb=0.05, verify_every=1, timeout_s=60)
    transport = KillMidSync(a.kill, a.kill_pid)
    node = [int(n) for n in a.rank_nodes.split(",")][dist.get_rank()]
    ws = WeightSync(chunks, refs, cfg, base_model=a.checkpoint, transport=transport, node=node)

    seqs = verify.probe_batch(chunks[0].model_spec.vocab_size, cfg)
    expected = {"0": score(chunks, seqs)}
    result: dict = {"plan": ws.relay.describe(ws.servers)}
    perturb(chunks, 1)
    expected["1"] = score(chunks, seqs)
    report = ws.sync("1")  # verify_every=1: raises unless every server serves "1" and matches
    result["synced"] = report.__dict__
    if a.kill:
        perturb(chunks, 2)
        expected["2"] = score(chunks, seqs)
        result.update(armed_sync(ws, transport, "2"))
    if a.fail_relay_buffer:
        perturb(chunks, 2)
        expected["2"] = score(chunks, seqs)
        fail_relay_buffer(ws)
        result.update(armed_sync(ws, transport, "2"))
        perturb(chunks, 3)
        expected["3"] = score(chunks, seqs)
        result["after"] = ws.sync("3").__dict__  # raises unless every server serves "3"
    finish(ws, seqs, expected, result, a.out)


if __name__ == "__main__":
    main()
