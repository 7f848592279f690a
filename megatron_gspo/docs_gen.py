"""The reference pages generated from the code: docs/config.md from the config dataclasses,
docs/metrics.md from the metric definitions (train/metric_defs.py), and the flag tables of
docs/commands.md from the command line's parser (docs_commands.py; its prose is hand-written).

Each key's line in docs/config.md comes from its field in the code: the type as annotated, the
default, and the comment written beside the field (a trailing `# ...`, or the comment lines just
above it). A section's own docstring opens its table. So the page cannot drift from the code:
`tests/unit/test_generated_docs.py` fails when a file differs from what this writes.

    python -m megatron_gspo.docs_gen            # rewrite the pages
    python -m megatron_gspo.docs_gen --check    # exit 1 when one is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

from megatron_gspo.docs_commands import COMMANDS_MD, commands_md
from megatron_gspo.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CONFIG_MD = ROOT / "docs" / "config.md"
METRICS_MD = ROOT / "docs" / "metrics.md"

HEADER = """# Config reference

Generated from the config dataclasses by `python -m megatron_gspo.docs_gen`; do not edit by hand
(a test fails when this page is stale). A run's config is a YAML file of these sections; any key
can be set on the command line as `section.key=value` (read as YAML: `3`, `true`, `[a, b]`,
`null`). Every value is checked when the config is built: an unknown key names the nearest valid
one, a value out of range names the key and what it accepts.
"""


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} from the class body's source: the trailing comment on the
    field's line, else the comment lines right above it."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if head not in names or not line.startswith("    ") or line.startswith("     "):
            continue
        text = comments.get(i, "")
        if not text or text.startswith("fmt:") or text.startswith("type:"):
            above, j = [], i - 1
            while j in comments and lines[j - 1].strip().startswith("#"):
                above.insert(0, comments[j])
                j -= 1
            text = " ".join(above)
        out[head] = text
    return out


def show_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    return str(value)


def type_text(t: object) -> str:
    """A field's type as the page shows it: an enum or Literal as its allowed values, each
    member of a union (`Agg | None`: "seq-mean-token-mean | ... | None") the same way."""
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return " | ".join(str(m.value) for m in t)
    if typing.get_origin(t) is typing.Literal:
        return " | ".join(
            str(a.value if isinstance(a, enum.Enum) else a) for a in typing.get_args(t)
        )
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(t))
    if t is type(None):
        return "None"
    text = t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)
    return str(text).replace("typing.", "")


def show_type(f: dataclasses.Field, hints: dict) -> str:
    return type_text(hints.get(f.name, f.type)).replace("|", "\\|")


def section_table(name: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    out = [f"## `{name}`", ""]
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(cls.__name__ + "("):  # not dataclass's generated signature
        out += [doc.split("\n\n")[0].replace("\n", " "), ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name.startswith("_"):
            continue
        note = notes.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{name}.{f.name}` | {show_type(f, hints)} | `{show_default(f)}` | {note} |")
    return [*out, ""]


def config_md() -> str:
    import typing

    from megatron_gspo.config import Config

    hints = typing.get_type_hints(Config)
    top = [f for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(hints[f.name])]
    lines = [HEADER, "## Top level", "", "| key | type | default |", "|---|---|---|"]
    lines += [f"| `{f.name}` | {show_type(f, hints)} | `{show_default(f)}` |" for f in top]
    lines.append("")
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            lines += section_table(f.name, hints[f.name])
    return "\n".join(lines + renamed_table()).rstrip() + "\n"


def renamed_table() -> list[str]:
    """The earlier key names still read (config_renames.RENAMED), each with its name now."""
    from megatron_gspo.config_renames import RENAMED, RESPELLED

    out = ["## Renamed keys", "",
           "An earlier name still loads, as its new key, with a one-line notice; it will be "
           "removed. Giving it together with its new key is an error.", "",
           "| earlier key | key now | how a value reads now |", "|---|---|---|"]  # fmt: skip
    for old, new in RENAMED.items():
        how = RESPELLED[old].__doc__ if old in RESPELLED else None
        note = " ".join((how or "the same value").split()).replace("|", "\\|")
        out.append(f"| `{old}` | `{new}` | {note} |")
    return [*out, ""]


def metrics_md() -> str:
    from megatron_gspo.train import metric_defs

    doc = metric_defs.__doc__ or ""
    lines = ["# Metrics", "",
             "Generated from `megatron_gspo/train/metric_defs.py` by `python -m "
             "megatron_gspo.docs_gen`; do not edit by hand. Each step writes one JSON object to "
             "`RUN_DIR/metrics.jsonl` (and TensorBoard, W&B with `logging.wandb`); a key that "
             "does not apply to a run is absent.", "",
             doc.split("\n\n")[1].replace("\n", " "), ""]  # fmt: skip
    for group, defs in metric_defs.GROUPS.items():
        lines += [f"## {group}", "", "| key | meaning |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in defs.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


PAGES = {CONFIG_MD: config_md, METRICS_MD: metrics_md, COMMANDS_MD: commands_md}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    a = ap.parse_args(argv)
    try:
        pages = {path: make() for path, make in PAGES.items()}
    except UserError as e:  # a page's hand-written part is wrong: nothing is written
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = 0
    for path, text in pages.items():
        if a.check:
            if not (path.is_file() and path.read_text() == text):
                print(f"{path} is stale: run python -m megatron_gspo.docs_gen", file=sys.stderr)
                stale = 1
            continue
        path.write_text(text)
        print(f"wrote {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
