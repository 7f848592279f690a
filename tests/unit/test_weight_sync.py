"""Weight-sync pieces on one CPU process: buckets (layout, checksum, shared-memory payloads),
safetensors shards, version directories, config checks, probe comparison, server errors."""

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.comm import free_port
from megatron_gspo.errors import UserError
from megatron_gspo.rollout import weight_payload as wp
from megatron_gspo.server import safe_unpickle
from megatron_gspo.weight_sync import verify
from megatron_gspo.weight_sync.bucket import (
    Bucket,
    BufferPool,
    checksum,
    checksum_parts,
    pack,
    release,
    unflatten,
)
from megatron_gspo.weight_sync.config import ServerRef, SyncConfig
from megatron_gspo.weight_sync.disk import (
    RestorePoint,
    ShardWriter,
    VersionDirs,
    verify_shard,
    write_shard,
)
from megatron_gspo.weight_sync.servers import ServerError, Servers
from megatron_gspo.weight_sync.transports import TensorTransport
from tests.helpers import authorization_recorder, serving

MINE = frozenset({os.getpid()})  # shared memory this process makes (begin_weight_update's senders)

pytestmark = pytest.mark.unit


def plain_pool(capacity: int, size: int = 2) -> BufferPool:
    return BufferPool(capacity, size, lambda n: torch.empty(n, dtype=torch.uint8))


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(8, 4, generator=g)),  # 128 B
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 B: next fp32 misaligned
        ("c", torch.randn(5, generator=g)),  # 20 B
        ("big", torch.randn(100, generator=g)),  # 400 B > capacity
        ("d", torch.arange(6)),  # int64
        ("e", torch.randn(4, 4, generator=g).t()),  # non-contiguous view
    ]


def drain(named, pool):
    out = []
    for b in pack(named, pool):
        b.sum()
        out.append((b, [(n, t.clone()) for n, t in b.named()], b.flat.clone()))
        release(b, pool)
    return out


def test_pack_round_trips_and_respects_capacity_and_alignment():
    named = tensors()
    buckets = drain(named, plain_pool(256))
    got = [item for _, items, _ in buckets for item in items]
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, named))
    for b, _, flat in buckets:
        offsets = [(m.start_idx, m.end_idx) for m in b.metadata]
        assert offsets[0][0] == 0 and all(x[1] == y[0] for x, y in zip(offsets, offsets[1:]))
        assert all(m.numel == m.end_idx - m.start_idx for m in b.metadata)  # bytes, as SGLang
        assert b.nbytes <= 256 or [m.name for m in b.metadata] == ["big"]
        assert all(m.start_idx % m.dtype.itemsize == 0 for m in b.metadata)
        assert b.checksum == checksum(flat)  # computed before the buffer went back
    names = [[m.name for m in b.metadata] for b, _, _ in buckets]
    assert ["big"] in names  # oversized: a bucket of its own
    assert any(n[-1] == "b" for n in names)  # c would start misaligned after b


def test_pool_reuses_buffers():
    allocs = []

    def alloc(n):
        allocs.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(64, 2, alloc)
    named = [(f"t{i}", torch.full((16,), float(i))) for i in range(10)]  # one per bucket
    out = drain(named, pool)
    assert len(out) == 10 and allocs == [64]  # each bucket came back before the next
    assert all(torch.equal(items[0][1], t) for (_, items, _), (_, t) in zip(out, named))


def test_a_failed_allocation_takes_no_place_in_the_pool():
    calls = []

    def alloc(n):
        calls.append(n)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(16, 1, alloc)
    with pytest.raises(torch.OutOfMemoryError):
        pool.take()
    assert pool.take(timeout_s=1).numel() == 16  # a new buffer, not a wait for one never made
    assert len(calls) == 2


def test_checksum_sees_every_byte_and_the_length():
    x = torch.randint(0, 256, (1003,), dtype=torch.uint8)
    c = checksum(x)
    assert c == checksum(x.clone())
    for i in (0, 500, 1000, 1002):  # body and the unaligned tail
        y = x.clone()
        y[i] ^= 1
        assert checksum(y) != c
    assert checksum(x[:1000]) != checksum(torch.cat([x[:1000], torch.zeros(8, dtype=torch.uint8)]))
    assert checksum(x[1:]) == checksum(x[1:].clone())  # a misaligned view


