"""docs/config.md is what `python -m megatron_gspo.docs_gen` writes from the config dataclasses:
stale (a key added, renamed, its default or comment changed) fails here."""

import dataclasses
import typing

import pytest

from megatron_gspo import docs_gen
from megatron_gspo.config import Config

pytestmark = pytest.mark.unit


def test_config_md_is_fresh():
    assert docs_gen.CONFIG_MD.read_text() == docs_gen.config_md(), (
        "docs/config.md is stale: run python -m megatron_gspo.docs_gen"
    )


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
