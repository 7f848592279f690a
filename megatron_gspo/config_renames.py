"""The run config's renamed keys: RENAMED maps a key's earlier name to its name now.

A YAML file or an override that writes the earlier name loads as with the new one and prints one
line saying so (`config: 'algo.tis' is now 'algo.mismatch' ...; the old name will be removed`),
once per process.
The earlier and the new name given together with values that disagree (in one YAML file, or
among the overrides) are an error: which one is meant cannot be told. Given together with values
that agree they load (the config.yaml a run wrote before a rename lists both). An override of either name replaces the YAML file's
value, as overrides do. `tests/unit/test_config_renames.py` loads every entry both ways.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from megatron_gspo.algo.config import tis_as_mismatch
from megatron_gspo.errors import UserError

RENAMED: dict[str, str] = {
    "algo.tis": "algo.mismatch",  # algo.tis: L is algo.mismatch: tis, algo.mismatch_level: L
}
# The notices this process has printed: a command that loads configs several times (`study`
# loads its base config once per run it plans) says each once. Tests clear it.
NOTICES_PRINTED: set[str] = set()
# The renamed keys whose values are written differently now: old value -> {new key: value}.
RESPELLED: dict[str, Callable[[Any], dict[str, Any]]] = {"algo.tis": tis_as_mismatch}


def renamed(old: str, value: Any) -> dict[str, Any]:
    """{new key: value} for the earlier key `old` given `value`."""
    return RESPELLED[old](value) if old in RESPELLED else {RENAMED[old]: value}


def rename_keys(raw: dict, where: str, told: set[str] | None = None, quiet: bool = False) -> dict:
    """YAML mapping `raw` (of sections, changed in place) with each earlier key under its name
    now; `where` names the file in an error. `quiet`: no notice (a file the trainer wrote)."""
    for old in RENAMED:
        section, _, name = old.rpartition(".")
        node = raw.get(section)
        if not isinstance(node, dict) or name not in node:
            continue
        value = node.pop(name)
        moved = renamed(old, value)
        for key, new_value in moved.items():
            sec, _, new = key.rpartition(".")
            given = raw.get(sec)
            if isinstance(given, dict) and new in given and given[new] != new_value:
                raise UserError(_both(where, old, key))
            set_dotted(raw, key, new_value)
        if not quiet:
            tell(old, value, moved, told)
    return raw


def rename_overrides(
    pairs: Sequence[tuple[str, str]], value_of: Callable[[str, str], Any], told: set[str]
) -> list[tuple[str, Any]]:
    """(key, value) of each override (key, text), earlier keys under their names now; a value
    is `value_of(key, text)`, read as the key it sets (an earlier key respelled: as itself)."""
    given = dict(pairs)
    out: list[tuple[str, Any]] = []
    for key, text in pairs:
        if key not in RENAMED:
            out.append((key, value_of(key, text)))
            continue
        value = value_of(key if key in RESPELLED else RENAMED[key], text)
        moved = renamed(key, value)
        for new, new_value in moved.items():
            if new in given and value_of(new, given[new]) != new_value:
                raise UserError(_both("the overrides", key, new))
        out += moved.items()
        tell(key, value, moved, told)
    return out


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """raw[a][b] = value for key `a.b` (sections made as needed)."""
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part} is not a section")
    node[parts[-1]] = value


def _both(where: str, old: str, new: str) -> str:
    return (f"{where} set both {old!r} and {new!r}, which disagree; {old!r} is the earlier name "
            f"of {RENAMED[old]!r}: keep the new key(s) only")  # fmt: skip


def tell(old: str, value: Any, moved: dict[str, Any], told: set[str] | None = None) -> None:
    """The one line saying earlier key `old` (given `value`, read as `moved`) was read: once per
    key and load, each distinct line once per process, on rank 0 only."""
    if told is not None:
        if old in told:
            return
        told.add(old)
    spelled = ", ".join(f"{k}={v}" for k, v in moved.items()) or "nothing set"
    how = f" ({old}={value} reads as {spelled})" if old in RESPELLED else ""
    line = f"config: {old!r} is now {RENAMED[old]!r}{how}; the old name will be removed"
    if line in NOTICES_PRINTED or os.environ.get("RANK", "0") != "0":
        return
    NOTICES_PRINTED.add(line)
    print(line, file=sys.stderr, flush=True)
