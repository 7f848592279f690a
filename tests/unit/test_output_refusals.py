"""An output that cannot be made (in /proc, below a file, over a file) is one line naming the
fix, exit 2, nothing written: `study --out` and `report --out`, as train/convert/score do."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.train.metrics import MetricsLogger
from tests.unit.test_cli_errors import main_error

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_study_refuses_an_out_it_cannot_write(tmp_path, capsys):
    """--out /sys/st was a PermissionError traceback (/proc/st: FileNotFoundError), --out FILE
    a FileExistsError one."""
    (tmp_path / "README.md").write_text("mine")
    study = ["study", "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--steps", "1",
             "--algos", "gspo", "--out"]  # fmt: skip
    cases = {
        "/proc/st": "error: cannot create output path /proc/st: /proc takes no new files (",
        "/proc": "error: cannot write in study directory /proc (",
        str(tmp_path / "README.md"): f"error: --out {tmp_path / 'README.md'} is a file, not a "
        "study directory; choose another --out",
        str(tmp_path / "README.md" / "st"): f"error: cannot create output path "
        f"{tmp_path / 'README.md' / 'st'}: {tmp_path / 'README.md'} is a file, not a directory; ",
    }
    for out, start in cases.items():
        line = main_error([*study, out], capsys)
        assert line.startswith(start) and line.endswith(" another --out"), line
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]
    assert (tmp_path / "README.md").read_text() == "mine"


def test_report_refuses_an_out_it_cannot_write(tmp_path, capsys):
    """--out /proc/x.png was a FileNotFoundError traceback (/sys: PermissionError); below a file
    it said the directory does not exist, though it does, as a file."""
    run = tmp_path / "run"
    with MetricsLogger(run, total_steps=1, tensorboard=False, console=False) as logger:
        logger.log(1, {"reward/mean": 0.5})
    (tmp_path / "README.md").write_text("mine")
    below = tmp_path / "README.md" / "x.png"
    cases = {
        "/proc/c5.png": "error: cannot create output path /proc/c5.png: /proc takes no new files (",
        str(below): f"error: cannot create output path {below}: {tmp_path / 'README.md'} is a "
        "file, not a directory; ",
    }
    for out, start in cases.items():
        line = main_error(["report", str(run), "--out", out], capsys)
        assert line.startswith(start) and line.endswith(" another --out"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "run"]
    assert (tmp_path / "README.md").read_text() == "mine"
