"""README's quick examples, run as written (in a scratch directory, `.venv/bin/megatron-gspo` being
this interpreter's `megatron-gspo`): the checkpoint conversion round trip. The other commands of
the documents are parsed and their configs loaded in tests/unit/test_documented_commands.py; the
main command (scripts/quickstart.sh) runs, three times, in tests/e2e/test_quickstart.py.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import cli_env
from tests.unit.test_documented_commands import code_lines

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def readme_block(heading: str) -> list[str]:
    """The commands of the code block under README's `## heading`."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [cmd for _, cmd in code_lines(section)]


def test_readme_conversion_example_round_trips(tmp_path):
    commands = readme_block("Convert checkpoints")
    assert [shlex.split(c)[1:3] for c in commands] == [
        ["make-tiny-model", "--out"], ["convert", "hf-to-megatron"], ["convert", "megatron-to-hf"]
    ]  # fmt: skip
    for command in commands:
        words = shlex.split(command)
        assert words[0] == ".venv/bin/megatron-gspo", command
        r = subprocess.run([sys.executable, "-m", "megatron_gspo", *words[1:]], cwd=tmp_path,
                           capture_output=True, text=True, env=cli_env(), timeout=300)  # fmt: skip
        assert r.returncode == 0, (command, r.stderr[-2000:])
    before = load_file(tmp_path / "runs/tiny_hf/model.safetensors")
    after = load_file(tmp_path / "runs/tiny_back/model.safetensors")
    assert before.keys() == after.keys()
    assert all(before[k].equal(after[k]) for k in before)
    config = json.loads((tmp_path / "runs/tiny_back/config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
