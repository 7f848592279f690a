"""docs/config.md, docs/metrics.md and the flag tables of docs/commands.md are what
`python -m megatron_gspo.docs_gen` writes from the config dataclasses, the metric definitions and
the CLI's parser: stale (a key or flag added, renamed, its default or comment changed) fails here."""

import argparse
import dataclasses
import os
import re
import typing

import pytest

from megatron_gspo import docs_commands, docs_gen
from megatron_gspo.cli import build_parser, parse_args
from megatron_gspo.config import Config
from megatron_gspo.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("path", list(docs_gen.PAGES), ids=lambda p: p.name)
def test_generated_pages_are_fresh(path):
    assert path.read_text() == docs_gen.PAGES[path](), (
        f"{path.name} is stale: run python -m megatron_gspo.docs_gen"
    )


def test_metric_families_and_unknown_keys():
    from megatron_gspo.train.metric_defs import definition, undefined

    assert definition("routing/changed_fraction/layer_12") == "the same in MoE layer i"
    assert definition("routing/changed_fraction/layer_x") is None
    assert undefined({"step": 1, "reward/mean": 0.5, "reward/mean2": 1}) == ["reward/mean2"]


def test_the_glossary_defines_no_key_metrics_jsonl_lacks():
    """ratio/max_minus_1 is computed by the study's figures (study/figures.py), and
    rollout/tokens is turned into tokens_per_s before the row is written (train/hooks.py):
    docs/metrics.md listed both as metrics.jsonl keys."""
    from megatron_gspo.train.metric_defs import definition

    assert definition("ratio/max_minus_1") is None
    assert definition("rollout/tokens") is None
    assert "rollout/tokens" not in docs_gen.metrics_md()


def test_an_enum_or_literal_type_shows_its_allowed_values():
    """algo.agg (`Agg | None`) showed as "megatron_gspo.algo.config.Agg \\| None"."""
    from megatron_gspo.algo.config import AGGS, Agg

    assert docs_gen.type_text(Agg | None) == " | ".join([*AGGS, "None"])
    assert docs_gen.type_text(typing.Optional[Agg]) == " | ".join([*AGGS, "None"])  # noqa: UP045
    assert docs_gen.type_text(typing.Literal["a", "b"] | None) == "a | b | None"
    assert docs_gen.type_text(int | None) == "int | None"
    assert docs_gen.type_text(list[str]) == "list"
    rows = [x.split(" | ") for x in docs_gen.config_md().splitlines() if x.startswith("| `")]
    assert dict((r[0], r[1]) for r in rows)["| `algo.agg`"] == " \\| ".join([*AGGS, "None"])
    assert not [r[0] for r in rows if "megatron_gspo." in r[1]]  # no Python type name leaks


def test_every_key_of_every_section_is_on_the_page():
    text = docs_gen.config_md()
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        if not dataclasses.is_dataclass(cls):
            assert f"| `{section.name}` |" in text
            continue
        for f in dataclasses.fields(cls):
            assert f"| `{section.name}.{f.name}` |" in text, f"{section.name}.{f.name}"


def test_a_fields_comment_is_its_meaning():
    @dataclasses.dataclass
    class Example:
        a: int = 1  # trailing
        # above, line one
        # line two
        b: str = "x"
        c: bool = False

    notes = docs_gen.field_comments(Example)
    assert notes == {"a": "trailing", "b": "above, line one line two", "c": ""}


def command_blocks(text: str) -> dict[str, list[list[str]]]:
    """{command: its table's rows, each a list of cells} of a commands.md text."""
    blocks: dict[str, list[list[str]]] = {}
    command = None
    for line in text.splitlines():
        if line.startswith("<!-- flags: "):
            command = line.removeprefix("<!-- flags: ").removesuffix(" -->")
            blocks[command] = []
        elif line == docs_commands.END:
            command = None
        elif command is not None and line.startswith("| ") and not line.startswith("| flag |"):
            blocks[command].append([c.strip() for c in line.strip("|").split(" | ")])
    return blocks


