"""Worker for the weight-sync tests: perturb the policy, sync it into running servers, compare.

torchrun --nproc-per-node N tests/distributed/weight_sync_worker.py CKPT OUT.json URL[,URL..]
    [--tp/--pp/--ep K] [--transport T] [--dir D] [--bucket-mb MB]
    [--fail kill-server|transport-error|broadcast-error|crash|packing --kill-pid PID] [--after]
    [--recover]
    [--one-sync [--restart-before K --kill-pid PID]] [--catch-up --kill-pid PID]

Version "1": the policy perturbed once, synced with verify_every=1 (which checks every server's
probe log-probs against the trainer's). With --fail, version "2" (perturbed again) is synced with
the failure injected after the first bucket (packing: on the stage sender's main thread,
while its peers gather; broadcast-error: the trainer's broadcast of the second bucket raises
once it is done). With --after, one more version is synced after it, with nothing injected.
Rank 0 writes what each server serves afterwards
(its version and its probe log-probs' distance to the trainer's versions 0, 1 and 2).
With --recover, a fresh trainer only calls WeightSync.recover() and reports the servers.
With --one-sync, one WeightSync makes every sync (else one each, the one before closed first);
--restart-before K then kills the first server (--kill-pid) before sync K and starts it again on
its port (its pid in OUT.json.pid, for the test to stop). After the last sync the WeightSync is
closed, and rank 0 asks each server to destroy every update group the syncs used: what it
answers shows whether close() destroyed them. With --catch-up, after the syncs the first server
is started again (on its base weights) and WeightSync.catch_up runs twice.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.model.forward import score
from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env
from megatron_gspo.model.policy import load_policy
from megatron_gspo.weight_sync import gather as gather_module
from megatron_gspo.weight_sync import sync as sync_module
from megatron_gspo.weight_sync import verify
from megatron_gspo.weight_sync.config import ServerRef, SyncConfig
from megatron_gspo.weight_sync.sync import WeightSync, WeightSyncError
from megatron_gspo.weight_sync.transports import Transport, TransportError, make_transport


@torch.no_grad()
def perturb(chunks, seed: int) -> None:
    """Deterministic noise, identical on every replica of a tensor (TP-replicated, DP)."""
    from megatron.core import parallel_state as mpu

    pp = mpu.get_pipeline_model_parallel_rank()
    for ci, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            key = zlib.crc32(f"{pp}/{ci}/{name}".encode())
            g = torch.Generator().manual_seed(seed * 1_000_003 + key)
            noise = torch.randn(p.shape, generator=g)
            p.add_(noise * (0.3 * p.float().std().nan_to_num().item() + 0.02))


class Faulty(Transport):
    """The configured transport, with a failure injected before the second bucket of a sync."""

    def __init__(self, inner: Transport, mode: str, kill_pid: int | None):
        self.inner, self.mode, self.kill_pid, self.armed = inner, mode, kill_pid, False
        self.name, self.needs_session = inner.name, inner.needs_session
        self.writes_files = inner.writes_files
        self.gapless, self.stages_in_turn = inner.gapless, inner.stages_in_turn

    def alloc(self, nbytes, device):
        return self.inner.alloc(nbytes, device)

    def bucket_device(self, model_device, servers):
        return self.inner.bucket_device(model_device, servers)

    def open_stage(self, ctx):
        self.inner.open_stage(ctx)

    def close_stage(self, ctx):
        self.inner.close_stage(ctx)

    def close(self, servers):
        self.inner.close(servers)

    def commit(self, servers, live, version, new_dir):
        if self.armed and self.mode == "kill-server" and self.inner.writes_files:
            self._kill()
        return self.inner.commit(servers, live, version, new_dir)

    def send(self, bucket, ctx):
        if self.armed and ctx.buckets == 1:
            if self.mode == "kill-server":
                self._kill()
            elif self.mode == "transport-error":
                raise TransportError("injected transport failure")
            elif self.mode == "crash":
                os._exit(3)  # the trainer dies mid-sync
            elif self.mode == "broadcast-error":
                self.armed = False
                return self._failing_broadcast(bucket, ctx)
        return self.inner.send(bucket, ctx)

    def _failing_broadcast(self, bucket, ctx):
        """The inner send, whose broadcast raises after it has run (so every member has the
        bucket, and only the trainer saw a failure)."""
        real = dist.broadcast

        def broadcast(*args, **kwargs):
            work = real(*args, **kwargs)
            work.wait()
            raise RuntimeError("injected broadcast failure")

        dist.broadcast = broadcast
        try:
            return self.inner.send(bucket, ctx)
        finally:
            dist.broadcast = real

    def _kill(self):
        try:
            os.kill(self.kill_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(0.3)


def fail_packing() -> None:
    """Packing fails after the first bucket (as a GPU out of memory would, in take_big)."""
    real = sync_module.pack

    def pack(*args, **kwargs):
        for i, bucket in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise torch.OutOfMemoryError("injected: out of memory while packing")
            yield bucket

    sync_module.pack = pack


GATHERS = {"dense": 0, "expert": 0}  # this rank's calls of gather_full by the syncs


def count_gathers() -> None:
    """Count the weight sync's TP / expert-TP gathers on this rank (the real ones run)."""
    real = gather_module.gather_full

    def gather_full(lp, info):
        GATHERS["expert" if lp.map.expert else "dense"] += 1
        return real(lp, info)

    gather_module.gather_full = gather_full


