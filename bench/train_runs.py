"""Shared by the benchmarks that compare whole `megatron-gspo train` runs side by side
(bench_sglang_step.py, bench_async.py): one run's steady-state medians, and several variants run
in alternating order over reps."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_medians(name: str, flags: list[str], a, parts: tuple[str, ...]) -> dict[str, float]:
    """`megatron-gspo train` with `flags` (a.config, a.model, a.steps; no eval): the median over
    steps 2.. (step 1 pays for first use) of each of `parts` (0 where a step lacks one)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config", a.config,
               "--run-dir", str(Path(tmp) / "run"), "--steps", str(a.steps),
               f"model.path={a.model}", "train.eval_every=0", *flags]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if out.returncode:
            sys.exit(f"{name} run ({' '.join(flags)}) failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(x) for x in (Path(tmp) / "run/metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] >= 2]
    return {k: statistics.median(r.get(k, 0.0) for r in steady) for k in parts}


def side_by_side(order: list[tuple[str, list[str]]], a, parts: tuple[str, ...]) -> dict:
    """{variant: median over a.reps of each part}: the variants (name, flags) run in turn,
    reversing the order every other rep, so that drift in the machine's load hits all alike."""
    got: dict[str, list[dict]] = {name: [] for name, _ in order}
    for rep in range(a.reps):
        for name, flags in order if rep % 2 == 0 else order[::-1]:
            got[name].append(train_medians(name, flags, a, parts))
    return {n: {k: statistics.median(r[k] for r in rs) for k in parts} for n, rs in got.items()}
