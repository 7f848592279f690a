"""docs/commands.md's flag tables, generated from the command line's own parser
(`megatron_gspo.cli.build_parser()`), so no flag, default or help text can go missing or stale.

The page is hand-written prose with one generated block per (sub)command: the lines between

    <!-- flags: COMMAND -->        e.g. `train`, `convert hf-to-megatron`
    <!-- end flags -->

hold that command's table (flag, default, help) as `megatron-gspo COMMAND --help` has them. Every
command the parser has must have its block and every block must name a command; either mistake
is an error naming the fix. Defaults read from the environment (`MEGATRON_GSPO_*`) are shown as
they are with none of those variables set, so the page is the same on every machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from megatron_gspo.errors import UserError

COMMANDS_MD = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
BEGIN = re.compile(r"^<!-- flags: (?P<command>[a-z0-9 -]+?) -->$", re.MULTILINE)
END = "<!-- end flags -->"
ENV_PREFIX = "MEGATRON_GSPO_"  # the variables a flag's default may be read from
DEFAULT_GROUPS = ("positional arguments", "options", "optional arguments")  # argparse's own
Parsers = dict[str, argparse.ArgumentParser]


@contextlib.contextmanager
def env_defaults_unset() -> Iterator[None]:
    """Build parsers with no MEGATRON_GSPO_* variable set (restored after)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> Parsers:
    """{"train": its parser, "convert hf-to-megatron": ...}: every command that takes flags, a
    command with subcommands of its own (convert) by those."""
    found: Parsers = {}
    for action in parser._actions:
        if action.nargs == argparse.PARSER and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                found.update(subcommands(sub, full) or {full: sub})
    return found


def value_name(action: argparse.Action) -> str:
    """What a flag's value is called: its metavar, else N for a number, PATH for a path, else
    the name argparse's help gives it."""
    if action.metavar is not None:
        return str(action.metavar)
    if action.type is int:
        return "N"
    if action.type is float:
        return "X"
    return "PATH" if action.type is Path else action.dest.upper()


def flag_cell(action: argparse.Action) -> str:
    """`--steps N`, `--resume`, `RUN_DIR ...`; aliases after the first, without the value."""
    value = value_name(action)
    if not action.option_strings:
        many = action.nargs in ("*", "+")
        return f"`{value}{' ...' if many else ''}`"
    first, *aliases = action.option_strings
    shown = f"`{first}`" if action.nargs == 0 else f"`{first} {value}`"
    return ", ".join([shown, *(f"`{a}`" for a in aliases)])


def default_cell(action: argparse.Action) -> str:
    if not action.option_strings:  # (argparse marks a `*` positional required too)
        return "(required)" if action.nargs in (None, "+") else "(none)"
    if action.required:
        return "(required)"
    if action.nargs == 0:  # store_true / store_false: the flag is a switch
        return "off"
    value = action.default
    if value is None or value == [] or value == "":
        return "(none)"
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def help_cell(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own substitutions: %(default)s, %(prog)s, ...
        text = text % {**vars(action), "prog": prog}
    if action.choices and not isinstance(action.choices, dict):
        shown = ", ".join(f"`{c}`" for c in action.choices)
        text = f"{text}{'; ' if text else ''}one of {shown}"
    return " ".join(text.split()).replace("|", "\\|")


def flag_table(parser: argparse.ArgumentParser) -> list[str]:
    """The table of one command's arguments, grouped and ordered as its `--help` has them (`-h`
    left out); a group of its own (the parallel layout) opens with its title in bold."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and "-h" not in a.option_strings]  # fmt: skip
        if actions and group.title not in DEFAULT_GROUPS:
            rows.append(f"| **{group.title}** | | |")
        for action in actions:
            cells = flag_cell(action), default_cell(action), help_cell(action, parser.prog)
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def tables() -> dict[str, list[str]]:
    from megatron_gspo.cli import build_parser

    with env_defaults_unset():
        return {name: flag_table(p) for name, p in subcommands(build_parser()).items()}


def fill(text: str, generated: dict[str, list[str]]) -> str:
    """`text` with each flags block's lines replaced by its command's table."""
    out: list[str] = []
    seen: list[str] = []
    pos = 0
    for begin in BEGIN.finditer(text):
        command = begin["command"]
        if command in seen:
            raise UserError(f"{COMMANDS_MD.name} has two flags blocks for `{command}`; remove one")
        if command not in generated:
            raise UserError(f"{COMMANDS_MD.name}: a flags block names `{command}`, which is not a "
                            f"command (commands: {', '.join(generated)}); fix or remove it")  # fmt: skip
        end, after = text.find(END, begin.end()), BEGIN.search(text, begin.end())
        if end < 0 or (after is not None and after.start() < end):
            raise UserError(f"{COMMANDS_MD.name}: the flags block of `{command}` has no "
                            f"`{END}` line; add one after its table")  # fmt: skip
        out += [text[pos : begin.end()], "\n", "\n".join(generated[command]), "\n"]
        pos = end
        seen.append(command)
    missing = [c for c in generated if c not in seen]
    if missing:
        raise UserError(f"{COMMANDS_MD.name} has no flags block for {', '.join(missing)}: add "
                        f"`<!-- flags: {missing[0]} -->` and `{END}` where its flags belong")  # fmt: skip
    return "".join([*out, text[pos:]])


def commands_md() -> str:
    return fill(COMMANDS_MD.read_text(), tables())
