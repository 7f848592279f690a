"""Checkpoint conversion throughput beside the physical limit, measured side by side in one run.

Makes a random Qwen3-MoE of about 1 GB (fp32; `--quick`: a tiny one), then measures side by side
(harness.measure: the order rotates every rep):
  - plain:         plain safetensors read of every tensor + write of the same bytes to a new file
  - hf->megatron:  `convert hf-to-megatron` (1 rank)
  - megatron->hf:  `convert megatron-to-hf` (1 rank), from a Megatron checkpoint made before
and prints GB/s of each (the checkpoint's bytes over the median seconds) and the ratio ours / limit
(goal: >= 0.5) last, with the load average before and after (the machine may be shared; only
ratios from one run compare). Process start-up (torch.distributed, importing megatron: seconds,
whatever the checkpoint size) happens once before the timed phases, and each phase starts with no
dirty pages left by the one before (os.sync, untimed).

    .venv/bin/python bench/bench_convert.py [--reps 3] [--workdir /tmp/bench-convert] [--json OUT]
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# (bench/ on the path)
from harness import Variant, finish, markdown_table, measure, parser, workdir
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


def fresh(path: Path) -> None:
    """(untimed) The output directory gone, and no dirty pages left by the phase before."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def main() -> None:
    ap = parser(__doc__, reps=3, warmup=0, quick="a tiny model (a check that it runs)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    with workdir(args.workdir, "bench-convert-") as work:
        run(work, args)


def run(work: Path, args) -> None:
    """The model in `work` (made unless there) and the three phases side by side."""
    src = work / ("hf-tiny" if args.quick else "hf")
    if not src.exists():
        make_tiny_model(TinySpec(seed=0) if args.quick else ONE_GB_MOE, src)
    gb = model_bytes(src) / 1e9
    print(f"model: {gb:.2f} GB fp32 safetensors at {src}; load average {_load()}")
    dims = ParallelDims()
    init_distributed(dims)
    meg_src = work / "meg-src"
    fresh(meg_src)
    hf_to_megatron(src, meg_src, dims)
    plain, meg, back = (work / f"out-{kind}" for kind in ("plain", "meg", "hf"))
    res = measure(
        [Variant("plain", lambda: plain_copy(src, plain), lambda: fresh(plain)),
         Variant("hf->megatron", lambda: hf_to_megatron(src, meg, dims), lambda: fresh(meg)),
         Variant("megatron->hf", lambda: megatron_to_hf(meg_src, back, dims), lambda: fresh(back))],
        args.reps, args.warmup, name="convert",
        on_sample=lambda v, rep, s: print(f"rep {rep}: {v} {gb / s[0]['seconds']:.2f} GB/s"),
    )  # fmt: skip
    for v in res.variants:  # GB/s of each call
        for s in res.samples[v]:
            s["gbps"] = gb / s["seconds"]
    res.extra["model_gb"] = gb

    def x_plain(v: str) -> str:
        return "1" if v == "plain" else f"{res.ratio('plain', v):.2f}x"

    rows = [[v, f"{gb / res.median(v):.2f}", x_plain(v)] for v in res.variants]
    print(markdown_table(["phase", "GB/s (median)", "x plain read+write"], rows))
    print("(goal: hf->megatron and megatron->hf >= 0.5x plain)")
    print(f"load average {_load()}")
    finish(res, args)


if __name__ == "__main__":
    main()
