"""Each CPU benchmark of bench/ that has a mode of a few seconds, run as its command line runs it,
with `--json`: it ends cleanly and writes the harness's one schema, with the variants it measures
side by side, every rep's sample, and medians that are the medians of those samples.
(bench_batch.py runs in tests/distributed/test_shard.py; the benchmarks that train for minutes or
need SGLang or TRL are not run here.)"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_documented_commands import DOCS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TINY_HEAD = ["--tokens", "64", "--hidden", "32", "--vocab", "1000", "--chunk", "16"]
TINY_ROUTING = ["--hidden", "64", "--layers", "2", "--experts", "8", "--topk", "2", "--batch",
                "2", "--seq", "64"]  # fmt: skip
TINY_ROLLOUT = ["--prompts", "2", "--samples", "2", "--new-tokens", "4"]
CASES = {  # script: (flags, variants, reps, a ratio the run reports: (num, den, metric))
    "bench_loss.py": (["--vocab", "2000", "--seq", "32", "--reps", "3", "--alone-reps", "3"],
                      ["logprobs", "gspo", "grpo"], 3, ("gspo", "logprobs", "cpu_s")),
    "bench_lm_head.py": ([*TINY_HEAD, "--reps", "2"], ["whole", "whole_fused", "chunked"], 2,
                         ("chunked", "whole", "peak_bytes")),
    "bench_convert.py": (["--quick", "--reps", "2"], ["plain", "hf->megatron", "megatron->hf"], 2,
                         ("plain", "hf->megatron", "seconds")),
    "bench_pack.py": (["--quick", "--reps", "1"],
                      ["cycle/padded", "cycle/packed", "long-tail/padded", "long-tail/packed"], 1,
                      ("long-tail/padded", "long-tail/packed", "seconds")),
    "bench_routing_replay.py": ([*TINY_ROUTING, "--reps", "2"], ["plain", "none", "r2", "r3"], 2,
                                None),
    "bench_rollout.py": ([*TINY_ROLLOUT, "--reps", "2"], ["server", "hf"], 2,
                         ("server", "hf", "tokens_per_s")),
}  # fmt: skip


@pytest.mark.parametrize("script", list(CASES))
def test_benchmark_runs_and_writes_the_harness_json(script, tmp_path):
    flags, variants, reps, ratio = CASES[script]
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "bench" / script), *flags, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "|---|" in proc.stdout  # the markdown table
    got = json.loads(out.read_text())
    assert got["schema"] == "megatron-gspo-bench/1"
    assert got["benchmark"] == script.removeprefix("bench_").removesuffix(".py")
    assert list(got["variants"]) == variants
    assert got["params"]["reps"] == reps and got["host"]["cpus"] >= 1
    for v in variants:
        samples = got["variants"][v]["samples"]
        assert len(samples["seconds"]) == reps
        for metric, xs in samples.items():
            assert got["variants"][v]["median"][metric] == pytest.approx(statistics.median(xs))
            assert got["variants"][v]["min"][metric] == min(xs)
    assert len(got["order"]) == reps * len(variants)
    assert got["order"][: len(variants)] == variants  # rep 0 in the declared order
    if reps > 1:  # rep 1 rotated by one
        assert got["order"][len(variants) : 2 * len(variants)] == [*variants[1:], variants[0]]
    if ratio is not None:  # a ratio of two variants' medians from this run
        num, den, metric = ratio
        med = {v: statistics.median(got["variants"][v]["samples"][metric]) for v in (num, den)}
        assert got["ratios"][f"{num}/{den}:{metric}"] == pytest.approx(med[num] / med[den])


def quoted_flags() -> dict[str, set[str]]:
    """Every `--flag` that README.md and docs/ give a bench/ script, by script: in code spans
    (which may wrap), fenced blocks and indented command lines."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        fenced = re.findall(r"```(.*?)```", text, re.S)
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        commands = [line for block in fenced for line in block.splitlines()]
        commands += re.findall(r"`([^`]+)`", text) + re.findall(r"^    (.*)$", text, re.M)
        for command in commands:
            for m in re.finditer(r"bench/(\w+\.py)([^`|]*)", command):
                found.setdefault(m.group(1), set()).update(re.findall(r"(--[\w-]+)", m.group(2)))
    return found


def test_every_flag_the_docs_quote_is_accepted():
    """The command lines README.md and docs/ quote keep working: each script exists and lists
    every flag they give it in its --help."""
    quoted = quoted_flags()
    assert {"bench_rl_step.py", "bench_pack.py", "bench_lm_head.py"} <= set(quoted)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for script, flags in sorted(quoted.items()):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        missing = {f for f in flags if not re.search(rf"{re.escape(f)}\b", proc.stdout)}
        assert not missing, (script, missing)
