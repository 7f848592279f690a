"""RL step time with real SGLang as the rollout backend against the built-in server, measured
side by side in one run: the same config, model and steps, each started by the trainer from the
documented keys alone (README: "Real SGLang on a CPU").

Runs `megatron-gspo train` once per backend (alternating which goes first over --reps) and
prints, per backend, the median over steps 2.. of time/step_s and its parts (rollout, train,
sync) and the mean response length (the samples differ: each backend draws its own), then the
ratio SGLang / built-in.

    .venv/bin/python bench/bench_sglang_step.py --model runs/task_model \\
        [--sglang-python ~/.cache/megatron-gspo/sglang-venv/bin/python] [--steps 6] [--reps 1]
        [--json OUT] [--variant NAME=FLAG,FLAG ...]   # more SGLang runs with these server flags
        [key=value ...]   # overrides for every run, e.g. rollout.dtype=bfloat16
"""

from __future__ import annotations

import os
from pathlib import Path

# (bench/ is on the path: run as a script)
from harness import finish, markdown_table, parser
from train_runs import CPU, ROOT, side_by_side

PARTS = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "response/length_mean",
         *CPU)  # fmt: skip


def main() -> None:
    ap = parser(__doc__, reps=1, warmup=None)
    ap.add_argument("--model", required=True, help="an HF task model (make-task-model)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_moe_gspo.yaml"))
    default = Path.home() / ".cache" / "megatron-gspo" / "sglang-venv" / "bin" / "python"
    ap.add_argument("--sglang-python", default=str(default))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=FLAG,FLAG: an SGLang run with these server flags too")  # fmt: skip
    a, extra = ap.parse_known_args()
    sglang = ["rollout.backend=sglang", f"rollout.sglang_python={a.sglang_python}"]
    order = [("builtin", []), ("sglang", sglang)]
    for v in a.variant:
        name, _, flags = v.partition("=")
        order.append((name, [*sglang, f"rollout.extra_server_args=[{flags}]"]))
    res = side_by_side([(n, [*flags, *extra]) for n, flags in order], a, PARTS, name="sglang_step")
    rows = [[n, *(f"{res.median(n, k):.3f}" for k in PARTS)] for n in res.variants]
    print(markdown_table(["backend", *(k.split("/")[1] for k in PARTS)], rows))
    for name in res.variants[1:]:
        print(f"step time {name} / builtin: {res.ratio(name, 'builtin', 'time/step_s'):.2f}x")
    print(f"(medians over steps 2.. and {a.reps} rep(s); load average {os.getloadavg()[0]:.1f})")
    finish(res, a)


if __name__ == "__main__":
    main()