def serving(ws: WeightSync, seqs, refs: dict) -> dict:
    """What each server serves: version, and max |diff| to each trainer version's log-probs."""
    out = {}
    for i in range(len(ws.servers)):
        url = ws.servers.url(i)
        try:
            got, version = verify.server_logprobs(ws.servers, i, seqs)
        except Exception as e:  # noqa: BLE001
            out[url] = {"error": str(e)}
            continue
        diffs = {k: verify.max_abs_diff(got, r) for k, r in refs.items()}
        out[url] = {"version": version, "diffs": diffs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("servers")
    for name in ("tp", "pp", "ep"):
        ap.add_argument("--" + name, type=int, default=1)
    ap.add_argument("--transports", default="tensor", help="comma-separated, one sync each")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--bucket-mb", type=float, default=0.05)
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--fail", default=None)
    ap.add_argument("--kill-pid", type=int, default=None)
    ap.add_argument("--recover", action="store_true")
    ap.add_argument("--ddp", action="store_true", help="hold the model as training does (Actor)")
    ap.add_argument("--one-sync", action="store_true", help="one WeightSync for every sync")
    ap.add_argument("--restart-before", type=int, default=None)
    ap.add_argument("--after", action="store_true", help="sync once more after the failure")
    ap.add_argument("--no-keep-groups", action="store_true")
    ap.add_argument("--catch-up", action="store_true")
    ap.add_argument("--api-key", default=None, help="the servers' API key")
    a = ap.parse_args()
    dims = ParallelDims(tp=a.tp, pp=a.pp, ep=a.ep, world_size=world_size_from_env())
    init_distributed(dims)
    chunks = load_policy(a.checkpoint, dims)
    if a.ddp:  # megatron DDP + distributed optimizer: the parameters live in one buffer
        from megatron_gspo.train.actor import Actor, OptimConfig
        from megatron_gspo.weight_sync.gather import unwrap

        chunks = unwrap(Actor(chunks, OptimConfig(lr=1e-6)).chunks)
    transports = a.transports.split(",")
    count_gathers()

    def weight_sync(name: str) -> WeightSync:
        cfg = SyncConfig(
            method=name, bucket_mb=a.bucket_mb, verify_every=1, verify_tolerance=1e-4,
            dir=a.dir, snapshot_every=a.snapshot_every, timeout_s=60,
            keep_groups=not a.no_keep_groups,
        )  # fmt: skip
        transport = make_transport(cfg)
        if a.fail:
            transport = Faulty(transport, a.fail, a.kill_pid)
        refs = [ServerRef(url, api_key=a.api_key) for url in a.servers.split(",")]
        return WeightSync(chunks, refs, cfg, base_model=a.checkpoint,
                          transport=transport)  # fmt: skip

    ws = weight_sync(transports[0])
    seqs = verify.probe_batch(chunks[0].model_spec.vocab_size, ws.config)
    refs = {"0": score(chunks, seqs)}
    result: dict = {"syncs": []}
    if a.recover:  # a new trainer after a crash: version 1's weights, servers left mid-sync
        perturb(chunks, 1)
        refs["1"] = score(chunks, seqs)
        result["recovered"] = ws.recover()
    for k, name in enumerate([] if a.recover else transports, start=1):
        if not a.one_sync or k == 1:
            ws.close()
            ws = weight_sync(name)
        if k == a.restart_before:
            restart_first_server(a, ws)
        perturb(chunks, k)
        refs[str(k)] = score(chunks, seqs)
        t0 = time.perf_counter()
        report = ws.sync(str(k))  # verify_every=1: raises unless every server matches
        checked = ws.verify(str(k))
        result["syncs"].append({
            "transport": name, "version": str(k), "seconds": time.perf_counter() - t0,
            "buckets": report.buckets, "verify": [r.__dict__ for r in checked],
            "bytes": report.bytes, "lent": report.lent_bytes, "stage_times": report.stage_times,
            "groups": report.groups,
        })  # fmt: skip
    if a.catch_up:
        restart_first_server(a, ws)
        last = str(len(transports))
        real, reports = ws.sync, []

        def sync(*args, **kwargs):  # the real sync; where it left each server is kept
            report = real(*args, **kwargs)
            reports.append(report.servers)
            return report

        ws.sync = sync
        result["caught_up"] = ws.catch_up(last)
        result["caught_up_again"] = ws.catch_up(last)  # []: every server is on it now
        result["catch_up_syncs"] = reports
    if a.fail:
        k = str(len(transports) + 1)
        perturb(chunks, int(k))
        refs[k] = score(chunks, seqs)
        result.update(armed_sync(ws, ws.transport, k))
        if a.after:
            k = str(int(k) + 1)
            perturb(chunks, int(k))
            refs[k] = score(chunks, seqs)
            report = ws.sync(k)  # verify_every=1: raises unless every server matches
            result["after"] = {"version": k, "groups": report.groups}
    finish(ws, seqs, refs, result, a.out)


def armed_sync(ws: WeightSync, transport, version: str) -> dict:
    """A sync with the injected fault armed: its error and report (None: it succeeded)."""
    transport.armed = True
    if getattr(transport, "mode", None) == "packing":
        fail_packing()
    try:
        ws.sync(version)
        return {"error": None}
    except WeightSyncError as e:
        return {"error": str(e), "report": e.report.__dict__ if e.report else None}


def restart_first_server(a, ws: WeightSync) -> None:
    """Kill the first server and start it again on the same port (rank 0; the rest wait)."""
    if dist.get_rank() == 0:
        os.killpg(a.kill_pid, signal.SIGKILL)
        url = ws.servers.url(0)
        log = Path(a.out + ".server.log")
        with open(log, "w") as f:
            p = subprocess.Popen(
                [sys.executable, "-m", "megatron_gspo.server", "--model", a.checkpoint,
                 "--port", url.rsplit(":", 1)[1], "--threads", "1"],
                env={**os.environ, "OMP_NUM_THREADS": "1",
                     "MEGATRON_GSPO_API_KEY": a.api_key or ""},
                stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        Path(a.out + ".pid").write_text(str(p.pid))
        deadline = time.monotonic() + 120
        while not re.search(r" on http://", log.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
    dist.barrier()


def finish(ws: WeightSync, seqs, refs: dict, result: dict, out: str) -> None:
    """Rank 0 adds what each server serves; every rank closes; rank 0 then asks each server to
    destroy the update groups the syncs used, and writes the result."""
    from megatron.core import parallel_state as mpu

    mine = {
        **GATHERS,
        "dp": mpu.get_data_parallel_rank(),
        "edp": mpu.get_expert_data_parallel_rank(),
    }
    result["gathers"] = gather_module.all_gather_objects(mine)  # by rank
    if dist.get_rank() == 0:
        result["serving"] = serving(ws, seqs, refs)
    ws.close()
    dist.barrier()  # every stage's sender has closed
    if dist.get_rank() == 0:
        from megatron_gspo.weight_sync.servers import Servers

        syncs = [*result.get("syncs", []), *([result["after"]] if "after" in result else [])]
        names = sorted({g for s in syncs for g in s.get("groups", {}).values()})
        left = Servers(ws.servers.refs, 30)
        result["destroy_after_close"] = {
            name: [
                left.post_many([i], "/destroy_weights_update_group", {"group_name": name})[1]
                .get(i, "destroyed now")
                for i in range(len(left))
            ]
            for name in names
        }  # fmt: skip
        left.close()
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
