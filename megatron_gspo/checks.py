"""The config checks every section uses: one line naming the key and what it accepts.

`in_range` is the one check of a number: finite (no NaN or inf) and within the bounds given.
Every integer of the config is also a 64-bit one (`INT_MAX`), every float one that a 32-bit
float holds (0, or a magnitude in [FLOAT32_TINY, FLOAT32_MAX]: the step computes in fp32, where
1e39 is inf and 1e-320 is 0) and every duration at most `MAX_SECONDS`, so no value overflows
where it is used (torch, numpy, timedelta, thread waits)."""

from __future__ import annotations

import math

from megatron_gspo.errors import UserError

INT_MAX = 2**63 - 1  # torch and numpy integers are 64-bit
# The longest wait a duration key may ask for (about 31 years): below what thread waits
# (threading.TIMEOUT_MAX, about 292 years) and timedelta accept, so "no limit" is a big number.
MAX_SECONDS = 1e9
# The shortest limit on one call into the user's code (reward.timeout_s, env.timeout_s): sending
# a call to its worker and reading the answer alone take about a millisecond, so 1e-9 would time
# out every call (and replace its worker each time) rather than bound anything.
MIN_CALL_SECONDS = 0.01
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 magnitude


def need(value, key: str, what: str) -> None:
    if not value:
        raise UserError(f"{key} is required: {what}")


def choice(value, key: str, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key} must be one of {', '.join(map(str, choices))}, not {show(value)}")


def plugin_spec(value: str, key: str, names: tuple[str, ...], what: str) -> None:
    """`value` is one of the built-in `names` or names the user's code: module:name or
    file.py:name, both parts given (`what`: what the name is, "function")."""
    module, _, attr = value.rpartition(":")
    if value not in names and not (module.strip() and attr.strip()):
        builtins = ", ".join(names)
        raise UserError(f"{key} {show(value)} is neither {builtins} nor module:{what} (or "
                        f"file.py:{what}); write it as one of those")  # fmt: skip


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
    if ok and not is_int and not (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
        raise UserError(
            f"{key} must be a number a 32-bit float holds (0, or a magnitude in "
            f"[1.2e-38, 3.4e38]), not {show(value)}"
        )
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
    raise UserError(f"{key} must be {what}, not {show(value)}")


def seconds(value, key: str, at_least: float | None = None) -> None:
    """A duration: a finite number of seconds > 0 (or >= `at_least`), at most MAX_SECONDS."""
    if at_least is None:
        in_range(value, key, 0, MAX_SECONDS, lo_open=True)
    else:
        in_range(value, key, at_least, MAX_SECONDS)


def show(value) -> str:
    """A value for a one-line message: a long integer by its digit count, anything else cut."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        try:
            return f"a {len(str(abs(value)))}-digit integer"
        except ValueError:  # past Python's limit on printing integers
            return "an integer of over 4300 digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bound(x: float | None) -> str:
    return str(x) if x is None or isinstance(x, int) else format(x, "g")
