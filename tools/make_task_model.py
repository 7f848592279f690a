"""Write the starting checkpoint of the tiny RL run: a tiny Qwen3-MoE partly competent on a task.

python tools/make_task_model.py --out /tmp/arith-start [--task arith] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

from megatron_gspo.data.tasks import TASKS
from megatron_gspo.errors import UserError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to create")
    parser.add_argument("--task", default="arith", choices=sorted(TASKS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from megatron_gspo.data.warmstart import make_task_model

    try:
        print(make_task_model(args.out, task=args.task, seed=args.seed))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
