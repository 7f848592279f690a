"""WeightSync: the trainer's weights into every rollout server as one new weight_version.

    ws = WeightSync(actor.chunks, urls, SyncConfig(method="tensor"), base_model=HF_DIR)
    report = ws.sync(version=str(step))      # every trainer rank calls it: it runs collectives

Begin (coordinator) -> stream buckets (every stage sender, relays on other nodes) -> commit ->
restore what failed -> end. Each server ends on the new version, the restore point's, the one it
had, or is reported lost; docs/architecture.md ("A weight sync") tells the whole story.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_gspo.comm import bcast, rank
from megatron_gspo.model.lora import has_adapter
from megatron_gspo.weight_sync import gather, verify
from megatron_gspo.weight_sync.bucket import BufferPool, pack, release
from megatron_gspo.weight_sync.config import ServerRef, SyncConfig
from megatron_gspo.weight_sync.disk import RestorePoint, ShardWriter, VersionDirs
from megatron_gspo.weight_sync.placement import enter_thread, shm_dir
from megatron_gspo.weight_sync.relay import Fanout, make_plan, receive
from megatron_gspo.weight_sync.servers import Servers
from megatron_gspo.weight_sync.session import (
    Coordinator,
    SyncReport,
    VerificationFailed,
    WeightSyncError,
)
from megatron_gspo.weight_sync.transports import (
    StageContext,
    Transport,
    TransportError,
    make_transport,
)


class WeightSync(Coordinator):
    def __init__(
        self,
        chunks,
        servers: list[str | ServerRef],
        config: SyncConfig | None = None,
        *,
        base_model: str | Path,
        base_version: str = "default",
        transport: Transport | None = None,
        node: int | None = None,
    ):
        """`base_model`: the HF directory the servers started from (config and tokenizer for
        disk versions, and the first restore point, at `base_version`). `node`: the launcher's
        index of this rank's node; the tensor transport needs it when the servers are on several
        nodes (`ServerRef.node`), to relay each node's buckets through a rank there."""
        from megatron_gspo.model.policy import hf_files_dir

        self.chunks = gather.unwrap(chunks)
        self._lora = any(has_adapter(p) for c in self.chunks for p in c.parameters())
        self.config = config = config or SyncConfig()
        config.check()
        self.servers = Servers(servers, config.timeout_s)
        self.transport = transport or make_transport(config)
        self.base_hf = hf_files_dir(base_model)
        base = RestorePoint(str(Path(base_model).resolve()), base_version)
        self._drop_own_dir = None
        root = config.dir
        if root is None and (self.transport.writes_files or config.snapshot_every):
            root = shm_dir(self.servers)
            if rank() == 0:  # ours alone: gone at close(), or when the process ends without it
                self._drop_own_dir = weakref.finalize(self, shutil.rmtree, root, True)
        self.dirs = VersionDirs(root, config.keep_versions, base) if root else None
        self._base = base
        # Buckets live where the servers can read them: on the GPU when the trainer is there,
        # unless a server runs on CPU (the built-in server on a GPU machine), which takes
        # shared memory (tensor) or gloo (distributed) instead of CUDA IPC or NCCL. Files are
        # written from CPU buckets (no GPU memory, no second copy out of the GPU).
        self.model_device = next(self.chunks[0].parameters()).device
        self.device = self.transport.bucket_device(self.model_device, self.servers)
        self.pool = self._new_pool()
        # On CPU the stage sender lends its parameter buffer (bucket.py) instead of copying it
        # into buckets: to the servers in shared memory (tensor), to the broadcast (distributed)
        # or to its shard writer (disk).
        self._borrow = self.transport.lend(self.chunks) if gather.is_stage_sender() else None
        self.count = 0  # syncs of new versions (snapshot_every, verify_every count these)
        self.serial = 0  # every sync, catch-ups included (the stage turns' keys)
        self.coordinator = rank() == 0
        # every rank's pid: a server loads shared memory only from the processes named at
        # /begin_weight_update (torch names each object after the process that made it)
        self.senders = gather.all_gather_objects(os.getpid())
        self.relay = None
        if self.transport.relays:
            self.relay = make_plan(self.servers, node, self.device, config.timeout_s)
        # Stages that send in turn (distributed): each stage waits for the one before.
        self._turns = gather.StageTurns() if self.transport.stages_in_turn else None
        relayed = self.relay.relayed_by(rank()) if self.relay else []
        self._relay_pools = {s: self._new_pool() for s in relayed}
        self._relaying = ThreadPoolExecutor(len(relayed), "weight-sync-relay") if relayed else None

    def _new_pool(self) -> BufferPool:
        alloc = lambda n: self.transport.alloc(n, self.device)  # noqa: E731
        return BufferPool(self.config.bucket_bytes, self.config.buffers, alloc)

    @property
    def restore_point(self) -> RestorePoint:
        return self.dirs.restore if self.dirs else self._base

    @property
    def base_version(self) -> str:
        """The weight_version of the servers' starting weights (`base_model`)."""
        return self._base.version

    # ---- one sync ------------------------------------------------------------------------

    def sync(
        self, version: str | int, only: list[int] | None = None, catching_up: bool = False
    ) -> SyncReport:
        """Every rank: the trainer's weights into every server as `version` (`only`: these
        server indices, as the coordinator gives them). Raises WeightSyncError, with the
        report, unless every one took it. `catching_up`: the version the others are on already
        (catch_up): no snapshot, no verification, not counted by snapshot_every/verify_every."""
        version = str(version)
        self.serial += 1
        self.count += 0 if catching_up else 1
        t0 = time.perf_counter()
        plan = None
        if self.coordinator:
            plan = self._begin(version, only, snapshot=not catching_up)
        plan = bcast(plan)
        try:
            mine = self._stream(version, plan)
        except BaseException:
            if self.coordinator:  # our own gather failed: leave no server half-updated
                self._finish_session(version, plan, [], crashed=True)
            raise
        outcomes = [o for of_rank in gather.all_gather_objects(mine) for o in of_rank]
        report = None
        if self.coordinator:
            report = self._finish_session(version, plan, outcomes)
            report.seconds = time.perf_counter() - t0
        report = bcast(report)
        if not report.ok:
            raise WeightSyncError(report.message(), report)
        every = self.config.verify_every
        if every and self.count % every == 0 and not catching_up:
            on = [
                i
                for i in range(len(self.servers))
                if report.servers[self.servers.url(i)] == version
            ]
            try:
                self.verify(version, on)  # not one left out of this sync: catch_up is for those
            except VerificationFailed as e:
                e.report = report
                raise
        return report

    def _stream(self, version: str, plan: dict) -> list[dict]:
        """This rank's outcomes: its stage's if it is a sender, and one per stage it relays."""
        relaying = [
            self._relaying.submit(self._relay_stage, version, plan, stage, pool)
            for stage, pool in self._relay_pools.items()
        ]
        try:
            mine = self._stream_stage(version, plan)
        finally:
            relayed = [f.result() for f in relaying]
            self._renew_gpu_pools()
        return ([mine] if mine else []) + relayed

    def _renew_gpu_pools(self) -> None:
        """On a GPU, bucket buffers go back to the caching allocator once a sync is sent: kept,
        they would hold GPU memory through training (two buckets per pool, plus oversized
        tensors such as the embedding), and every CUDA IPC share of a kept buffer adds a
        reference record to it that lives as long as the buffer. On a CPU they are kept:
        fresh shared memory costs more than the copy."""
        if self.device.type == "cuda":
            self.pool = self._new_pool()
            self._relay_pools = {s: self._new_pool() for s in self._relay_pools}

    def _stream_stage(self, version: str, plan: dict) -> dict | None:
        # LoRA: frozen weights are the base's on every server; files need every tensor
        named = gather.iter_stage(self.chunks, changed_only=self._lora and not plan["write"])
        if self._turns is not None:
            self._turns.wait(self.serial)  # the stage before is done
        if not gather.is_stage_sender():
            for _ in named:  # drive the collectives
                pass
            return None
        stage = gather.stage_index()
        live, fanout = list(plan["live"]), None
        if self.relay:  # this node's servers; the relays reach the others'
            live = self.relay.servers_on(self.relay.rank_nodes[rank()], live)
            fanout = Fanout(self.relay, stage) if stage in self.relay.groups else None
        ctx = StageContext(self.servers, self.config, version, stage, live, device=self.device)
        started = time.time()
        try:
            out = self._send_stage(ctx, named, plan, fanout)
        finally:
            sent = (started, time.time())
            if self._turns is not None:  # also after a failure: the next stage goes on
                self._turns.done(self.serial)
        out["sent"] = sent
        return out

    def _send_stage(self, ctx: StageContext, named, plan: dict, fanout: Fanout | None) -> dict:
        """Open, send every bucket of and close this rank's stage: its outcome."""
        writer = ShardWriter(self.dirs.tmp(ctx.version), ctx.stage) if plan["write"] else None
        error, nbytes, sums, lent = None, 0, [], 0
        try:
            self.transport.open_stage(ctx)
        except TransportError as e:
            error = str(e)
        try:
            # Borrowed buckets go to this node's servers and shard files, not to relays.
            borrow = self._borrow if fanout is None else None
            buckets = pack(
                named, self.pool, ctx.stage, borrow=borrow, gapless=self.transport.gapless
            )
            error, nbytes, sums, lent = self._send_all(buckets, ctx, writer, error, fanout)
        except Exception as e:  # noqa: BLE001 - packing failed here (e.g. out of memory)
            error = f"packing stage {ctx.stage}: {type(e).__name__}: {e}"
            for _ in named:  # the stage's other ranks are still gathering: go on with them
                pass
        finally:
            closing = self._close_stage(ctx, fanout)
        files = writer.outcome() if writer else None
        return _outcome(ctx, error or closing, nbytes, sums, files, lent=lent)

    def _close_stage(self, ctx: StageContext, fanout: Fanout | None) -> str | None:
        errors = []
        if fanout is not None:
            try:
                fanout.close()  # the relays stop waiting, also after a failure
            except Exception as e:  # noqa: BLE001 - reported with the rest
                errors.append(f"ending stage {ctx.stage} for the relays: {type(e).__name__}: {e}")
        try:
            self.transport.close_stage(ctx)
        except Exception as e:  # noqa: BLE001 - reported with the rest
            errors.append(f"closing stage {ctx.stage}: {type(e).__name__}: {e}")
        return "; ".join(errors) or None

    def _relay_stage(self, version: str, plan: dict, stage: int, pool: BufferPool) -> dict:
        """On a relay's thread: `stage`'s buckets from its sender to this node's servers."""
        enter_thread(self.model_device)
        node = self.relay.rank_nodes[rank()]
        live = self.relay.servers_on(node, plan["live"])
        ctx = StageContext(self.servers, self.config, version, stage, live, device=self.device)
        error, nbytes, sums = None, 0, []
        try:
            buckets = receive(self.relay, stage, pool)
            error, nbytes, sums, _ = self._send_all(buckets, ctx, None, None, pool=pool)
        except Exception as e:  # noqa: BLE001 - a trainer-side failure of this relay
            error = str(e) if isinstance(e, TransportError) else repr(e)
        return _outcome(ctx, error, nbytes, sums, None, relay=node)

    def _send_all(self, buckets, ctx: StageContext, writer, error: str | None, fanout=None,
                  pool: BufferPool | None = None):  # fmt: skip
        """Send each bucket on a worker thread while the caller packs (or, on a relay,
        receives) the next one: to the relays of other nodes first, then to `ctx.live`."""
        pool = pool or self.pool
        q: queue.Queue = queue.Queue(maxsize=pool.size)
        state = {"error": error, "bytes": 0, "checksums": [], "lent": 0}

        def work():
            enter_thread(self.model_device)
            while (b := q.get()) is not None:
                try:
                    if state["error"] is None:
                        if writer is not None:
                            writer.write(b)
                        if fanout is not None:
                            fanout.send(b)
                        if ctx.live:
                            ctx.fail(self.transport.send(b, ctx))
                        ctx.buckets += 1
                        state["bytes"] += b.nbytes
                        state["lent"] += b.nbytes if b.borrowed else 0
                        state["checksums"].append(b.sum())
                except Exception as e:  # noqa: BLE001 - a trainer-side failure of this stage
                    state["error"] = str(e) if isinstance(e, TransportError) else repr(e)
                finally:
                    release(b, pool)
            if writer is not None:
                try:
                    writer.flush()  # the shards still being written
                except Exception as e:  # noqa: BLE001 - a trainer-side failure of this stage
                    state["error"] = state["error"] or repr(e)

        worker = threading.Thread(target=work, name=f"weight-sync-s{ctx.stage}", daemon=True)
        worker.start()
        try:
            for b in buckets:
                q.put(b)
        finally:
            q.put(None)
            worker.join()
        return state["error"], state["bytes"], state["checksums"], state["lent"]

    # ---- verification and recovery -----------------------------------------------------

    def verify(
        self, version: str | None = None, indices: list[int] | None = None
    ) -> list[verify.ProbeResult]:
        """Compare every server's (`indices`: these servers') probe log-probs with the
        trainer's (all ranks call it)."""
        from megatron_gspo.model.forward import score

        seqs = verify.probe_batch(self.chunks[0].model_spec.vocab_size, self.config)
        reference = score(self.chunks, seqs)
        results = None
        if self.coordinator:
            chosen = list(range(len(self.servers))) if indices is None else indices
            results = verify.check_servers(self.servers, chosen, seqs, reference)
        results = bcast(results)
        bad = verify.problems(results, version, self.config.verify_tolerance)
        if bad:
            gone = [r.url for r in results if r.error]
            raise VerificationFailed(
                "weight sync verification failed: " + " | ".join(bad), gone, len(gone) == len(bad)
            )
        return results

    def catch_up(self, version: str, among: list[int] | None = None) -> list[str]:
        """Every rank: bring the servers that answer on another weight_version than `version`
        (the trainer's weights now) to it, e.g. one its supervisor restarted onto the restore
        point, or one another trainer left elsewhere; `among`: only these server indices (as
        the coordinator gives them). Returns their URLs (none: nothing to do); raises
        WeightSyncError when one fails. A server that does not answer is its supervisor's.
        Called before rollouts, so that every sample comes from the weights the trainer holds.
        With the disk transport they reload `version`'s directory when it is the restore point."""
        behind = self._behind(version, among) if self.coordinator else None
        behind = sorted(bcast(behind))
        if not behind:
            return []
        if self.transport.writes_files and self.restore_point.version == version:
            # The disk transport's servers read the trainer's files: this version is there.
            lost = None
            if self.coordinator:
                states = self._restore(behind)
                lost = {self.servers.url(i): v for i, v in states.items() if v.startswith("lost")}
            lost = bcast(lost)
            if lost:
                raise WeightSyncError(f"catching up to version {version!r} failed: {lost}")
        else:
            self.sync(version, only=behind, catching_up=True)
        return [self.servers.url(i) for i in behind]

    def close(self) -> None:
        """Every rank: destroy the update groups kept between syncs (distributed), let go of the
        servers' connections and remove this sync's own version directory."""
        self.transport.close(self.servers)
        self.servers.close()
        if self._relaying is not None:
            self._relaying.shutdown(wait=False)
        if self._drop_own_dir is not None:
            self._drop_own_dir()


def _outcome(
    ctx: StageContext, error, nbytes: int, sums: list, files, relay: int | None = None, lent=0
):
    """What a stage sender (relay: None) or a relay (relay: its node) did in one sync."""
    return {
        "stage": ctx.stage, "rank": rank(), "relay": relay, "failed": ctx.failed,
        "touched": sorted(ctx.touched), "error": error, "bytes": nbytes, "buckets": ctx.buckets,
        "checksums": sums, "files": files, "lent": lent, "group": ctx.state.get("name"),
    }  # fmt: skip
