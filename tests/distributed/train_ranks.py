"""`megatron-gspo train` on two gloo ranks under torchrun, each rank's stderr kept apart (torchrun's
--log-dir): what each rank said, and the exit status of each as torchrun's report gives it."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import QUICK_TRAIN, cli_env, torchrun

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe_gspo.yaml"
# torchrun's report of a failed rank: "rank      : 1 (local_rank: 1)\n  exitcode  : 2 (pid: ...)"
_FAILED = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)")


@dataclass
class Ranks:
    stderr: dict[int, str]  # each rank's own stderr
    exitcodes: dict[int, int]  # each failed rank's exit status (-15: killed by SIGTERM)
    torchrun: str  # torchrun's own output

    def error_lines(self, rank: int) -> list[str]:
        return [line for line in self.stderr[rank].splitlines() if line.startswith("error:")]


def train_two_ranks(tmp_path: Path, *args: str, env: dict | None = None) -> Ranks:
    """`megatron-gspo train --config CONFIG ARGS` (and the quick overrides) on two ranks."""
    logs = tmp_path / "rank-logs"
    cmd = torchrun(2, "--log-dir", str(logs), "--redirects", "3", "-m", "megatron_gspo", "train",
                   "--config", str(CONFIG), *QUICK_TRAIN, *args)  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=cli_env() if env is None else env)  # fmt: skip
    files = {int(p.parent.name): p for p in logs.glob("*/attempt_0/*/stderr.log")}
    assert sorted(files) == [0, 1], done.stderr[-3000:]
    stderr = {rank: path.read_text() for rank, path in files.items()}
    exitcodes = {int(rank): int(code) for rank, code in _FAILED.findall(done.stderr)}
    return Ranks(stderr, exitcodes, done.stdout + done.stderr)
