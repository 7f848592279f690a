"""Reading a YAML file the user gave (a run config, the config a run saved): a syntax error is
one line naming the file, the line and column where the parser stopped (yaml's problem_mark),
what it found there and what to fix, not a traceback or a bare "while parsing a block mapping".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.errors import UserError, first_line

# (words in yaml's problem, what to fix), the first that matches; else FIX
HINTS = (
    ("'\\t'", "indent with spaces, not tabs"),
    ("that cannot start any token", "quote the value (a plain one cannot start with @ or `)"),
    ("found undefined alias", "quote the value (a plain one starting with * names an alias)"),
    (
        "mapping values are not allowed",
        "indent the keys of a section alike; quote a value with ': '",
    ),
    ("expected <block end>", "indent the keys of a section alike; start each list item with '- '"),
    ("could not find expected ':'", "write each key as `key: value`, indented alike"),
    ("expected ',' or ']'", "close the list with ] (quote an item that holds , [ ] or :)"),
    ("expected ',' or '}'", "close the mapping with } (quote a value that holds , { } or :)"),
    ("found unexpected end of stream", "close the quoted string"),
)
FIX = "fix the YAML there (indent with spaces; quote a value that holds ': ', ' #', [ ] { })"


def read_yaml(path: str | Path) -> Any:
    """The value of the YAML file `path`; a file that is not valid YAML is the UserError."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = "" if mark is None else f", line {mark.line + 1}, column {mark.column + 1}"
        raise UserError(f"{path}{at}: not valid YAML: {problem(e)}; {fix(e)}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: not UTF-8; an integer of > 4300 digits
        raise UserError(f"{path} is not valid YAML: {first_line(e)}") from None


def problem(e: yaml.MarkedYAMLError) -> str:
    """What the parser found, and what it was reading when that began elsewhere."""
    said = e.problem or e.context or type(e).__name__
    mark, start = e.problem_mark, e.context_mark
    if e.problem and e.context and start is not None and mark is not None:
        if (start.line, start.column) != (mark.line, mark.column):
            said += (
                f" ({e.context} that starts at line {start.line + 1}, column {start.column + 1})"
            )
    return said


def fix(e: yaml.MarkedYAMLError) -> str:
    """What to change where the parser stopped."""
    said = e.problem or ""
    return next((hint for words, hint in HINTS if words in said), FIX)
