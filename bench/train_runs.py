"""Shared by the benchmarks that compare whole `megatron-gspo train` runs side by side
(bench_sglang_step.py, bench_async.py, bench_reward_workers.py): one run's steady-state medians,
and several variants run side by side (harness.measure: interleaved over reps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (bench/ is on the path: run as a script)
from harness import Result, Variant, cpu_seconds, measure, summarize

ROOT = Path(__file__).resolve().parents[1]


CPU = ("cpu/trainer_s", "cpu/servers_s")  # CPU seconds per step, steps 2.. (see train_medians)


def train_medians(name: str, flags: list[str], a, parts: tuple[str, ...]) -> dict[str, float]:
    """`megatron-gspo train` with `flags` (a.config, a.model, a.steps; no eval): the median over
    steps 2.. (step 1 pays for first use) of each of `parts` (0 where a step lacks one), and the
    CPU seconds per step over steps 2.. of the trainer process and of the rollout servers it
    started (all their processes and threads, from /proc: what each side costs, whatever the
    other's load)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config", a.config,
               "--run-dir", str(Path(tmp) / "run"), "--steps", str(a.steps),
               f"model.path={a.model}", "train.eval_every=0", *flags]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        metrics, log = Path(tmp) / "run/metrics.jsonl", Path(tmp) / "stderr.log"
        with open(log, "w") as err, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                                     cwd=ROOT, env=env) as proc:  # fmt: skip
            cpu = _cpu_per_step(proc, metrics, a.steps)
        if proc.returncode:
            sys.exit(f"{name} run ({' '.join(flags)}) failed:\n{log.read_text()[-3000:]}")
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steady = [r for r in rows if r["step"] >= 2]
    out = summarize(steady, [k for k in parts if k not in CPU])
    return {**out, **{k: v for k, v in cpu.items() if k in parts}}


def _cpu_per_step(proc: subprocess.Popen, metrics: Path, steps: int) -> dict[str, float]:
    """CPU seconds per step of the trainer and of the servers it started, between
    step 1's metrics line and the last step's, read while the run goes on (the servers are gone
    once it ends). Zeros when the run ends before."""
    marks: list[tuple[float, float]] = []
    while proc.poll() is None and len(marks) < 2:
        try:
            done = metrics.read_bytes().count(b"\n")
        except OSError:
            done = 0
        if (not marks and done >= 1) or (marks and done >= steps):
            marks.append(_tree_cpu(proc.pid))
        time.sleep(0.005)
    proc.wait()
    if len(marks) < 2 or steps < 2:
        return dict.fromkeys(CPU, 0.0)
    (t0, s0), (t1, s1) = marks
    return {"cpu/trainer_s": (t1 - t0) / (steps - 1), "cpu/servers_s": (s1 - s0) / (steps - 1)}


def _tree_cpu(root: int) -> tuple[float, float]:
    """(CPU seconds of the trainer: process `root` and its other descendants, e.g. more ranks;
    of the servers: each descendant that runs one, and everything below it), every thread."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue

    def below(tops: set[int]) -> set[int]:
        out, frontier = set(tops), set(tops)
        while frontier:
            frontier = {p for p, pp in parent.items() if pp in frontier} - out
            out |= frontier
        return out

    tree = below({root})
    servers = below({p for p in tree if _is_server(p)})
    return sum(_cpu(p) for p in tree - servers), sum(_cpu(p) for p in servers)


def _is_server(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"megatron_gspo.server" in argv or b"sglang.launch_server" in argv


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except (OSError, IndexError, ValueError):  # (ended meanwhile)
        return 0.0


def side_by_side(
    order: list[tuple[str, list[str]]], a, parts: tuple[str, ...], run=train_medians, name=""
) -> Result:
    """The variants (name, flags) measured side by side over a.reps (harness.measure: the order
    rotates every rep, so that drift in the machine's load hits all alike); each rep's sample is
    `run(name, flags, a, parts)`, one run's medians (train_medians, or a wrapper of it). The
    result's medians are over the reps."""
    variants = [Variant(n, lambda n=n, f=f: run(n, f, a, parts)) for n, f in order]
    return measure(variants, a.reps, name=name)
