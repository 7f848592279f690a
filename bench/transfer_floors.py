"""The transfers alone, as the floors of bench_weight_sync.py's transports, each on the same
bytes in bucket-sized pieces: a plain memcpy (or a GPU's device-to-host copy), a bare gloo
broadcast between two processes, one plain TCP stream over loopback, a write into /dev/shm files
plus a read back, and on a GPU a device-to-device copy and CUDA IPC as the tensor transport uses
it. Imported by the bench (bench/ is on the path when it runs as a script)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from harness import median  # (bench/ is on the path)


class Memcpy:
    """A plain copy of the sync's bytes, timed whenever `sample` is called. From `device` (the
    trainer's) into CPU memory: a memcpy on CPU, a device-to-host copy into shared memory (where
    the buckets for a CPU server are) from a GPU."""

    def __init__(self, nbytes: int, device: str | torch.device = "cpu"):
        device = torch.device(device)
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        self.dst = torch.empty(nbytes, dtype=torch.uint8)
        self.what = "memcpy"
        if device.type == "cuda":
            self.what = "D2H copy into pageable memory"
            if shm_free() > 1.2 * nbytes:  # where the buckets are; else pageable memory
                self.dst.share_memory_()
                self.what = "D2H copy into shared memory"
        self.dst.fill_(0)  # fault the pages in: steady state, as the syncs' buffers
        self.gbps: list[float] = []

    def sample(self) -> None:
        t = time.perf_counter()
        self.dst.copy_(self.src)
        if self.src.is_cuda:
            torch.cuda.synchronize()
        self.gbps.append(self.src.numel() / 1e9 / (time.perf_counter() - t))

    def median(self) -> float:
        return median(self.gbps)  # the syncs' statistic too


def shm_free() -> int:
    """Free bytes in /dev/shm (a container may have little): CPU buckets shared with a server
    live there, and running out of it there is a SIGBUS, not an error."""
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return 0


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

    from megatron_gspo.comm import free_port

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


def gpu_copy_gbps(nbytes: int, pinned: bool, reps: int = 3) -> float:
    """The same bytes copied on the GPU (device to device) or into pinned host memory, median."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = (
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinned else torch.empty_like(src)
    )
    dst.copy_(src)  # warm up: the pages exist, the copy engine is awake
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / 1e9 / median(times)


def _ipc_receiver(conn, nbytes: int) -> None:
    """A GPU server's side of the tensor transport: open each payload's IPC handle (the device
    named by UUID, as SGLang does) and copy the bucket into its own GPU buffer."""
    import base64
    import io
    import pickle

    from torch.multiprocessing import reductions

    index = {str(torch.cuda.get_device_properties(i).uuid): i
             for i in range(torch.cuda.device_count())}  # fmt: skip

    def rebuild(*args):
        return reductions.rebuild_cuda_tensor(*args[:6], index[args[6]], *args[7:])

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            return rebuild if name == "rebuild_cuda_tensor" else super().find_class(module, name)

    weights = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        offset, payload = msg
        flat = Unpickler(io.BytesIO(base64.b64decode(payload))).load()["flattened_tensor"]
        weights[offset : offset + flat.numel()].copy_(flat)
        torch.cuda.synchronize()
        del flat
        conn.send(offset)


def cuda_ipc_gbps(nbytes: int, bucket: int, reps: int = 3) -> float:
    """The tensor transport on one GPU alone: each bucket-sized piece packed into one of two GPU
    buffers, sent as a CUDA IPC payload (weight_payload.serialize) to another process that copies
    it into its GPU buffer; the next piece is packed while the receiver copies. Median of `reps`
    passes over the bytes after one that opens the handles."""
    import torch.multiprocessing as mp

    from megatron_gspo.rollout import weight_payload as wp

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    bufs = [torch.empty(min(bucket, nbytes), dtype=torch.uint8, device="cuda") for _ in range(2)]
    ours, theirs = mp.get_context("spawn").Pipe()
    peer = mp.get_context("spawn").Process(target=_ipc_receiver, args=(theirs, nbytes))
    peer.start()
    assert ours.recv() == "ready"

    def one_pass() -> float:
        t, pending = time.perf_counter(), 0
        for i, offset in enumerate(range(0, nbytes, bucket)):
            n = min(bucket, nbytes - offset)
            if pending == 2:  # this buffer's last piece must be copied out first
                ours.recv()
                pending -= 1
            buf = bufs[i % 2][:n]
            buf.copy_(src[offset : offset + n])
            torch.cuda.synchronize()
            ours.send((offset, wp.serialize({"flattened_tensor": buf, "metadata": []})))
            pending += 1
        for _ in range(pending):
            ours.recv()
        return nbytes / 1e9 / (time.perf_counter() - t)

    try:
        one_pass()
        return median(one_pass() for _ in range(reps))
    finally:
        ours.send(None)
        peer.join(timeout=60)
