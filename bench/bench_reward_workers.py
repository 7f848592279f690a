"""A reward that waits 0.05 s per call (a remote judge, a sandboxed test run) against the built-in
`exact` reward, on the tiny 64-sample step (configs/tiny_moe_gspo.yaml: 8 prompts x 8), side by
side in one run: each a `megatron-gspo train` run, their order reversed every other rep.

The slow reward runs in `reward.workers` worker processes (rewards/scoring.py; default 16 on a
machine of up to 16 cores), each sample sent as soon as its group's generation ends; `exact` runs
in the trainer. Called one after another in the trainer, the slow reward would add 64 x 0.05 =
3.2 s a step. Goal (issue 49): it adds at most 1/8 of that (0.4 s a step).

Prints, per reward, the medians over steps 2.. of the step time, the generation, the wait for
rewards after it (time/reward_wait_s) and the training; the slow reward's added step time and
its share of the serial cost; and the worker processes' resident memory (RSS, sampled during the
runs: each worker's, and all of them together).

    .venv/bin/python bench/bench_reward_workers.py [--model runs/task_model] [--steps 6]
        [--reps 3] [--delay 0.05] [--json OUT] [key=value ...]   # e.g. reward.workers=16
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

# (bench/ is on the path: run as a script)
from harness import Result, finish, markdown_table, parser
from train_runs import ROOT, side_by_side, train_medians

PARTS = ("time/step_s", "time/rollout_s", "time/reward_wait_s", "time/train_s", "reward/mean")
RSS = ("rss/workers", "rss/worker_max_mb", "rss/workers_mb")
SLOW = """
import time

from megatron_gspo.rewards.exact import exact_answer


def score(prompt, response, answer):
    time.sleep({delay})  # a judge's answer, a sandbox's run: the trainer's CPU is not used
    return exact_answer(prompt, response, answer)
"""
WORKER = b"megatron_gspo.bounded.worker"


def main() -> None:
    ap = parser(__doc__, reps=3, warmup=None)
    ap.add_argument("--model", default=str(ROOT / "runs" / "task_model"),
                    help="an HF task model (make-task-model); made here if absent")  # fmt: skip
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_moe_gspo.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds the slow reward waits")
    a, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as work:
        if not Path(a.model, "config.json").is_file():
            a.model = make_model(Path(work) / "model")
        plugin = Path(work) / "slow_reward.py"
        plugin.write_text(SLOW.format(delay=a.delay))
        order = [("exact", ["reward.fn=exact", "train.checkpoint_every=0", *extra]),
                 ("slow", [f"reward.fn={plugin}:score", "train.checkpoint_every=0", *extra])]  # fmt: skip
        res = side_by_side(order, a, PARTS + RSS, run=with_worker_memory, name="reward_workers")
    report(res, a)
    finish(res, a)


def make_model(out: Path) -> str:
    from megatron_gspo.data.warmstart import make_task_model

    print(f"no model at --model: making a task model (short warm start) in {out}")
    return str(make_task_model(out, seed=0, clean_steps=30, sloppy_steps=10))


def report(res: Result, a) -> None:
    rows = [[n, *(f"{res.median(n, k):.3f}" for k in PARTS)] for n in res.variants]
    print(markdown_table(["reward", *(k.split("/")[-1] for k in PARTS)], rows))
    samples = 64  # the config's 8 prompts x 8
    serial = samples * a.delay
    added = res.median("slow", "time/step_s") - res.median("exact", "time/step_s")
    res.extra["slow_adds_s"] = added
    print(f"the slow reward adds {added:.3f} s a step: {added / serial:.3f} of its serial cost "
          f"({samples} x {a.delay:g} s = {serial:.2f} s; goal <= 1/8 = {serial / 8:.2f} s)")  # fmt: skip
    w = res.medians("slow")
    print(f"reward workers: {w['rss/workers']:.0f}, RSS {w['rss/worker_max_mb']:.1f} MB the "
          f"largest, {w['rss/workers_mb']:.1f} MB together")  # fmt: skip
    print(f"(medians over steps 2..{a.steps} and {a.reps} reps; "
          f"load average {os.getloadavg()[0]:.1f})")  # fmt: skip


def with_worker_memory(name: str, flags: list[str], a, parts: tuple[str, ...]) -> dict:
    """train_medians, with the worker processes' RSS sampled while the run goes on (the largest
    total seen, and the largest single worker)."""
    seen: list[list[float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            rss = worker_rss_mb()
            if rss:
                seen.append(rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        got = train_medians(name, flags, a, tuple(k for k in parts if k not in RSS))
    finally:
        done.set()
        thread.join()
    top = max(seen, key=sum, default=[])
    return got | {"rss/workers": float(len(top)), "rss/worker_max_mb": max(top, default=0.0),
                  "rss/workers_mb": sum(top)}  # fmt: skip


def worker_rss_mb() -> list[float]:
    """The RSS of each bounded worker process below this one."""
    me, parent, found = os.getpid(), {}, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    for pid in parent:
        p = pid
        while p in parent and p != me:
            p = parent[p]
        if p != me:
            continue
        try:
            if WORKER not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kb = [int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")]
        found += [k / 1024 for k in kb]
    return found


if __name__ == "__main__":
    main()
