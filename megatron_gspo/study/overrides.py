"""What a study's command line sets besides its arms: overrides for every run (`key=value`) or
one arm's (`ARM:key=value`), and the sweep (`--sweep KEY=v1,v2`), with what they may not set: the
seed (the study's --seeds), a key an arm's row sets (the arm would run another arm's algorithm under
its own name), or one sweep point twice under two spellings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import load_config
from megatron_gspo.config_renames import RENAMED, renamed
from megatron_gspo.errors import UserError


@dataclass(frozen=True)
class Sweep:
    """`--sweep KEY=v1,v2,...`: one config key, the values every arm runs at."""

    key: str
    values: tuple[str, ...]

    def point(self, value: str) -> str:
        return f"{self.key}={value}"


def parse_sweep(text: str | None) -> Sweep | None:
    if text is None:
        return None
    key, sep, values = text.partition("=")
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not key.strip() or not vals:
        raise UserError(f"--sweep {text!r}: write it as KEY=v1,v2 (one config key, its values)")
    if len(set(vals)) != len(vals):
        raise UserError(f"--sweep {text!r} names a value twice; list each once")
    if key.strip() == "seed":
        raise UserError("--sweep seed=...: the study sets the seed; use --seeds N")
    return Sweep(key.strip(), vals)


def split_overrides(items: list[str], algos: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`key=value` (every run) and `ALGO:key=value` (that algorithm's runs)."""
    common: list[str] = []
    per_algo: dict[str, list[str]] = {a: [] for a in algos}
    for item in items:
        key = item.partition("=")[0]
        if ":" in key:
            algo, _, rest = item.partition(":")
            if algo not in per_algo:
                raise UserError(
                    f"override {item!r}: {algo!r} is not in --algos ({', '.join(algos)})"
                )
            per_algo[algo].append(rest)
        else:
            common.append(item)
    for item in common + [o for v in per_algo.values() for o in v]:
        if item.partition("=")[0].strip() == "seed":
            raise UserError(f"override {item!r}: the study sets the seed; use --seeds N")
    return common, per_algo


def arm_keys(table: dict[str, dict], algos: list[str]) -> set[str]:
    """The dotted config keys that the arms' rows set: what makes one arm differ from another."""
    return {k if "." in k else f"algo.{k}" for a in algos for k in table[a]}


def check_arm_keys(keys: set[str], common: list[str], sweep: Sweep | None) -> None:
    """An override for every run or a sweep of a key that an arm sets would run an arm under
    its name with another arm's settings (a "gspo" arm with algo.loss=grpo): refused, naming
    the per-arm spelling instead."""
    for item in common:
        key, _, value = item.partition("=")
        hit = _arm_key(key.strip(), value.strip(), keys)
        if hit:
            raise UserError(
                f"override {item!r}: {hit} is set by each arm (its config's row); set it for "
                f"one arm with ARM:{key.strip()}=value, or choose the arms with --algos"
            )
    hit = _arm_key(sweep.key, sweep.values[0], keys) if sweep else None
    if sweep and hit:
        raise UserError(
            f"--sweep {sweep.key}=...: {hit} is set by each arm (its config's row); compare its "
            f"values as arms with --algos (a config of the family each), or set it for one arm "
            f"with ARM:{sweep.key}=value"
        )


def _arm_key(key: str, value: str, keys: set[str]) -> str | None:
    """The arm key that override `key=value` sets (under its name now, for an earlier name; a
    whole section sets all of its keys), or None."""
    names = {key}
    if key in RENAMED:
        names = {RENAMED[key], *renamed(key, value)}
    hits = sorted(k for k in keys for n in names if k == n or k.startswith(n + "."))
    return hits[0] if hits else None


def check_distinct(config: Path, common: list[str], sweep: Sweep) -> None:
    """Two sweep values that make the same config (1e-4 and 0.0001) would run one point twice
    under two names: refused."""
    seen: dict[str, str] = {}
    for value in sweep.values:
        resolved = json.dumps(load_config(config, [*common, sweep.point(value)]).to_dict(),
                              sort_keys=True, default=str)  # fmt: skip
        if resolved in seen:
            raise UserError(f"--sweep {sweep.key}: {seen[resolved]} and {value} are the same "
                            "value; list each once")  # fmt: skip
        seen[resolved] = value
