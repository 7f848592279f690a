"""Which configs are a study's arms (plan.py reads their rows).

An arm is a name with a config of the family: PREFIX_<arm>.yaml beside the base config
(configs/drift_moe_*.yaml), else configs/tiny_moe_<arm>.yaml. Not every file of a family is an
arm: configs/ also holds tiny_moe_gspo_lora.yaml (LoRA) and tiny_moe_calc_tool_*.yaml (another
task), which differ from their family in more than the algorithm. The arms a study offers
(`available_arms`, named in the error for an arm without a config) are the configs that agree
with their family everywhere outside an arm's row (`ALGO_KEYS`, `REWARD_KEYS`).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_gspo.config import Config, build
from megatron_gspo.config_renames import rename_keys
from megatron_gspo.errors import UserError
from megatron_gspo.yaml_io import read_yaml


def repository_configs() -> Path:
    """The repository's configs/: beside the package in a checkout (or an editable install),
    else $MEGATRON_GSPO_HOME/configs (the image sets it: its `pip install .` copies the package
    alone into site-packages)."""
    here = Path(__file__).resolve().parents[2] / "configs"
    home = os.environ.get("MEGATRON_GSPO_HOME")
    return Path(home) / "configs" if home and not here.is_dir() else here


CONFIGS_DIR = repository_configs()
ALGOS = ("gspo", "grpo", "grpo_r2", "grpo_r3")  # the default arms
# The keys of a config's `algo` section that make an algorithm; the schedule (minibatches) and
# everything else stay the base config's, shared by every arm.
ALGO_KEYS = ("loss", "clip_low", "clip_high", "agg", "norm_length", "sapo_tau_pos",
             "sapo_tau_neg", "adv_norm", "routing_replay", "mismatch", "mismatch_level",
             "tis_cap", "tis_reduce", "mis_low", "mis_high", "icepop_k",
             "dynamic_sampling")  # fmt: skip
REWARD_KEYS = ("overlong_buffer", "overlong_penalty")  # (a row's `reward.<key>`)
TINY_PREFIX = "tiny_moe"  # configs/tiny_moe_<arm>.yaml


def family(base: Path, arms: tuple[str, ...] | list[str] = ALGOS) -> list[Path] | None:
    """PREFIX_<arm>.yaml for every arm when `base` is PREFIX_<something>.yaml and all of them
    exist beside it (the longest such PREFIX); else None."""
    stem, parent = Path(base).stem, Path(base).parent
    for prefix in reversed(_prefixes(stem)):
        paths = [parent / f"{prefix}_{name}.yaml" for name in arms]
        if all(p.is_file() for p in paths):
            return paths
    return None


def available_arms(base: Path | None, configs_dir: Path = CONFIGS_DIR) -> list[str]:
    """The arms with a config: those of configs/tiny_moe_*.yaml (the largest set that agree
    outside an arm's row), and those of the base config's family (the files beside it that
    agree with it there; of its prefixes, the one with the most, of equals the longest)."""
    tiny = _members(configs_dir, TINY_PREFIX)
    names = set(max(_groups(tiny), key=len, default=[]))
    if base is not None and Path(base).is_file():
        like = outside_row(Path(base))
        best: list[str] = []
        for prefix in _prefixes(Path(base).stem):  # (shortest first: a tie keeps the longer)
            mine = [n for n, s in _members(Path(base).parent, prefix).items() if s == like]
            best = mine if len(mine) >= len(best) else best
        if len(best) > 1:  # (the base alone is no family)
            names |= set(best)
    return sorted(names)


def outside_row(path: Path) -> dict | None:
    """A config's settings outside an arm's row: the resolved config (its defaults filled in)
    without `algo.<ALGO_KEYS>` and `reward.<REWARD_KEYS>`. None for a file that is not a config."""
    try:
        raw = read_yaml(path) or {}
        settings = build(Config, rename_keys(raw, str(path), quiet=True), "").to_dict()
    except (OSError, UserError, TypeError, ValueError, AttributeError):
        return None
    settings["algo"] = {k: v for k, v in settings["algo"].items() if k not in ALGO_KEYS}
    settings["reward"] = {k: v for k, v in settings["reward"].items() if k not in REWARD_KEYS}
    return settings


def _prefixes(stem: str) -> list[str]:
    """The PREFIX of every PREFIX_<name> split of `stem`, shortest first."""
    return [stem[:i] for i, c in enumerate(stem) if c == "_"]


def _members(parent: Path, prefix: str) -> dict[str, dict]:
    """{name: settings outside the row} of the configs PREFIX_<name>.yaml in `parent`."""
    found = {p.stem[len(prefix) + 1 :]: outside_row(p) for p in parent.glob(f"{prefix}_*.yaml")}
    return {name: s for name, s in sorted(found.items()) if s is not None}


def _groups(members: dict[str, dict]) -> list[list[str]]:
    """The names of `members` grouped by equal settings."""
    groups: list[tuple[dict, list[str]]] = []
    for name, settings in members.items():
        group = next((g for s, g in groups if s == settings), None)
        if group is None:
            groups.append((settings, group := []))
        group.append(name)
    return [g for _, g in groups]
