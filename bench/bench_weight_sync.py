"""Weight-sync bandwidth: a ~1.1 GB random Qwen3-MoE from a Megatron trainer (one process, TP1)
into one built-in rollout server, per transport, beside a plain memcpy of the same bytes (the
limit) and a naive sync (one /update_weights_from_tensor request per tensor), in one run.

A sync copies every byte at least twice (into a bucket, out of it into the server's weights), so
half of memcpy's bandwidth is the bound; the goal is the tensor path at 0.35x memcpy or better and
every transport at least 10x the naive sync. Each transport syncs `--reps` times: the first sync
(which also allocates the shared buffers) is shown apart, the rest as the median. The server is
idle, the trainer's weights are perturbed once so that the final probe check means something.

    .venv/bin/python bench/bench_weight_sync.py [--reps 4] [--bucket-mb 64] [--model DIR]
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


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.fill_(0)  # fault the pages in: steady state, as the syncs' buffers
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / 1e9 / statistics.median(times)  # the syncs' statistic too


def naive_sync(chunks, url: str, version: str) -> float:
    """One request per tensor, as a first implementation would: clone, share, POST, wait."""
    from megatron_gspo.rollout import weight_payload as wp
    from megatron_gspo.weight_sync.gather import iter_stage
    from megatron_gspo.weight_sync.servers import Servers

    servers = Servers([url])
    t = time.perf_counter()
    servers.post(0, "/begin_weight_update", {"selector": "target"})
    for name, tensor in iter_stage(chunks):
        with wp.TensorSharing():
            body = wp.tensor_update_body([(name, tensor)], flush_cache=False)
        servers.post(0, "/update_weights_from_tensor", body)
    servers.post(0, "/update_weight_version", {"new_version": version})
    servers.post(0, "/end_weight_update", {})
    dt = time.perf_counter() - t
    servers.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--model", default=None, help="reuse (or create) the random model here")
    ap.add_argument("--transports", default="tensor,distributed,disk")
    a = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench-wsync-"))
    model = Path(a.model) if a.model else work / "model"
    if not model.exists():
        t = time.perf_counter()
        make_tiny_model(SPEC, model)
        print(f"made the model in {time.perf_counter() - t:.0f} s", flush=True)
    server, url = start_server(model, work / "server.log")
    try:
        run(a, model, url, work)
    finally:
        server.terminate()
        server.wait(timeout=60)


@torch.no_grad()
def run(a, model: Path, url: str, work: Path) -> None:
    from megatron_gspo.model.parallel import ParallelDims, init_distributed
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.weight_sync.config import SyncConfig
    from megatron_gspo.weight_sync.sync import WeightSync

    init_distributed(ParallelDims())
    chunks = load_policy(model, ParallelDims())
    for name, p in chunks[0].named_parameters():
        if "layernorm" in name or "final_layernorm" in name:
            p.mul_(1.5)  # the trainer now differs from the server's checkpoint
    nbytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    nbytes -= (chunks[0].padded_vocab_size - SPEC.vocab_size) * SPEC.hidden * 4 * 2  # padding
    print(f"model: {nbytes / 1e9:.2f} GB fp32, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    rows: dict[str, tuple[float, float]] = {}
    memcpy = memcpy_gbps(nbytes, max(a.reps, 3))
    version = 0
    for name in a.transports.split(","):
        cfg = SyncConfig(transport=name, bucket_mb=a.bucket_mb, dir=str(work / "sync"))
        ws = WeightSync(chunks, [url], cfg, base_model=model)
        times = []
        for _ in range(a.reps):
            version += 1
            report = ws.sync(version)
            times.append(report.seconds)
            assert report.bytes == nbytes, (report.bytes, nbytes)
        ws.verify(str(version))  # the server's probe log-probs are the trainer's
        rows[name] = (times[0], statistics.median(times[1:] or times))
        print(f"{name:12s} first {times[0]:6.2f} s  then {rows[name][1]:6.2f} s", flush=True)
        ws.close()
    version += 1
    naive = naive_sync(chunks, url, str(version))
    print(f"{'naive':12s} {naive:6.2f} s (one request per tensor)", flush=True)
    print()
    print(f"memcpy of the same bytes: {memcpy:.2f} GB/s (a sync's bound is half of it)")
    print(f"naive sync: {nbytes / 1e9 / naive:.3f} GB/s")
    print("transport     GB/s   x memcpy   x naive   (steady state; first sync in brackets)")
    for name, (first, steady) in rows.items():
        gbps = nbytes / 1e9 / steady
        print(
            f"{name:12s} {gbps:5.2f}   {gbps / memcpy:6.3f}    {naive / steady:6.1f}   "
            f"[{nbytes / 1e9 / first:.2f} GB/s]"
        )


if __name__ == "__main__":
    main()
