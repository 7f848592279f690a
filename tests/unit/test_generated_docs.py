"""docs/config.md and docs/metrics.md are what `python -m megatron_gspo.docs_gen` writes from the config dataclasses:
stale (a key added, renamed, its default or comment changed) fails here."""

import dataclasses
import typing

import pytest

from megatron_gspo import docs_gen
from megatron_gspo.config import Config

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