def parser_commands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command of the CLI (`convert`'s by their direction), from the subparsers."""
    out = {}
    top = build_parser()
    for name, sub in subparser_choices(top).items():
        inner = subparser_choices(sub)
        out.update({f"{name} {n}": p for n, p in inner.items()} if inner else {name: sub})
    return out


def subparser_choices(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in p._actions if a.nargs == argparse.PARSER), {})


def test_every_flag_of_every_command_is_in_its_table():
    blocks = command_blocks(docs_commands.COMMANDS_MD.read_text())
    commands = parser_commands()
    assert set(blocks) == set(commands)
    for name, p in commands.items():
        shown = {w.strip("`,") for row in blocks[name] for w in row[0].split() if "--" in w}
        wanted = {o for a in p._actions for o in a.option_strings if o not in ("-h", "--help")}
        assert shown == wanted, name


def test_a_tables_defaults_are_what_the_parser_gives():
    """What argparse fills in when a flag is left out, against the page: make-tiny-model's
    float32, no dense layers (None: not given, TinySpec's default), untied; report's --out
    optional."""
    blocks = command_blocks(docs_commands.COMMANDS_MD.read_text())
    tiny = vars(parse_args(["make-tiny-model", "--out", "m"]))
    rows = {row[0].split()[0].strip("`"): row[1] for row in blocks["make-tiny-model"]}
    assert rows["--dtype"] == f"`{tiny['dtype']}`" == "`float32`"
    assert rows["--dense-layers"] == "(none)" and tiny["dense_layers"] is None  # (TinySpec: [])
    assert rows["--tie-embeddings"] == "off" and tiny["tie_embeddings"] is False
    assert rows["--hidden"] == f"`{tiny['hidden']}`"
    report = vars(parse_args(["report", "runs/a"]))
    rows = {row[0].split()[0].strip("`"): row[1] for row in blocks["report"]}
    assert rows["--out"] == f"`{report['out']}`" == "`report.png`"


def test_a_stale_commands_page_is_caught(tmp_path, monkeypatch, capsys):
    page = tmp_path / "commands.md"
    fresh = docs_commands.COMMANDS_MD.read_text()
    stale = fresh.replace("| `--steps N` |", "| `--steps N` | (none) | gone |\n| `--old` |", 1)
    assert stale != fresh
    page.write_text(stale)
    monkeypatch.setattr(docs_gen, "PAGES", {page: lambda: docs_commands.fill(
        page.read_text(), docs_commands.tables())})  # fmt: skip
    assert docs_gen.main(["--check"]) == 1
    assert "commands.md is stale" in capsys.readouterr().err
    assert docs_gen.main([]) == 0
    assert page.read_text() == fresh  # rewritten: the prose kept, the table the parser's


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda t: t.replace("<!-- flags: score -->\n", "", 1), "no flags block for score"),
        (lambda t: t + "\n<!-- flags: scor -->\n<!-- end flags -->\n", "not a command"),
        (lambda t: t + "\n<!-- flags: score -->\n", "two flags blocks"),
        (lambda t: t.rsplit(docs_commands.END, 1)[0], "has no `<!-- end flags -->`"),
    ],
    ids=["missing", "unknown", "twice", "unclosed"],
)
def test_a_broken_flags_block_is_one_error(edit, says):
    text = edit(docs_commands.COMMANDS_MD.read_text())
    with pytest.raises(UserError, match=re.escape(says)):
        docs_commands.fill(text, docs_commands.tables())


def test_env_read_defaults_do_not_reach_the_page(monkeypatch):
    plain = docs_commands.tables()
    monkeypatch.setenv("MEGATRON_GSPO_API_KEY", "secret-key")
    monkeypatch.setenv("MEGATRON_GSPO_DECODE_KERNEL", "torch")
    assert docs_commands.tables() == plain
    assert os.environ["MEGATRON_GSPO_API_KEY"] == "secret-key"  # put back after
