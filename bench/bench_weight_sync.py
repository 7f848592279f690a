"""Weight-sync bandwidth: a ~1.1 GB random Qwen3-MoE from a Megatron trainer (one process, TP1)
into one built-in rollout server, per transport, beside a plain memcpy of the same bytes (the
limit) and a naive sync (one /update_weights_from_tensor request per tensor), in one run. The
trainer holds the model as training does (megatron DDP, distributed optimizer: the parameters in
one buffer), so the tensor transport lends that buffer to the server instead of copying it.

A sync that packs buckets copies every byte at least twice (into a bucket, out of it into the
server's weights), so half of memcpy's bandwidth is its bound; lending the parameter buffer
leaves one copy (the server's). The goal is the tensor path at 0.35x memcpy or better and
every transport at least 10x the naive sync. Each transport syncs `--reps` times: the first sync
(which also allocates the shared buffers) is shown apart, the rest as the median. The server is
idle, the trainer's weights are perturbed once so that the final probe check means something.

The machine may be shared, so the memcpy is timed right before every sync (and the naive one) and
its median over the run is the reference; its spread and the load average are printed. CPU
seconds per sync (trainer process + server process, all threads) are printed beside the wall
time: they do not grow when other processes take the cores. Buckets are sync.bucket_mb's
default unless --bucket-mb says otherwise. The transfers alone are measured too, each on the
same bytes in bucket-sized pieces, as the floor of a transport: a bare gloo broadcast between two
processes over loopback (distributed), a plain TCP stream over loopback (what any TCP transport
can reach here), and a write into files in /dev/shm plus a read back (disk, which writes its
versions to the default directory, /dev/shm). A transport's own floor is timed right after each
of its syncs, so "x floor" compares the two under the same load; the naive sync runs three
times and its median is the "x naive" reference (it moves most from run to run).

    .venv/bin/python bench/bench_weight_sync.py [--reps 4] [--bucket-mb MB] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_gspo.model.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(vocab_size=32000, hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128,
                ffn=2048, moe_ffn=512, experts=32, topk=4, seed=0)  # fmt: skip


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_gspo.rollout.server", "--model", str(model),
             "--port", "0", "--threads", "2"],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 600
    while not (m := re.search(r" on (http://127\.0\.0\.1:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, m.group(1)


class Memcpy:
    """A plain copy of the sync's bytes, timed whenever `sample` is called."""

    def __init__(self, nbytes: int):
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.fill_(0)  # fault the pages in: steady state, as the syncs' buffers
        self.gbps: list[float] = []

    def sample(self) -> None:
        t = time.perf_counter()
        self.dst.copy_(self.src)
        self.gbps.append(self.src.numel() / 1e9 / (time.perf_counter() - t))

    def median(self) -> float:
        return statistics.median(self.gbps)  # the syncs' statistic too


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gloo_peer(rank: int, port: int, nbytes: int, bucket: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    buf = torch.ones(bucket, dtype=torch.uint8)
    dist.broadcast(buf, src=0)  # connect
    t = time.perf_counter()
    for _ in range(max(nbytes // bucket, 1)):
        dist.broadcast(buf, src=0)
    if rank == 0:
        out.put(max(nbytes // bucket, 1) * bucket / 1e9 / (time.perf_counter() - t))
    dist.destroy_process_group()


def gloo_gbps(nbytes: int, bucket: int) -> float:
    """A bare gloo broadcast of `nbytes` in `bucket`-byte pieces between two fresh processes."""
    import torch.multiprocessing as mp

    from megatron_gspo.model.parallel import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_gloo_peer, args=(r, port, nbytes, bucket, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    gbps = out.get(timeout=600)
    for p in procs:
        p.join()
    return gbps


def _tcp_peer(port: int, nbytes: int, bucket: int) -> None:
    import socket

    buf = bytearray(bucket)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < nbytes:
            got += s.recv_into(view[: min(bucket, nbytes - got)])
        s.sendall(b"k")


def tcp_gbps(nbytes: int, bucket: int) -> float:
    """The same bytes through one plain TCP stream over loopback to a fresh process: what any
    TCP transport (gloo's included) can reach on this machine."""
    import socket

    import torch.multiprocessing as mp

    src = torch.randint(0, 255, (bucket,), dtype=torch.uint8)
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = mp.get_context("spawn").Process(
            target=_tcp_peer, args=(server.getsockname()[1], nbytes, bucket)
        )
        peer.start()
        conn, _ = server.accept()
        with conn:
            t = time.perf_counter()
            for i in range(0, nbytes, bucket):
                conn.sendall(memoryview(src.numpy())[: min(bucket, nbytes - i)])
            conn.recv(1)
            gbps = nbytes / 1e9 / (time.perf_counter() - t)
        peer.join()
    return gbps


def tmpfs_gbps(nbytes: int, bucket: int) -> float:
    """The same bytes written into files in /dev/shm and read back, two threads each way (the
    files written before, as the disk transport's recycled versions are): the disk transport's
    two copies and nothing else."""
    from concurrent.futures import ThreadPoolExecutor

    sizes = [min(bucket, nbytes - i) for i in range(0, nbytes, bucket)]
    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        paths = [Path(d) / f"{i}" for i in range(len(sizes))]

        def write(i: int) -> None:
            with open(paths[i], "r+b" if paths[i].exists() else "wb", buffering=0) as f:
                f.write(memoryview(src.numpy())[: sizes[i]])

        def read(i: int) -> None:
            with open(paths[i], "rb", buffering=0) as f:
                f.readinto(memoryview(dst.numpy())[i * bucket : i * bucket + sizes[i]])

        with ThreadPoolExecutor(2) as ex:
            list(ex.map(write, range(len(sizes))))  # the pages exist, as in steady state
            t = time.perf_counter()
            list(ex.map(write, range(len(sizes))))
            list(ex.map(read, range(len(sizes))))
            return nbytes / 1e9 / (time.perf_counter() - t)


def naive_sync(chunks, url: str, version: str) -> None:
    """One request per tensor, as a first implementation would: clone, share, POST, wait."""
    from megatron_gspo.rollout import weight_payload as wp
    from megatron_gspo.weight_sync.gather import iter_stage
    from megatron_gspo.weight_sync.servers import Servers

    servers = Servers([url])
    servers.post(0, "/begin_weight_update", {"selector": "target"})
    for name, tensor in iter_stage(chunks):
        with wp.TensorSharing():
            body = wp.tensor_update_body([(name, tensor)], flush_cache=False)
        servers.post(0, "/update_weights_from_tensor", body)
    servers.post(0, "/update_weight_version", {"new_version": version})
    servers.post(0, "/end_weight_update", {})
    servers.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=None, help="default: sync.bucket_mb's")
    ap.add_argument("--model", default=None, help="reuse (or create) the random model here")
    ap.add_argument("--transports", default="tensor,distributed,disk")
    a = ap.parse_args()
    if a.bucket_mb is None:
        from megatron_gspo.weight_sync.config import SyncConfig

        a.bucket_mb = SyncConfig().bucket_mb  # what a run gets unless it says otherwise
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench-wsync-"))
    model = Path(a.model) if a.model else work / "model"
    if not model.exists():
        t = time.perf_counter()
        make_tiny_model(SPEC, model)
        print(f"made the model in {time.perf_counter() - t:.0f} s", flush=True)
    server, url = start_server(model, work / "server.log")
    try:
        run(a, model, url, server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)


@torch.no_grad()
def run(a, model: Path, url: str, server_pid: int) -> None:
    from megatron_gspo.model.parallel import ParallelDims, init_distributed
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.train.actor import Actor, OptimConfig
    from megatron_gspo.weight_sync import gather
    from megatron_gspo.weight_sync.config import SyncConfig
    from megatron_gspo.weight_sync.sync import WeightSync

    init_distributed(ParallelDims())
    # The trainer's model as training holds it: megatron DDP with the distributed optimizer
    # (the default), whose parameters live in one buffer the tensor transport can lend.
    with torch.enable_grad():  # DDP hooks need autograd
        actor = Actor(load_policy(model, ParallelDims()), OptimConfig(lr=1e-6))
    chunks = gather.unwrap(actor.chunks)
    for name, p in chunks[0].named_parameters():
        if "layernorm" in name or "final_layernorm" in name:
            p.mul_(1.5)  # the trainer now differs from the server's checkpoint
    nbytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    nbytes -= (chunks[0].padded_vocab_size - SPEC.vocab_size) * SPEC.hidden * 4 * 2  # padding
    print(f"model: {nbytes / 1e9:.2f} GB fp32, {os.cpu_count()} CPUs, load {load()}", flush=True)
    memcpy = Memcpy(nbytes)
    memcpy.sample()

    def timed(fn, *args):
        """fn(*args), its wall seconds and trainer + server CPU seconds; after a memcpy sample."""
        memcpy.sample()
        c = time.process_time() + cpu_seconds(server_pid)
        t = time.perf_counter()
        out = fn(*args)
        wall = time.perf_counter() - t
        return out, wall, time.process_time() + cpu_seconds(server_pid) - c

    piece = int(a.bucket_mb * (1 << 20))

    def memcpy_gbps() -> float:
        memcpy.sample()
        return memcpy.gbps[-1]

    own_floor = {  # a transport's transfer alone, timed after each of its syncs
        "tensor": memcpy_gbps,
        "distributed": lambda: gloo_gbps(nbytes, piece),
        "disk": lambda: tmpfs_gbps(nbytes, piece),
    }
    rows: dict[str, tuple[float, float, float, float]] = {}
    version = 0
    for name in a.transports.split(","):
        cfg = SyncConfig(transport=name, bucket_mb=a.bucket_mb)
        ws = WeightSync(chunks, [url], cfg, base_model=model)
        times, cpus, floor = [], [], []
        for _ in range(a.reps):
            version += 1
            report, wall, cpu = timed(ws.sync, version)
            floor.append(own_floor[name]())
            times.append(wall)
            cpus.append(cpu)
            assert report.bytes == nbytes, (report.bytes, nbytes)
        ws.verify(str(version))  # the server's probe log-probs are the trainer's
        rest = slice(1, None) if a.reps > 1 else slice(None)
        rows[name] = (times[0], statistics.median(times[rest]), statistics.median(cpus[rest]),
                      statistics.median(floor[rest]))  # fmt: skip
        print(f"{name:12s} first {times[0]:6.2f} s  then {rows[name][1]:6.2f} s  "
              f"({rows[name][2]:.2f} CPU s)  load {load()}", flush=True)  # fmt: skip
        ws.close()
    naives = []
    for _ in range(3):
        version += 1
        naives.append(timed(naive_sync, chunks, url, str(version))[1:])
    naive, naive_cpu = (statistics.median(x) for x in zip(*naives))
    print(f"{'naive':12s} {naive:6.2f} s ({naive_cpu:.2f} CPU s, one request per tensor; "
          f"range {min(t for t, _ in naives):.2f}-{max(t for t, _ in naives):.2f} s)")  # fmt: skip
    floors = [(gloo_gbps(nbytes, piece), tcp_gbps(nbytes, piece), tmpfs_gbps(nbytes, piece))
              for _ in range(3)]  # fmt: skip
    gloo, tcp, tmpfs = (statistics.median(x) for x in zip(*floors))
    memcpy.sample()
    ref = memcpy.median()
    print()
    print(f"load average at the end: {load()}")
    print(
        f"memcpy of the same bytes: {ref:.2f} GB/s median of {len(memcpy.gbps)} "
        f"(range {min(memcpy.gbps):.2f}-{max(memcpy.gbps):.2f}; a sync's bound is half of it)"
    )
    naive_gbps = nbytes / 1e9 / naive
    print(f"naive sync: {naive_gbps:.3f} GB/s (median of 3); buckets of {a.bucket_mb:g} MB")
    print("the transfers alone, the same bytes in bucket-sized pieces, median of 3 after the "
          "syncs (at most this x naive):")  # fmt: skip
    print(
        f"  bare gloo broadcast        {gloo:5.2f} GB/s  {gloo / naive_gbps:5.1f}x  (distributed)"
    )
    print(f"  plain TCP stream, loopback {tcp:5.2f} GB/s  {tcp / naive_gbps:5.1f}x  (any TCP)")
    print(f"  /dev/shm write + read back {tmpfs:5.2f} GB/s  {tmpfs / naive_gbps:5.1f}x  (disk)")
    print("x floor: of the transport's own transfer alone (tensor: memcpy; distributed: bare "
          "gloo; disk: /dev/shm write + read), timed after each sync")  # fmt: skip
    print("transport     GB/s   x memcpy   x naive   x floor   CPU s/sync   "
          "(steady state; first in brackets)")  # fmt: skip
    for name, (first, steady, cpu, floor) in rows.items():
        gbps = nbytes / 1e9 / steady
        print(
            f"{name:12s} {gbps:5.2f}   {gbps / ref:6.3f}    {naive / steady:6.1f}    "
            f"{gbps / floor:6.2f}   {cpu:8.2f}     [{nbytes / 1e9 / first:.2f} GB/s]"
        )
    print(f"{'naive':12s} {nbytes / 1e9 / naive:5.2f}   {nbytes / 1e9 / naive / ref:6.3f}    "
          f"{1.0:6.1f}              {naive_cpu:8.2f}")  # fmt: skip
    print()
    bare = {"tensor": ref, "distributed": gloo, "disk": tmpfs}  # each one's transfer alone
    for name, (_, steady, _, _) in rows.items():
        goals = [] if name != "tensor" else [("0.35x memcpy", nbytes / 1e9 / steady / ref, 0.35)]
        goals.append(("10x naive", naive / steady, 10.0))
        verdict = "; ".join(
            f"{what}: {'met' if got >= want else 'NOT met'} ({got:.2f})"
            for what, got, want in goals
        )
        print(f"goal {name:12s} {verdict}; its bare transfer alone is "
              f"{bare[name] / naive_gbps:.1f}x naive")  # fmt: skip


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
