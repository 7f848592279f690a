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

On a GPU machine, `--device cuda` puts the trainer on the GPU (bf16 with `--dtype bfloat16`,
`--model-gb 2` for a 2 GB model: the same shapes with more layers). The built-in server runs on
CPU and says so, so both transports stage the buckets in CPU memory (shared memory, gloo): the
reference is then a device-to-host copy of the same bytes into shared memory, the naive sync is
skipped (CUDA tensors cannot reach a CPU server by name) and the probe tolerance is bf16's. The
GPU's own transfers are measured alone as the floors: a pinned device-to-host copy, a
device-to-device copy, and CUDA IPC as the tensor transport uses it with a server on the GPU (a
bucket packed on the GPU, its IPC handle sent as the payload, the receiving process copying it
into its own GPU buffer). NCCL cannot be measured on one GPU (a communicator takes one rank per
GPU). `--json FILE` writes the numbers; `--quick` skips the naive sync and the CPU floors;
`--tiny` makes a model of a few MB (a check that the bench starts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from harness import Variant, cpu_seconds, measure, median
from transfer_floors import (  # (bench/ is on the path: run as a script)
    Memcpy,
    cuda_ipc_gbps,
    gloo_gbps,
    gpu_copy_gbps,
    shm_free,
    tcp_gbps,
    tmpfs_gbps,
)

from megatron_gspo.hf.config import load_hf_config, model_spec
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(vocab_size=32000, hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128,
                ffn=2048, moe_ffn=512, experts=32, topk=4, seed=0)  # fmt: skip
TINY = TinySpec(vocab_size=1024, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                ffn=256, moe_ffn=64, experts=8, topk=2, seed=0)  # fmt: skip
# bf16: the probe's difference between the trainer's kernels (GPU) and the server's (CPU) is
# recorded, not checked (it is rounding, of no fixed size): a tolerance nothing reaches
BF16_TOLERANCE = 1e9


def spec_for(a) -> TinySpec:
    """SPEC (or TINY) in `--dtype`, with as many layers as make `--model-gb`."""
    spec = replace(TINY if a.tiny else SPEC, dtype=a.dtype)
    if a.model_gb is None:
        return spec
    h, esize = spec.hidden, torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    layer = 2 * h * q + 2 * h * kv + h * spec.experts + 3 * spec.experts * h * spec.moe_ffn
    fixed = 2 * spec.vocab_size * h
    return replace(spec, layers=max(1, round((a.model_gb * 1e9 / esize - fixed) / layer)))


# The server loads shared-memory payloads only from a client holding its API key (its docs);
# the trainer and the server it starts share one, as a run's do.
API_KEY = secrets.token_hex(16)


def start_server(model: Path, log: Path, threads: int = 2) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MEGATRON_GSPO_API_KEY": API_KEY}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_gspo.server", "--model", str(model),
             "--port", "0", "--threads", str(threads)],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 600
    while not (m := re.search(r" on (http://127\.0\.0\.1:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, m.group(1)


def naive_sync(chunks, url: str, version: str) -> None:
    """One request per tensor, as a first implementation would: clone, share, POST, wait."""
    from megatron_gspo.rollout import weight_payload as wp
    from megatron_gspo.weight_sync.config import ServerRef
    from megatron_gspo.weight_sync.gather import iter_stage
    from megatron_gspo.weight_sync.servers import Servers

    servers = Servers([ServerRef(url, api_key=API_KEY)])
    servers.post(0, "/begin_weight_update", wp.begin_body())
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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the trainer's")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model-gb", type=float, default=None, help="default: SPEC (~1.1 GB fp32)")
    ap.add_argument("--tiny", action="store_true", help="a model of a few MB (a start-up check)")
    ap.add_argument("--quick", action="store_true", help="skip the naive sync and CPU floors")
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    a = ap.parse_args()
    if a.bucket_mb is None:
        from megatron_gspo.weight_sync.config import SyncConfig

        a.bucket_mb = SyncConfig().bucket_mb  # what a run gets unless it says otherwise
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine's trainer stays on CPU too
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    # A SIGTERM (a time budget running out) ends the run through the `finally` below, which
    # stops the server (in a session of its own, it would outlive the group's kill).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench-wsync-"))
    model = Path(a.model) if a.model else work / "model"
    if not model.exists():
        t = time.perf_counter()
        make_tiny_model(spec_for(a), model)
        print(f"made the model in {time.perf_counter() - t:.0f} s", flush=True)
    a.spec = model_spec(load_hf_config(model))  # the model's own shapes (it may be reused)
    a.dtype_name = str(a.spec.dtype).removeprefix("torch.")
    server, url = start_server(model, work / "server.log", a.server_threads)
    try:
        out = run(a, model, url, server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)  # the model made here and the server's log
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def trainer(model: Path, spec):
    """The trainer's model chunks as training holds them: megatron DDP with the distributed
    optimizer (the default), whose parameters live in one buffer the tensor transport can lend;
    its layer norms perturbed, so it differs from the server's checkpoint. Returns the chunks
    and the bytes a sync moves."""
    from megatron_gspo.model.parallel import ParallelDims, init_distributed
    from megatron_gspo.model.policy import load_policy
    from megatron_gspo.train.actor import Actor, OptimConfig
    from megatron_gspo.weight_sync import gather

    init_distributed(ParallelDims())
    with torch.enable_grad():  # DDP hooks need autograd
        actor = Actor(load_policy(model, ParallelDims()), OptimConfig(lr=1e-6))
    chunks = gather.unwrap(actor.chunks)
    for name, p in chunks[0].named_parameters():
        if "layernorm" in name or "final_layernorm" in name:
            p.mul_(1.5)  # the trainer now differs from the server's checkpoint
    esize = next(chunks[0].parameters()).element_size()
    nbytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    padding = (chunks[0].padded_vocab_size - spec.vocab_size) * spec.hidden_size * esize * 2
    nbytes -= padding  # the embedding's and output layer's padded rows are not sent
    return chunks, nbytes


@torch.no_grad()
def run(a, model: Path, url: str, server_pid: int) -> dict:
    chunks, nbytes = trainer(model, a.spec)
    device = next(chunks[0].parameters()).device
    on_gpu = device.type == "cuda"
    print(f"model: {nbytes / 1e9:.2f} GB {a.dtype_name} on {device}, {os.cpu_count()} CPUs, "
          f"load {load()}", flush=True)  # fmt: skip
    memcpy = Memcpy(nbytes, device)
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
    if a.quick or on_gpu:  # the buckets' staging copy (D2H from a GPU) is every one's floor
        own_floor = dict.fromkeys(own_floor, memcpy_gbps)
    rows, errors = {}, {}
    for name in a.transports.split(","):
        try:
            need = 3 * int(a.bucket_mb * (1 << 20))  # two buckets in flight, and slack
            if on_gpu and name == "tensor" and shm_free() < need:
                raise RuntimeError(f"/dev/shm has {shm_free() / 1e9:.2f} GB free, the tensor "
                                   f"transport's CPU buckets need ~{need / 1e9:.2f} GB")  # fmt: skip
            rows[name] = sync_transport(a, name, chunks, model, url, nbytes, timed, own_floor[name])
        except Exception as e:  # on a GPU machine (one shot), the other transports still run
            if not on_gpu:
                raise
            errors[name] = f"{type(e).__name__}: {e}"[:1000]
            print(f"{name:12s} FAILED: {errors[name]}", flush=True)
    naive = naive_cpu = None
    if not (a.quick or on_gpu):  # CUDA tensors cannot reach a CPU server one by one
        naives = [timed(naive_sync, chunks, url, f"naive-{i}")[1:] for i in range(3)]
        naive, naive_cpu = (median(x) for x in zip(*naives))
        print(f"{'naive':12s} {naive:6.2f} s ({naive_cpu:.2f} CPU s, one request per tensor; "
              f"range {min(t for t, _ in naives):.2f}-{max(t for t, _ in naives):.2f} s)")  # fmt: skip
    memcpy.sample()
    out = results(a, nbytes, device, memcpy, rows, naive, transfer_floors(a, nbytes, on_gpu))
    out["errors"] = errors
    report(a, out, naive, naive_cpu)
    return out


def sync_transport(a, name, chunks, model, url, nbytes, timed, own_floor) -> dict:
    """`a.reps` syncs through one transport, each followed by its own floor; then the probe."""
    from megatron_gspo.weight_sync.config import ServerRef, SyncConfig
    from megatron_gspo.weight_sync.sync import WeightSync

    tolerance = None if a.dtype_name == "float32" else BF16_TOLERANCE  # None: fp32's, 1e-4
    cfg = SyncConfig(method=name, bucket_mb=a.bucket_mb, verify_tolerance=tolerance)
    ws = WeightSync(chunks, [ServerRef(url, api_key=API_KEY)], cfg, base_model=model)
    times, cpus, floor = [], [], []
    for i in range(a.reps):
        report, wall, cpu = timed(ws.sync, f"{name}-{i}")
        floor.append(own_floor())
        times.append(wall)
        cpus.append(cpu)
        assert report.bytes == nbytes, (report.bytes, nbytes)
    # the server's probe log-probs are the trainer's (raises past the tolerance)
    probe = ws.verify(f"{name}-{a.reps - 1}")[0].max_diff
    ws.close()
    rest = slice(1, None) if a.reps > 1 else slice(None)
    row = {"first": times[0], "steady": median(times[rest]),
           "cpu_s": median(cpus[rest]), "floor": median(floor[rest]),
           "probe_max_diff": probe}  # fmt: skip
    print(f"{name:12s} first {times[0]:6.2f} s  then {row['steady']:6.2f} s  "
          f"({row['cpu_s']:.2f} CPU s)  load {load()}", flush=True)  # fmt: skip
    return row


def transfer_floors(a, nbytes: int, on_gpu: bool) -> dict:
    """The transfers alone, the same bytes in bucket-sized pieces (median of 3): on a GPU its
    copies and CUDA IPC; on CPU gloo, TCP and /dev/shm (unless --quick)."""
    piece = int(a.bucket_mb * (1 << 20))
    if on_gpu:
        return {"d2h_pinned": gpu_copy_gbps(nbytes, pinned=True),
                "d2d": gpu_copy_gbps(nbytes, pinned=False),
                "cuda_ipc": cuda_ipc_gbps(nbytes, piece), "nccl": None}  # fmt: skip
    if a.quick:
        return {}
    kinds = {"gloo": gloo_gbps, "tcp": tcp_gbps, "tmpfs": tmpfs_gbps}
    floors = [Variant(k, lambda f=f: {"gbps": f(nbytes, piece)}) for k, f in kinds.items()]
    res = measure(floors, 3, name="transfer floors")  # side by side, the order rotating
    return {k: res.median(k, "gbps") for k in kinds}


def results(a, nbytes, device, memcpy, rows, naive, floors) -> dict:
    ref, gb = memcpy.median(), nbytes / 1e9
    out = {
        "device": str(device), "dtype": a.dtype_name, "model_bytes": nbytes,
        "layers": a.spec.num_layers, "bucket_mb": a.bucket_mb, "reps": a.reps,
        "shm_free_gb": shm_free() / 1e9,
        "reference": {"what": memcpy.what, "gbps": ref,
                      "range": [min(memcpy.gbps), max(memcpy.gbps)]},
        "transports": {
            name: {"gbps": gb / r["steady"], "first_gbps": gb / r["first"],
                   "x_reference": gb / r["steady"] / ref, "cpu_s": r["cpu_s"],
                   "x_floor": gb / r["steady"] / r["floor"], "probe_max_diff": r["probe_max_diff"]}
            for name, r in rows.items()
        },
        "naive_gbps": None if naive is None else gb / naive,
        "floors": floors,
    }  # fmt: skip
    if device.type == "cuda":
        out["notes"] = {"nccl": "not measurable on one GPU: NCCL takes one rank per GPU",
                        "built-in server": "on CPU: the tensor transport stages buckets in shared "
                        "memory, the distributed one broadcasts over gloo"}  # fmt: skip
    return out


def report(a, out: dict, naive: float | None, naive_cpu: float | None) -> None:
    nbytes, ref, floors = out["model_bytes"], out["reference"]["gbps"], out["floors"]
    gbps = out["reference"]["range"]
    print()
    print(f"load average at the end: {load()}")
    print(
        f"{out['reference']['what']} of the same bytes: {ref:.2f} GB/s median "
        f"(range {gbps[0]:.2f}-{gbps[1]:.2f}; a sync's bound is half of it)"
    )
    naive_gbps = None if naive is None else nbytes / 1e9 / naive
    if naive_gbps is not None:
        print(f"naive sync: {naive_gbps:.3f} GB/s (median of 3); buckets of {a.bucket_mb:g} MB")
    if "gloo" in floors:
        gloo, tcp, tmpfs = floors["gloo"], floors["tcp"], floors["tmpfs"]
        print("the transfers alone, the same bytes in bucket-sized pieces, median of 3 after the "
              "syncs (at most this x naive):")  # fmt: skip
        print(
            f"  bare gloo broadcast        {gloo:5.2f} GB/s  {gloo / naive_gbps:5.1f}x  (distributed)"
        )
        print(f"  plain TCP stream, loopback {tcp:5.2f} GB/s  {tcp / naive_gbps:5.1f}x  (any TCP)")
        print(f"  /dev/shm write + read back {tmpfs:5.2f} GB/s  {tmpfs / naive_gbps:5.1f}x  (disk)")
        print("x floor: of the transport's own transfer alone (tensor: memcpy; distributed: bare "
              "gloo; disk: /dev/shm write + read), timed after each sync")  # fmt: skip
    for what, v in floors.items():
        if "gloo" not in floors:
            print(f"  {what:12s} {'n/a' if v is None else f'{v:7.2f} GB/s'}")
    print("transport     GB/s   x memcpy   x naive   x floor   CPU s/sync   "
          "(steady state; first in brackets)")  # fmt: skip
    for name, r in out["transports"].items():
        x_naive = "-" if naive_gbps is None else f"{r['gbps'] / naive_gbps:6.1f}"
        print(
            f"{name:12s} {r['gbps']:5.2f}   {r['x_reference']:6.3f}    {x_naive:>6s}    "
            f"{r['x_floor']:6.2f}   {r['cpu_s']:8.2f}     [{r['first_gbps']:.2f} GB/s]"
        )
    if naive_gbps is None:
        return
    print(f"{'naive':12s} {naive_gbps:5.2f}   {naive_gbps / ref:6.3f}    "
          f"{1.0:6.1f}              {naive_cpu:8.2f}")  # fmt: skip
    print()
    bare = {"tensor": ref, "distributed": floors.get("gloo"), "disk": floors.get("tmpfs")}
    for name, r in out["transports"].items():
        goals = [] if name != "tensor" else [("0.35x memcpy", r["x_reference"], 0.35)]
        goals.append(("10x naive", r["gbps"] / naive_gbps, 10.0))
        verdict = "; ".join(
            f"{what}: {'met' if got >= want else 'NOT met'} ({got:.2f})"
            for what, got, want in goals
        )
        alone = (
            ""
            if bare[name] is None
            else f"; its bare transfer alone is {bare[name] / naive_gbps:.1f}x naive"
        )
        print(f"goal {name:12s} {verdict}{alone}")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
