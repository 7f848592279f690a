"""Building the command line's parser, and so every `megatron-gspo ... --help`, imports no torch,
aiohttp or megatron: each command imports what it runs inside its own function (serve's flags live
in server/args.py, apart from the server). It took 2 s quiet and 5-10 s on a loaded machine
when `serve`'s parser imported the server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "aiohttp", "megatron")

# One process imports the CLI, builds its parser, then asks every command for its --help, in turn,
# and names the heavy packages each step was the first to import (the later ones find them
# loaded).
HELP_ALL = """
import contextlib, io, json, sys
from megatron_gspo import cli, docs_commands

HEAVY = {heavy!r}

def heavy():
    return sorted({{m.split(".")[0] for m in sys.modules}} & set(HEAVY))

first = {{"(import)": heavy()}}
parser = cli.build_parser()
first["(build_parser)"] = [m for m in heavy() if m not in first["(import)"]]
for command in [""] + sorted(docs_commands.subcommands(parser)):
    before = heavy()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        cli.main(command.split() + ["--help"])
    assert "usage: megatron-gspo" in out.getvalue(), (command, out.getvalue())
    first[command or "(none)"] = [m for m in heavy() if m not in before]
print(json.dumps(first))
"""


def test_no_command_help_imports_torch_aiohttp_or_megatron():
    r = subprocess.run(
        [sys.executable, "-c", HELP_ALL.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.splitlines()[-1])
    assert {"(build_parser)", "(none)", "serve", "train", "convert lora-to-hf"} <= set(first)
    assert {c: mods for c, mods in first.items() if mods} == {}


def test_version_is_the_packages_and_imports_nothing_heavy():
    """`megatron-gspo --version` did not exist. It says the version pyproject.toml gives the
    package, on stdout, exit 0, and (like --help) loads no torch to say it."""
    import tomllib

    probe = (
        "import contextlib, io, json, sys\n"
        "from megatron_gspo import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        cli.main(['--version'])\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(json.dumps([code, out.getvalue(), heavy]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    code, out, heavy = json.loads(r.stdout.splitlines()[-1])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (code, out, heavy) == (0, f"megatron-gspo {version}\n", [])
