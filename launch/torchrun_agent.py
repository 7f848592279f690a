"""torchrun for launch/torchrun.sh: `python -m torch.distributed.run ARGS`, but for its exit code
when a rank fails.

torchrun exits 1 however its ranks ended. Here a failure whose first rank exited 2 (`train`'s
one-line refusal of its input: a config, data or run directory it does not take) exits 2, so the
launch script can tell a refusal, to be fixed before anything is run again, from a crash, which
the same command with --resume continues. Anything else is torchrun's own: its arguments, its
ranks' output and logs, its summary of the failure (printed here as torchrun prints it, without
the traceback of torchrun's own frames), its exit code 1.

    python launch/torchrun_agent.py --nnodes 1 --nproc-per-node 2 ... -m megatron_gspo.cli train ...
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

REFUSED = 2  # the exit code of a command that refused its input (megatron_gspo/entry.py)


def main(argv: list[str] | None = None) -> None:
    try:
        torchrun(argv)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        print(e, file=sys.stderr)
        sys.exit(REFUSED if first.exitcode == REFUSED else 1)


if __name__ == "__main__":
    main()
