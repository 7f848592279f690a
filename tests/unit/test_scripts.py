"""scripts/convert_demo.sh's directory and scripts/setup.sh's final check, run as a user runs
them from a scratch copy of scripts/ whose .venv/bin holds an injected fault: a megatron-gspo that
fails at once (the demo stops after making its directory), a python whose `-m pip` installs
nothing (else the real one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MARK = ".made-by-convert-demo"


def scratch(root: Path) -> Path:
    """scripts/ copied; .venv/bin: megatron-gspo exits 3, python runs the real one but pip."""
    (root / "scripts").mkdir(parents=True)
    for name in ("convert_demo.sh", "setup.sh"):
        (root / "scripts" / name).write_bytes((ROOT / "scripts" / name).read_bytes())
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fakes = {
        "megatron-gspo": "exit 3\n",
        "python": f'[ "$1 $2" = "-m pip" ] && exit 0\nexec {sys.executable} "$@"\n',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return root


def run(root: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "DEMO_DIR")} | env
    return subprocess.run(["bash", f"scripts/{script}"], cwd=root, capture_output=True,
                          text=True, env=full, timeout=120)  # fmt: skip


def test_convert_demo_leaves_the_users_run_dir_alone(tmp_path):
    """It read RUN_DIR, quickstart.sh's run directory, and deleted it whole: an exported
    RUN_DIR=runs/myrun lost that run. Its directory is DEMO_DIR now; run again, it replaces the
    directory it made (its marker file) and nothing else."""
    root = scratch(tmp_path)
    mine = root / "runs" / "myrun" / "metrics.jsonl"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's run\n")
    demo = root / "runs" / "convert_demo"
    for _ in range(2):
        proc = run(root, "convert_demo.sh", RUN_DIR="runs/myrun")
        assert proc.returncode == 3, proc.stdout + proc.stderr  # the injected fault's exit
        assert sorted(p.name for p in demo.iterdir()) == [MARK]  # (made anew: no stale file)
        (demo / "stale").write_text("from the run before\n")
    assert mine.read_text() == "the user's run\n"


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_convert_demo_refuses_a_demo_dir_it_did_not_make(tmp_path, kind):
    root = scratch(tmp_path)
    target = root / "runs" / "mine"
    if kind == "directory":
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("keep me\n")
    else:
        target.parent.mkdir(parents=True)
        target.write_text("keep me\n")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    proc = run(root, "convert_demo.sh", DEMO_DIR="runs/mine")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: runs/mine exists and was not made by this demo; set DEMO_DIR to a new directory"
    ]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    kept = target / "notes.txt" if kind == "directory" else target
    assert kept.read_text() == "keep me\n"


def test_setup_ready_check_prints_its_line_and_no_warnings(tmp_path):
    """The final check printed four "Transformer Engine and Apex are not installed"
    UserWarnings (megatron.core's import) around its one line."""
    proc = run(scratch(tmp_path), "setup.sh")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    (line,) = proc.stdout.splitlines()
    assert line.startswith("ready: torch ") and ", megatron-core " in line and ", cuda=" in line
