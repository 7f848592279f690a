"""Every command README.md and docs/ show, as a user would type it.

Each `megatron-gspo ...` line of a code block (`.venv/bin/megatron-gspo`, `torchrun ... -m
megatron_gspo`, `launch/torchrun.sh` and `train.sbatch`, whose arguments are `train`'s, and the
container's entrypoint alike; continuation lines joined) is parsed by the CLI's own parser; a
`train` command's config is loaded with its overrides and a `study` command is planned (every
arm's config loaded), so a renamed key, a flag that no longer exists or a config file that moved
fails here. Synopsis lines (`[--steps N]`, `FILE.yaml`) are not runnable and are left out. Every
script, config and benchmark a document names exists. The quick examples run as written in
tests/e2e/test_documented_examples.py.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from megatron_gspo.cli import parse_args
from megatron_gspo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(
    r"`|^\(|^\$|\[|\.\.\.|^[A-Z][A-Z0-9_]*(\.[a-z]+)?$|=[A-Z][A-Z0-9_]*$|^[A-Z_]+/"
)
LAUNCHERS = ("launch/torchrun.sh", "launch/slurm/train.sbatch")


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of the indented and fenced code, continuation lines joined."""
    out: list[tuple[int, str]] = []
    fenced = False
    pending: tuple[int, str] | None = None
    for i, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or raw.startswith("    ")):
            pending = None
            continue
        line = raw.split("  # ")[0].strip()
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.rstrip("\\").strip())
        else:
            pending = (i, line.rstrip("\\").strip())
        if not line.endswith("\\"):
            out.append(pending)
            pending = None
    return out


def cli_argv(command: str) -> list[str] | None:
    """The megatron-gspo arguments of a shell command line (None: not one)."""
    try:
        words = shlex.split(os.path.expandvars(command))
    except ValueError:
        return None
    for k, w in enumerate(words):  # one command of a list: up to `&&`, `;`, `|` or `&`
        if w in ("&", "&&", ";", "|", "||"):
            words = words[:k]
            break
    for j, w in enumerate(words):
        if w.endswith("megatron-gspo") and j + 1 < len(words) and not words[j + 1].startswith("-"):
            if j and words[j - 1] in ("-t", "build"):  # `docker build -t megatron-gspo .`
                continue
            return words[j + 1 :]
        if w == "megatron_gspo" and j and words[j - 1] == "-m":
            return words[j + 1 :]
        if w.endswith(LAUNCHERS):  # (as a container's --entrypoint: the image's name follows)
            return ["train", *words[j + (2 if words[j - 1] == "--entrypoint" else 1) :]]
    return None


def documented() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for line, command in code_lines(doc.read_text()):
            argv = cli_argv(command)
            if argv is not None and not any(PLACEHOLDER.search(w) for w in argv):
                found.append((f"{doc.relative_to(ROOT)}:{line}", argv))
    return found


COMMANDS = documented()


def test_the_documents_show_commands_of_every_kind():
    kinds = {argv[0] for _, argv in COMMANDS}
    assert {"train", "study", "convert", "make-task-model", "report"} <= kinds, kinds
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_its_config_loads(where, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands are written for the repository's root
    try:
        args = parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `megatron-gspo {' '.join(argv)}` is refused by the CLI ({e})")
    if args.command == "train":
        load_config(args.config, args.overrides)
    elif args.command == "study":
        plan_study(args, tmp_path, monkeypatch)


def plan_study(args, tmp_path: Path, monkeypatch) -> None:
    """Plan a study where the documents' make-task-model commands have made their models: a
    model.path the study is given must exist (only its config's own is made by the study)."""
    from megatron_gspo.study import overrides, plan

    monkeypatch.chdir(tmp_path)
    for _, argv in COMMANDS:
        if argv[0] == "make-task-model" and "--out" in argv:
            (tmp_path / argv[argv.index("--out") + 1]).mkdir(parents=True, exist_ok=True)
    config = ROOT / args.config
    table = plan.algo_table(fallback=config.parent, base=config, arms=plan.split_names(args.algos))
    plan.build_study(config, tmp_path / "study", plan.parse_algos(args.algos, table),
                     args.seeds, args.overrides, args.steps, table,
                     overrides.parse_sweep(args.sweep))  # fmt: skip


NAMED = re.compile(
    r"(?<![\w/.-])((?:scripts|configs|bench|launch|tools)/[\w./-]+\.(?:sh|py|yaml|sbatch))"
)


def test_every_file_a_document_names_exists():
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc in DOCS
               for name in set(NAMED.findall(doc.read_text())) if not (ROOT / name).exists()]  # fmt: skip
    assert not missing, missing