def test_checksum_of_a_large_bucket_sees_every_page_and_the_length():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    c = checksum(x)
    assert c == checksum(x.clone()) and c != checksum(x, every_byte=True)
    for page in (0, 17, 255):  # a zeroed or stale (other bytes) page
        for fill in (torch.zeros(4096, dtype=torch.uint8), torch.roll(x[:4096], 1)):
            y = x.clone()
            y[page * 4096 : (page + 1) * 4096] = fill
            assert checksum(y) != c
    assert checksum(x[:-8]) != c and checksum(x[:-4096]) != c  # truncated
    y = x.clone()
    y[-20] ^= 1  # the words after the last whole page all count
    assert checksum(x[:-3]) != checksum(y[:-3])


def test_tensor_payload_decodes_as_flattened_bucket_repeatedly():
    transport = TensorTransport()
    pool = BufferPool(512, 1, lambda n: transport.alloc(n, torch.device("cpu")))
    named = tensors()
    seen = []
    for b in pack(named, pool):
        assert b.buffer.is_shared()
        for _ in range(2):  # one payload per receiver
            with wp.TensorSharing():
                payload = wp.serialize(b.payload())
            got = safe_unpickle.decode_named_tensors(payload, "flattened_bucket", MINE)
            flat = got[0][1].untyped_storage()
            assert len(got) == len(b.metadata) and flat.nbytes() >= b.nbytes
        seen += [(n, t.clone()) for n, t in got]
        release(b, pool)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(seen, named))


def test_shared_parameters_are_lent_not_copied():
    """share_parameters moves a storage that several parameters view (megatron's DDP buffer)
    into shared memory in place: the parameters keep their values, the optimizer keeps working
    on them, and pack sends views of them (borrowed buckets, no pool buffer). A parameter that
    owns its storage stays where it was and is copied, as is a non-contiguous tensor. Every tensor
    decodes on the receiving side to the trainer's values."""
    from megatron_gspo.weight_sync.gather import share_parameters

    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    m.own = torch.nn.Linear(4, 8)  # parameters that own their storage
    buffer = torch.randn(400, generator=g)  # parameters that view one storage, as in DDP
    m.p = torch.nn.Parameter(buffer[:100].view(10, 10))
    m.q = torch.nn.Parameter(buffer[150:250])
    m.r = torch.nn.Parameter(buffer[300:350])
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    own_ptr = m.own.weight.data_ptr()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    borrow = share_parameters([m])
    assert borrow is not None and m.p.is_shared() and m.q.is_shared()
    assert not m.own.weight.is_shared() and m.own.weight.data_ptr() == own_ptr
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())

    named = [(n, p.detach()) for n, p in m.named_parameters()]
    named.insert(1, ("copied", torch.randn(4, 4, generator=g).t()))  # not contiguous
    expected = {n: t.clone() for n, t in named}
    taken = []
    cpu = torch.device("cpu")
    pool = BufferPool(256, 1, lambda n: taken.append(n) or TensorTransport().alloc(n, cpu))
    seen, lent = {}, []
    for b in pack(named, pool, borrow=borrow):
        assert b.nbytes == sum(m.numel for m in b.metadata)
        if b.borrowed:
            lent += [m.name for m in b.metadata]
            assert b.flat.untyped_storage().data_ptr() == m.p.untyped_storage().data_ptr()
        with wp.TensorSharing():
            payload = wp.serialize(b.payload())
        got = safe_unpickle.decode_named_tensors(payload, "flattened_bucket", MINE)
        seen.update((n, t.clone()) for n, t in got)
        b.sum()
        release(b, pool)
    assert seen.keys() == expected.keys()
    assert all(torch.equal(seen[n], expected[n]) for n in expected)
    assert sorted(lent) == ["p", "q", "r"] and taken == [256]  # one pool buffer for the rest
    (m.own(torch.randn(3, 4, generator=g)).sum() + m.p.sum() + (m.q * m.q).sum()).backward()
    opt.step()  # the optimizer still drives the moved parameters
    assert not torch.equal(m.q, before["q"]) and m.q.is_shared()
    assert torch.equal(buffer[150:250], m.q)  # the original tensor sees the same memory


