"""The config checks every section uses: one line naming the key and what it accepts.

`in_range` is the one check of a number: finite (no NaN or inf) and within the bounds given."""

from __future__ import annotations

import math

from megatron_gspo.errors import UserError


def need(value, key: str, what: str) -> None:
    if not value:
        raise UserError(f"{key} is required: {what}")


def choice(value, key: str, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key} must be one of {', '.join(map(str, choices))}, not {value!r}")


def positive(value, key: str) -> None:
    in_range(value, key, 1)


def in_range(
    value,
    key: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    hi_name: str | None = None,
) -> None:
    """The one check of a numeric value: a finite number (an integer for an int field) within
    [lo, hi] (lo or hi excluded with lo_open / hi_open; None: no bound). `hi_name` names the key
    the upper bound comes from."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = is_int or (isinstance(value, float) and math.isfinite(value))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if ok:
        return
    what = "an integer" if is_int else "a finite number"
    low, high = _bound(lo), hi_name or _bound(hi)
    if lo is not None and hi is not None:
        what += f" in {'(' if lo_open else '['}{low}, {high}{')' if hi_open else ']'}"
    elif lo is not None:
        what += f" {'>' if lo_open else '>='} {low}"
    elif hi is not None:
        what += f" {'<' if hi_open else '<='} {high}"
    raise UserError(f"{key} must be {what}, not {value!r}")


def _bound(x: float | None) -> str:
    return str(x) if x is None or isinstance(x, int) else format(x, "g")
