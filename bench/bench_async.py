"""The RL loop with rollouts ahead of training (`rollout.max_staleness=1`, then also with
`rollout.partial=true`, and `--staleness N` more) against the synchronous loop (0), side by side
in one run: the same config, model, seed and steps, each a `megatron-gspo train` run started
from the documented keys, their order rotating every rep (harness.measure).

Prints, per mode, the medians over steps 2.. (step 1 pays for first use) of the step time and
its parts, the trainer's idle time (waiting for rollouts), the servers' idle time, the trained
tokens per second, the fraction of samples that a weight update cut (partial: written by more
than one version), the CPU seconds per step of the trainer and the servers' CPU seconds per
batch they generated (from /proc); then each mode's throughput / sync's. On this 2-core machine
the built-in server generates on one core while the trainer trains on the other.

Goal (issue 28): >= 1.3x the synchronous loop's trained tokens/s at staleness 1.

    .venv/bin/python bench/bench_async.py --model runs/task_model [--steps 8] [--reps 2]
        [--staleness 2] [--json OUT] [key=value ...]   # overrides for every run, e.g. rollout.max_new_tokens=64
    .venv/bin/python bench/bench_async.py --cycle small [--steps 4] [--reps 1]
    .venv/bin/python bench/bench_async.py --cycle small --contend [--steps 4] [--reps 1]

`--contend` measures instead how much the synchronous loop's training step slows while a process
keeps the other core busy (matmuls in cache, or an array streamed through memory): on a machine
whose cores share the host's resources, an overlapped step pays that for as long as the servers
generate.

`--cycle tiny|small` runs the cycle of the TRL comparison (bench_rl_step.py) instead of a task
model and config: its model of that size (made here, random weights), its prompts, reward and
GSPO update (8 prompts x 8 completions of <= 16 / 128 tokens, 4 updates per batch). At `small`
generation and training take about the same time, the setting where overlapping them pays most.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_rl_step as rl_step  # (bench/ is on the path: run as a script)
from harness import Result, finish, markdown_table, parser
from train_runs import CPU, ROOT, side_by_side, train_medians

PARTS = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "time/trainer_idle_s",
         "time/servers_idle_s", "tokens_per_s", "response/length_mean",
         "rollout/partial_fraction", *CPU)  # fmt: skip
MODES = {
    "sync": ["rollout.max_staleness=0"],
    "async": ["rollout.max_staleness=1"],
    "partial": ["rollout.max_staleness=1", "rollout.partial=true"],
}
_ONE_THREAD = "import torch\ntorch.set_num_threads(1)\n"
BURNERS = {  # (--contend) one thread that keeps the other core busy: in cache, or streaming memory
    "idle": None,
    "matmul": _ONE_THREAD + "a = torch.randn(512, 512)\nwhile True: a @ a",
    "stream": _ONE_THREAD + "x = torch.randn(10**8)\nwhile True: x.mul_(1.0)",
}


def main() -> None:
    ap = parser(__doc__, reps=2, warmup=None)
    ap.add_argument("--model", help="an HF task model (make-task-model)")
    ap.add_argument("--cycle", choices=("tiny", "small"), help="bench_rl_step.py's cycle instead")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_moe_gspo.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=0, help="also a mode with this staleness")
    ap.add_argument("--contend", action="store_true",
                    help="instead: the synchronous loop's training step with the other core idle "
                    "and busy")  # fmt: skip
    a, extra = ap.parse_known_args()
    if (a.model is None) == (a.cycle is None):
        ap.error("give --model (a task model) or --cycle (bench_rl_step.py's), not both")
    with tempfile.TemporaryDirectory(prefix="bench-async-") as work:
        if a.cycle:  # (its model, prompts and the reward plugin on PYTHONPATH)
            size = rl_step.SIZES[a.cycle]
            a.model, data, mparams = rl_step.make_inputs(a.cycle, size, Path(work))
            a.config = rl_step.CONFIG
            extra = [*rl_step.cycle_overrides(data, size), *extra]
            os.environ["PYTHONPATH"] = rl_step.bench_path()
            print(f"cycle {a.cycle}: Qwen3-MoE {mparams:.1f}M params, <= {size.new_tokens} tokens")
        res = contend(a, extra) if a.contend else run(a, extra)
    finish(res, a)


def contend(a, extra: list[str]) -> Result:
    """The synchronous loop alone, then beside a process that keeps the other core busy (in
    rotating order over reps): how much a training step slows while the other core works,
    which an overlapped step pays for the part of it that the servers generate."""
    flags = ["rollout.max_staleness=0", "train.checkpoint_every=0", *extra]
    parts = ("time/train_s", CPU[0])
    res = side_by_side([(n, flags) for n in BURNERS], a, parts, run=beside_burner, name="contend")
    rows = [[n, f"{res.median(n, 'time/train_s'):.3f}", f"{res.median(n, CPU[0]):.3f}",
             f"{res.ratio(n, 'idle', 'time/train_s'):.2f}x"] for n in res.variants]  # fmt: skip
    print(markdown_table(["other core", "train_s", "cpu_trainer_s", "/ idle"], rows))
    print(f"(load average {os.getloadavg()[0]:.1f})")
    return res


def beside_burner(name: str, flags: list[str], a, parts: tuple[str, ...]) -> dict[str, float]:
    """train_medians, with BURNERS[name] running in a process of its own meanwhile."""
    code = BURNERS[name]
    burner = subprocess.Popen([sys.executable, "-c", code]) if code else None
    try:
        return train_medians(name, flags, a, parts)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def run(a, extra: list[str]) -> Result:
    modes = dict(MODES)
    if a.staleness > 1:
        modes[f"ahead{a.staleness}"] = [f"rollout.max_staleness={a.staleness}"]
    # (no checkpoints: their writes would weigh on both modes alike and hide the difference)
    order = [(name, [*flags, "train.checkpoint_every=0", *extra]) for name, flags in modes.items()]
    res = side_by_side(order, a, PARTS, name="async")
    for name, flags in modes.items():  # the servers' CPU per batch, not per step
        for sample in res.samples[name]:
            sample["cpu/servers_s"] *= (a.steps - 1) / max(batches_in_window(flags, a.steps), 1)
    heads = [k.replace("/", "_") if k in CPU else k.split("/")[-1] for k in PARTS]
    rows = [[n, *(f"{res.median(n, k):.3f}" for k in PARTS)] for n in res.variants]
    print(markdown_table(["mode", *heads], rows))
    for name in res.variants[1:]:
        ratio = res.ratio(name, "sync", "tokens_per_s")
        print(f"trained tokens/s, {name} / sync: {ratio:.2f}x")
    print(f"(load average {os.getloadavg()[0]:.1f})")
    return res


def batches_in_window(flags: list[str], steps: int) -> int:
    """How many batches the servers generate between step 1's metrics line and the last step's,
    where train_runs reads the CPU: those of steps 2 + N .. `steps` at staleness N (nothing is
    generated past the last step, and step 2's batch was made during step 1)."""
    ahead = [int(f.split("=")[1]) for f in flags if f.startswith("rollout.max_staleness=")]
    return steps - 1 - (ahead[-1] if ahead else 0)


if __name__ == "__main__":
    main()
