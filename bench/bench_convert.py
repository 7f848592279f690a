"""Checkpoint conversion throughput beside the physical limit, measured side by side in one run.

Makes a random Qwen3-MoE of about 1 GB (fp32), then alternates:
  - limit:  plain safetensors read of every tensor + write of the same bytes to a new file
  - ours:   `convert hf-to-megatron` (1 rank) and `convert megatron-to-hf` (1 rank)
and prints GB/s of each and the ratio ours / limit (goal: >= 0.5) last, with the load average
before and after (the machine may be shared; only ratios from one run compare). Process start-up
(torch.distributed, importing megatron: seconds, whatever the checkpoint size) happens once before
the timed phases, so rep 0 times the conversion like the others.

    .venv/bin/python bench/bench_convert.py [--reps 3] [--workdir /tmp/bench-convert]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from safetensors.torch import load_file, save_file

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.model.convert import hf_to_megatron, megatron_to_hf
from megatron_gspo.model.parallel import ParallelDims, init_distributed

ONE_GB_MOE = TinySpec(
    vocab_size=32000,
    hidden=1024,
    layers=4,
    heads=8,
    kv_heads=4,
    head_dim=128,
    ffn=2048,
    moe_ffn=512,
    experts=32,
    topk=4,
    seed=0,
)


def model_bytes(hf_dir: Path) -> int:
    return sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))


def plain_copy(hf_dir: Path, out: Path) -> None:
    out.mkdir()
    for f in sorted(hf_dir.glob("*.safetensors")):
        save_file(load_file(str(f)), str(out / f.name))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(fn) -> float:
    os.sync()  # every phase starts with no dirty pages left by the one before
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    src = work / "hf"
    if not src.exists():
        make_tiny_model(ONE_GB_MOE, src)
    gb = model_bytes(src) / 1e9
    print(f"model: {gb:.2f} GB fp32 safetensors at {src}; load average {_load()}")
    dims = ParallelDims()
    init_distributed(dims)
    limit, to_meg, to_hf = [], [], []
    for rep in range(args.reps):
        for p in work.glob("out-*"):
            shutil.rmtree(p)
        plain, meg, back = (work / f"out-{kind}-{rep}" for kind in ("plain", "meg", "hf"))
        limit.append(timed(partial(plain_copy, src, plain)))
        to_meg.append(timed(partial(hf_to_megatron, src, meg, dims)))
        to_hf.append(timed(partial(megatron_to_hf, meg, back, dims)))
        print(
            f"rep {rep}: plain {gb / limit[-1]:.2f} GB/s, hf->megatron {gb / to_meg[-1]:.2f} GB/s, "
            f"megatron->hf {gb / to_hf[-1]:.2f} GB/s"
        )
    plain, meg, hf = (gb / statistics.median(x) for x in (limit, to_meg, to_hf))
    print(
        f"median GB/s: plain read+write {plain:.2f} | hf->megatron {meg:.2f} | megatron->hf {hf:.2f}"
    )
    print(
        f"ratio vs plain safetensors read+write: hf->megatron {meg / plain:.2f}x, "
        f"megatron->hf {hf / plain:.2f}x (goal >= 0.5x)"
    )
    print(f"load average {_load()}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