def test_shard_is_safetensors_with_checksum(tmp_path):
    named = [tensors()[0], tensors()[5], tensors()[4]]  # 128 + 64 + 48 B, aligned
    path = tmp_path / "s.safetensors"
    (bucket,) = list(pack(named, plain_pool(1024)))
    write_shard(path, bucket)
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[n], t) for n, t in named)
    verify_shard(path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        verify_shard(path)


def buffer_module() -> tuple[torch.nn.Module, torch.Tensor]:
    """Parameters that view one storage with gaps between them (megatron DDP's buffer), and
    one that owns its storage."""
    g = torch.Generator().manual_seed(1)
    m = torch.nn.Module()
    m.own = torch.nn.Linear(4, 8)
    buffer = torch.randn(1000, generator=g)
    m.p = torch.nn.Parameter(buffer[:100].view(10, 10))
    m.q = torch.nn.Parameter(buffer[164:364])
    m.r = torch.nn.Parameter(buffer[400:456].view(8, 7))
    return m, buffer


def test_shards_of_lent_parameters_are_written_straight_from_them(tmp_path):
    """The disk transport's writer takes spans of the parameter buffer (borrowed buckets, no
    copy, gaps skipped) and packed buckets alike: every shard is safetensors whose tensors are
    the trainer's and whose checksum covers every byte; buckets are numbered in the order they
    are sealed, so no two shards share a name."""
    from megatron_gspo.weight_sync.gather import buffer_parameters

    m, buffer = buffer_module()
    borrow = buffer_parameters([m])
    assert borrow is not None and not buffer.is_shared()  # lent where it is
    named = [(n, p.detach()) for n, p in m.named_parameters()]
    named.insert(2, ("copied", torch.randn(4, 4).t()))  # not contiguous: packed
    writer = ShardWriter(tmp_path, stage=0)
    buckets, seen = [], {}
    pool = plain_pool(600, 1)
    for b in pack(named, pool, borrow=borrow):
        buckets.append((b.index, b.borrowed))
        writer.write(b)
        release(b, pool)  # a borrowed bucket may still be in the writer's hands
    writer.flush()
    assert sorted(i for i, _ in buckets) == list(range(len(buckets)))
    assert {lent for _, lent in buckets} == {True, False}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        verify_shard(shard)
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        assert int(header["__metadata__"]["checksum"]) == checksum(data, every_byte=True)
        seen.update(load_file(str(shard)))
    assert set(seen) == {n for n, _ in named}
    assert set(writer.outcome()["weight_map"]) == set(seen)
    assert all(torch.equal(seen[n], t) for n, t in named)


def test_gapless_lent_buckets_are_laid_out_as_their_receiver_computes():
    """For the distributed transport a lent bucket must be what the receiver computes from
    names, dtypes and shapes: tensors back to back in the order named. Runs of adjacent
    parameters become buckets; a gap in the buffer starts a new one."""
    from megatron_gspo.rollout.weight_payload import bucket_layout
    from megatron_gspo.weight_sync.gather import buffer_parameters

    m, buffer = buffer_module()
    m.s = torch.nn.Parameter(buffer[364:400])  # adjacent to q (164:364) and to r (400:456)
    named = [(n, p.detach()) for n, p in reversed(list(m.named_parameters()))]  # not in order
    pool = plain_pool(4096, 1)
    runs = []
    for b in pack(named, pool, borrow=buffer_parameters([m]), gapless=True):
        if b.borrowed:
            layout, nbytes = bucket_layout(
                [x.name for x in b.metadata], [x.dtype for x in b.metadata],
                [list(x.shape) for x in b.metadata],
            )  # fmt: skip
            assert nbytes == b.nbytes == b.flat.numel()
            assert [(x.start_idx, x.end_idx) for x in layout] == [
                (x.start_idx, x.end_idx) for x in b.metadata
            ]
            for name, t in unflatten(b.flat, layout):
                assert torch.equal(t, dict(named)[name])
            runs.append([x.name for x in b.metadata])
        release(b, pool)
    assert sorted(runs) == [["p"], ["q", "s", "r"]]  # p is followed by a gap


def test_checksum_of_parts_is_the_checksum_of_them_joined(tmp_path):
    x = torch.randint(0, 255, (1003,), dtype=torch.uint8)
    want = checksum(x, every_byte=True)
    for cuts in ([0, 1003], [0, 8, 512, 1003], [0, 3, 1003], [0, 992, 997, 1003]):
        parts = [x[a:b] for a, b in zip(cuts, cuts[1:])]
        assert checksum_parts(parts) == want
    y = x.clone()
    y[500] ^= 1
    assert checksum_parts([y[:512], y[512:]]) != want

    # A lent bucket whose tensors are not whole words: its shard's checksum is still right.
    meta = [
        types.SimpleNamespace(name=n, shape=torch.Size([e - s]), dtype=torch.uint8,
                              start_idx=s, end_idx=e, numel=e - s)
        for n, s, e in (("u", 0, 5), ("v", 16, 27), ("w", 40, 43))
    ]  # fmt: skip
    b = Bucket(0, 0, x[100:200], 19, meta, borrowed=True)
    write_shard(tmp_path / "odd.safetensors", b)
    verify_shard(tmp_path / "odd.safetensors")
    got = load_file(str(tmp_path / "odd.safetensors"))
    assert all(torch.equal(got[m.name], x[100 + m.start_idx : 100 + m.end_idx]) for m in meta)


def test_a_shard_that_fails_in_the_background_is_raised_by_flush(tmp_path):
    from megatron_gspo.weight_sync.gather import buffer_parameters

    m, _ = buffer_module()
    named = [(n, p.detach()) for n, p in m.named_parameters() if not n.startswith("own.")]
    pool = plain_pool(4096, 1)
    writer = ShardWriter(tmp_path / "gone", stage=0)  # no such directory
    # Queued: the failure shows up at a later write if it is already done, else at flush.
    with pytest.raises(FileNotFoundError):
        for b in pack(named, pool, borrow=buffer_parameters([m])):
            assert b.borrowed
            writer.write(b)
            release(b, pool)
        writer.flush()


def test_version_dirs_keep_the_newest_and_persist_the_restore_point(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    dirs = VersionDirs(tmp_path / "sync", keep=2, base=RestorePoint(str(base), "default"))
    assert dirs.restore.version == "default"
    made = []
    for v in ("1", "2", "3"):
        dirs.start(v)
        out = dirs.finish(v, [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
        assert (out / "config.json").is_file() and not dirs.tmp(v).exists()
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        dirs.set_restore(RestorePoint(str(out), v))
        made.append(out)
    assert not made[0].exists() and made[1].exists() and made[2].exists()
    (made[1] / "x.safetensors").write_bytes(b"old")
    tmp = dirs.start("4")  # reuses the oldest version's directory, never the restore point's
    assert not made[1].exists() and made[2].exists() and (tmp / "x.safetensors").exists()
    out = dirs.finish("4", [{"weight_map": {"w": "y.safetensors"}, "bytes": 4}], base)
    assert not (out / "x.safetensors").exists()  # a shard the new version did not write
    dirs.set_restore(RestorePoint(str(out), "4"))
    again = VersionDirs(tmp_path / "sync", keep=2, base=RestorePoint(str(base), "default"))
    assert again.restore == RestorePoint(str(out), "4")
    dirs.start("5")
    dirs.discard("5")
    assert not dirs.tmp("5").exists() and out.exists()


def test_a_copied_run_does_not_delete_the_versions_of_the_run_it_was_copied_from(tmp_path):
    """restore.json lists the version directories a run made, by absolute path; a run directory
    copied to branch an experiment used to delete the original run's versions as it made its
    own. Only directories under its own root are deleted (or reused) now."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    first = VersionDirs(tmp_path / "a" / "weights", keep=2, base=RestorePoint(str(base), "0"))
    for v in ("1", "2"):
        first.start(v)
        out = first.finish(v, [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
        first.set_restore(RestorePoint(str(out), v))
    originals = sorted((tmp_path / "a" / "weights").glob("v*"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = VersionDirs(tmp_path / "b" / "weights", keep=2, base=RestorePoint(str(base), "0"))
    for v in ("3", "4", "5"):
        copy.start(v)
        out = copy.finish(v, [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
        copy.set_restore(RestorePoint(str(out), v))
    assert [p.name for p in originals] == ["v1", "v2"] and all(p.is_dir() for p in originals)
    assert sorted(p.name for p in (tmp_path / "b" / "weights").glob("v*")) == [
        "v1",
        "v2",
        "v4",
        "v5",
    ]


def test_a_copied_run_restores_servers_from_its_own_versions_only(tmp_path, monkeypatch):
    """A copied run's restore.json named a version directory of the run it was copied from:
    once that run deleted it, a restarted server of the copy could not restore. The copy now
    starts from the base model (catch_up brings a restarted server to the trainer's weights)
    until its own first version; a run reopened under another spelling of its root keeps its own."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    start = RestorePoint(str(base), "0")
    first = VersionDirs(tmp_path / "a" / "weights", keep=2, base=start)
    first.start("1")
    out = first.finish("1", [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
    first.set_restore(RestorePoint(str(out), "1"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = VersionDirs(tmp_path / "b" / "weights", keep=2, base=start)
    assert copy.restore == start
    copy.start("2")
    own = copy.finish("2", [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
    copy.set_restore(RestorePoint(str(own), "2"))
    monkeypatch.chdir(tmp_path)
    assert VersionDirs("b/weights", keep=2, base=start).restore == RestorePoint(str(own), "2")
    assert VersionDirs("a/weights", keep=2, base=start).restore == RestorePoint(str(out), "1")


def test_a_version_is_named_to_the_servers_by_an_absolute_path(tmp_path, monkeypatch):
    """`train` defaults its run directory to the relative runs/NAME; a version's path is the
    servers' model_path, and a server someone else started runs in another directory."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    dirs = VersionDirs(Path("runs") / "r" / "weights", keep=2, base=RestorePoint(str(base), "0"))
    dirs.start("1")
    out = dirs.finish("1", [{"weight_map": {"w": "x.safetensors"}, "bytes": 4}], base)
    assert out == tmp_path / "runs" / "r" / "weights" / "v1" and out.is_dir()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"method": "nccl"}, "sync.method"),
        ({"bucket_mb": 0}, "bucket_mb"),
        ({"verify_every": -1}, "verify_every"),
        ({"verify_tolerance": 0}, "sync.verify_tolerance"),
    ],
)
def test_config_refuses_bad_values(kwargs, words):
    from megatron_gspo.weight_sync.sync import WeightSync

    with pytest.raises(UserError, match=words):
        SyncConfig(**kwargs).check()
    with pytest.raises(UserError, match=words):  # a WeightSync checks the config it is given
        WeightSync([], ["http://127.0.0.1:9"], SyncConfig(**kwargs), base_model="m")


def test_versions_default_to_shared_memory_only_for_local_servers():
    from megatron_gspo.weight_sync.placement import shm_dir

    with pytest.raises(UserError, match="sync.dir"):
        shm_dir(Servers(["http://10.1.2.3:30000"]))
    path = shm_dir(Servers(["http://127.0.0.1:30000"]))
    assert path.startswith("/dev/shm/") and os.path.isdir(path)
    os.rmdir(path)


def test_own_version_dir_is_removed_even_when_the_trainer_dies(tmp_path):
    """The /dev/shm directory a WeightSync made for itself (about a model's size per version)
    goes at close(), and also when the process ends by an exception without close()."""
    import subprocess
    import sys

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    model = make_tiny_model(TinySpec(), tmp_path / "m")
    code = (
        "import torch\n"
        "from megatron_gspo.model.parallel import ParallelDims, init_distributed\n"
        "from megatron_gspo.weight_sync.config import SyncConfig\n"
        "from megatron_gspo.weight_sync.sync import WeightSync\n"
        "init_distributed(ParallelDims())\n"
        "m = torch.nn.Linear(2, 2)\n"
        "ws = WeightSync([m], ['http://127.0.0.1:9'], SyncConfig(method='disk'), "
        f"base_model={str(model)!r})\n"
        "print('DIR', ws.dirs.root, flush=True)\n"
        "{end}\n"
    )
    for end, rc in (("ws.close()", 0), ("raise RuntimeError('the trainer died')", 1)):
        proc = subprocess.run(
            [sys.executable, "-c", code.format(end=end)], capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == rc, proc.stderr[-2000:]
        (root,) = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("DIR")]
        assert root.startswith("/dev/shm/") and not os.path.exists(root), (end, root)


def test_probe_is_fixed_and_compared_token_by_token():
    cfg = SyncConfig(probe_sequences=3, probe_length=10)
    seqs = verify.probe_batch(100, cfg)
    assert seqs == verify.probe_batch(100, cfg) and [len(s) for s in seqs] == [10, 5, 2]
    ref = [[None, -1.0, -2.0], [None, -0.5]]
    assert verify.max_abs_diff(ref, [[None, -1.0, -2.00001], [None, -0.5]]) == pytest.approx(1e-5)
    assert verify.max_abs_diff(ref, [[None, -1.0], [None, -0.5]]) == float("inf")
    results = [
        verify.ProbeResult("http://a", "7", 1e-6),
        verify.ProbeResult("http://b", "6", 0.0),
        verify.ProbeResult("http://c", "7", 0.1),
        verify.ProbeResult("http://d", error="down"),
    ]
    bad = verify.problems(results, "7", 1e-4)
    assert [m.split(": ")[0] for m in bad] == ["http://b", "http://c", "http://d"]
    assert "expected '7'" in bad[0] and "tolerance" in bad[1] and "down" in bad[2]


def test_probe_tolerance_follows_the_servers_dtype():
    ref = [[None, -1.0, -2.0, -3.0], [None, -0.5]]
    got = [[None, -1.1, -2.0, -3.5], [None, -0.5]]
    worst, mean = verify.abs_diffs(got, ref)
    assert worst == pytest.approx(0.5) and mean == pytest.approx((0.1 + 0.0 + 0.5 + 0.0) / 4)
    # bf16 rounding (mean 0.09 measured) passes a bf16 server and fails an fp32 one
    results = [
        verify.ProbeResult("http://bf16", "7", max_diff=2.7, mean_diff=0.09, dtype="bfloat16"),
        verify.ProbeResult("http://fp16", "7", max_diff=0.6, mean_diff=0.09, dtype="float16"),
        verify.ProbeResult("http://fp32", "7", max_diff=0.01, mean_diff=2e-4, dtype="float32"),
        verify.ProbeResult("http://auto", "7", max_diff=3.0, mean_diff=0.3, dtype=None),
        verify.ProbeResult("http://wrong", "7", max_diff=9.0, mean_diff=1.5, dtype="bfloat16"),
        # fp8 weights: rounding alone measured 0.30-0.40, a bucket of noise 5.07
        verify.ProbeResult("http://fp8", "7", max_diff=4.8, mean_diff=0.4, dtype="fp8"),
        verify.ProbeResult("http://fp8-wrong", "7", max_diff=15.5, mean_diff=5.07, dtype="fp8"),
    ]
    bad = verify.problems(results, "7")
    assert [m.split(": ")[0] for m in bad] == ["http://fp16", "http://fp32", "http://wrong",
                                               "http://fp8-wrong"]  # fmt: skip
    assert verify.DTYPE_TOLERANCE == {"float32": 1e-4, "float16": 100 / 2**11,
                                      "bfloat16": 100 / 2**8, "fp8": 1.5}  # fmt: skip
    assert "above the tolerance 1.5 (fp8's)" in bad[3]
    assert "by 1.5 on average (max 9), above the tolerance 0.391 (bfloat16's)" in bad[2]
    assert "raise sync.verify_tolerance" in bad[2] and "\n" not in bad[2]
    assert "0.0488 (float16's)" in bad[0] and "0.0001 (float32's)" in bad[1]
    # set by the user, it holds for every server
    assert [m.split(": ")[0] for m in verify.problems(results, "7", 2.0)] == ["http://fp8-wrong"]
    assert "(sync.verify_tolerance)" in verify.problems(results, "7", 0.05)[0]


def test_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    servers = Servers([url], timeout_s=5)
    with pytest.raises(ServerError, match=url):
        servers.post(0, "/begin_weight_update", {})
    answers, errors = servers.post_many([0], "/x", {})
    assert not answers and url in errors[0]
    servers.close()


@pytest.mark.parametrize(
    "reply",
    [b"garbage\r\n\r\n", b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a":'],
    ids=["not HTTP", "cut short"],
)
def test_a_server_answering_something_other_than_http_is_named(reply):
    """A rollout.urls entry at a program that does not speak HTTP (or a proxy that cuts the
    answer short) raised http.client's BadStatusLine / IncompleteRead, not a ServerError: the
    placement's /get_server_info (which skips a ServerError) ended the start on a traceback."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(reply)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    servers = Servers([url], timeout_s=5)
    with pytest.raises(ServerError) as e:
        servers.get(0, "/get_server_info")
    assert str(e.value).startswith(f"{url}: /get_server_info answered something other than HTTP (")
    servers.close()
    listener.close()


def test_a_redirect_is_refused_and_the_api_key_goes_nowhere_else():
    """urllib followed a server's (or a proxy's) redirect with every header, the API key
    included, to whatever host it named: the sync's requests refuse redirects, naming where
    the server pointed."""
    other, seen, other_server = authorization_recorder()

    def redirect(h):
        h.send_response(int(h.path.rsplit("/", 1)[1]))
        h.send_header("Location", other + "/steal")
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, server = serving(redirect)
    servers = Servers([ServerRef(url, api_key="secret")], timeout_s=5)
    for code in (301, 302, 307, 308):
        with pytest.raises(ServerError) as e:
            servers.get(0, f"/get_server_info/{code}")
        assert str(e.value) == (
            f"{url}: /get_server_info/{code} answered HTTP {code}, a redirect to {other}/steal, "
            "which is not followed (the API key would go with it): give the server's own "
            "address in rollout.urls"
        )
    with pytest.raises(ServerError, match="answered HTTP 302, a redirect"):
        servers.post(0, "/update_weight_version/302", {"new_version": "1"})
    assert seen == []
    servers.close()
    server.shutdown()
    other_server.shutdown()


def test_an_answer_larger_than_any_sync_answer_is_refused_unread():
    from megatron_gspo.weight_sync import servers as servers_module

    size = servers_module.MAX_ANSWER_BYTES + 1000

    def huge(h):
        h.send_response(200)
        h.send_header("Content-Length", str(size))
        h.end_headers()
        try:
            h.wfile.write(b" " * size)
        except OSError:  # the client stops reading
            pass

    url, server = serving(huge)
    servers = Servers([url], timeout_s=5)
    with pytest.raises(ServerError) as e:
        servers.get(0, "/get_server_info")
    assert str(e.value) == (
        f"{url}: /get_server_info answered more than 16 MiB, not an answer of this endpoint: "
        "is rollout.urls the rollout server's address?"
    )
    servers.close()
    server.shutdown()


def test_unflatten_matches_rollout_helper():
    named = [tensors()[0], tensors()[5], tensors()[4]]  # 128 + 64 + 48 B, aligned
    bucket = wp.flatten_bucket(named)
    ours = unflatten(bucket["flattened_tensor"], bucket["metadata"])
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(ours, named))


def test_parameters_too_large_for_dev_shm_are_not_lent(monkeypatch):
    """Where /dev/shm cannot hold the parameter buffer (a container's default 64 MB), nothing
    is moved: the sync copies into buckets as before instead of failing on a full tmpfs."""
    from megatron_gspo.weight_sync import gather

    buffer = torch.randn(300)
    m = torch.nn.Module()
    m.p = torch.nn.Parameter(buffer[:100])
    m.q = torch.nn.Parameter(buffer[100:200])
    monkeypatch.setattr(gather, "_shm_free", lambda: 1000)  # the fault: a nearly full /dev/shm
    assert gather.share_parameters([m]) is None
    assert not m.p.is_shared() and m.p.data_ptr() == buffer.data_ptr()


def test_cuda_payload_names_the_device_by_uuid_not_the_senders_index():
    # rebuild_cuda_tensor's arguments as torch's reducer gives them (device index at 6).
    args = ("cls", (4,), (1,), 0, "storage", torch.uint8, 3, b"h", 4, 0, False, b"r", 0, b"e", 1)
    got = wp.with_device_uuid(args, "GPU-1234")
    assert got[wp.CUDA_DEVICE_ARG] == "GPU-1234"
    assert got[: wp.CUDA_DEVICE_ARG] == args[: wp.CUDA_DEVICE_ARG]
    assert got[wp.CUDA_DEVICE_ARG + 1 :] == args[wp.CUDA_DEVICE_ARG + 1 :]
    assert wp.with_device_uuid(got, "GPU-5678") == got  # SGLang's reducer sent a UUID already
    moved = (*args[:6], (4,), *args[7:])
    with pytest.raises(TypeError, match="not a device index"):
        wp.with_device_uuid(moved, "GPU-1234")  # torch's layout changed: say so, do not guess


def test_remote_servers_reach_the_group_store_at_this_hosts_outward_address():
    """Not the host name's address, which may be loopback (127.0.1.1 on many distributions)."""
    import ipaddress
    import socket

    from megatron_gspo.weight_sync.transports.distributed import master_address

    assert master_address(Servers(["http://127.0.0.1:1", "http://localhost:2"])) == "127.0.0.1"
    remote = "192.0.2.1"  # TEST-NET: routed by the default route, never contacted
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((remote, 9))
    except OSError:
        pytest.skip("this machine has no route off the host")
    got = master_address(Servers([f"http://{remote}:30000", "http://127.0.0.1:1"]))
    assert not ipaddress.ip_address(got).is_loopback, got
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((got, 0))  # an address of this machine


def test_disk_buckets_are_packed_in_cpu_memory_for_a_gpu_trainer():
    """The shard writer writes from CPU memory: a GPU trainer's disk buckets are CPU (pinned
    when there is a GPU), not GPU buffers copied out again; the other transports' follow the
    trainer (a server that cannot be asked is taken to run where the trainer does)."""
    from megatron_gspo.weight_sync.transports import DiskTransport

    gpu = torch.device("cuda", 0)
    nobody = Servers(["http://127.0.0.1:9"], timeout_s=5)
    assert DiskTransport().bucket_device(gpu, nobody) == torch.device("cpu")
    assert TensorTransport().bucket_device(gpu, nobody) == gpu
    buf = DiskTransport().alloc(64, torch.device("cpu"))
    assert buf.device.type == "cpu" and buf.is_pinned() == torch.cuda.is_available()


def test_tensor_sharing_stays_on_until_the_last_thread_leaves():
    """The sharing strategy is process-wide and the sync enters TensorSharing from two threads
    (a bucket's allocation, another's serialization). Thread A enters, B enters, A leaves: B
    must still serialize a CPU tensor. CI once failed a PP2 sync on exactly this interleaving."""
    import threading

    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()  # another test may have left it at file_system
    mp.set_sharing_strategy("file_descriptor")  # Linux's default: what a block must restore
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    result: dict = {}

    def b():
        assert a_inside.wait(10)
        with wp.TensorSharing():
            b_inside.set()
            assert a_left.wait(10)
            result["strategy"] = mp.get_sharing_strategy()
            try:
                result["payload"] = wp.serialize([("w", torch.ones(3))])
            except RuntimeError as e:
                result["error"] = str(e)

    try:
        tb = threading.Thread(target=b)
        tb.start()
        with wp.TensorSharing():  # thread A
            a_inside.set()
            assert b_inside.wait(10)
        a_left.set()
        tb.join(20)
        assert result.get("strategy") == "file_system", result
        assert "payload" in result, result
        assert mp.get_sharing_strategy() == "file_descriptor"  # the last to leave put it back
    finally:
        mp.set_sharing_strategy(before)


def test_shared_memory_payload_from_another_machine_is_refused_before_any_name_is_opened():
    """A peer on another machine cannot have made a shared-memory object here: its payload is
    refused without opening the name (a by-value decode of the same bytes from this machine
    works); the server tells local peers from others by whether their address is its own."""
    from megatron_gspo.server.validate import is_local_address

    with wp.TensorSharing():
        t = torch.arange(6, dtype=torch.float32).share_memory_()
        payload = wp.serialize([("w", t)])
    assert safe_unpickle.decode_named_tensors(payload, None, MINE)[0][1].tolist() == t.tolist()
    with pytest.raises(safe_unpickle.BadPayload, match="from a client on another machine"):
        safe_unpickle.decode_named_tensors(payload, None, None)
    assert is_local_address("127.0.0.1")
    for remote in ("203.0.113.7", "2001:db8::7", "not an address", "", None):
        assert not is_local_address(remote), remote


def test_a_version_directorys_config_names_the_dtype_of_its_weights(tmp_path):
    """A bf16 run syncing through disk from a float32 model: each version directory is an HF
    checkpoint a server may load on its own, so its config.json says bfloat16, as an export's
    does (it said the base's float32)."""
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"dtype": "float32", "torch_dtype": "float32"}))
    dirs = VersionDirs(tmp_path / "sync", keep=2, base=RestorePoint(str(base), "default"))
    tmp = dirs.start("1")
    save_file({"w": torch.ones(3, 4, dtype=torch.bfloat16)}, str(tmp / "x.safetensors"))
    out = dirs.finish("1", [{"weight_map": {"w": "x.safetensors"}, "bytes": 24}], base)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert json.loads((base / "config.json").read_text())["dtype"] == "float32"
