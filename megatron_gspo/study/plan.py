"""What a study runs: the arm table, one run per (arm, sweep value, seed), and its record.

An arm is any name with a config of the family: for a base config PREFIX_<arm>.yaml with
PREFIX_<name>.yaml beside it for every arm asked for (configs/drift_moe_*.yaml), those files;
else configs/tiny_moe_<name>.yaml (the files are read, not copied), so the study compares exactly
what those configs run (which files of a family are arms: arms.py). An arm's row is its config's
`algo` keys that make an algorithm (the loss, its clip range and options, advantages, routing
replay, the mismatch correction) and its `reward.overlong_*` keys. A run's config is layered,
later wins:

    BASE.yaml < the arm's row < overrides for every run < `ARM:key=value` overrides
              < the sweep's KEY=value < seed=<k> (and model.path when the study made the model)

With `--sweep KEY=v1,v2` every arm runs at every value (DIR/runs/<arm>/<j>_<value>/seed<k>).
Neither an override for every run nor the sweep may set a key of an arm's row: the arm would run
another arm's algorithm under its own name (`ARM:key=value` sets one for one arm).

The study makes its starting model (DIR/model, `make-task-model`) only when the base config's own
model.path is missing and the config trains on a built-in task: what the shipped configs say to
make. A model.path given on the command line, or as a sweep value, must exist.

The base config is copied to DIR/base_config.yaml when the study starts and every run reads
that copy, so editing the source file mid-study cannot change the runs still to come. DIR/study.json
(record.py) records each run's resolved overrides, and the study as last run for --report-only.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gspo.algo.config import Mismatch, resolve_agg
from megatron_gspo.config import Config, load_config
from megatron_gspo.config_renames import rename_keys
from megatron_gspo.errors import UserError
from megatron_gspo.study.arms import (
    ALGO_KEYS,
    ALGOS,
    CONFIGS_DIR,
    REWARD_KEYS,
    available_arms,
    family,
)
from megatron_gspo.study.overrides import (
    Sweep,
    arm_keys,
    check_arm_keys,
    check_distinct,
    split_overrides,
)
from megatron_gspo.yaml_io import read_yaml

LEVEL = {"gspo": "sequence", "gspo_token": "sequence"}  # the rest: token
SNAPSHOT = "base_config.yaml"


@dataclass(frozen=True)
class RunSpec:
    algo: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]
    point: str | None = None  # the sweep's KEY=value of this run (None: no sweep)
    study_dir: Path | None = None  # (None: three levels above run_dir)
    steps: int | None = None  # its train.steps (None: the study's)

    @property
    def name(self) -> str:
        return f"{self.label}/seed{self.seed}"

    @property
    def label(self) -> str:
        """The arm, with the sweep point: what the report's tables and figures compare."""
        return self.algo if self.point is None else f"{self.algo} @ {self.point}"

    @property
    def train_config(self) -> Path:
        """The config file the runs read: the study's copy of the base config."""
        return (self.study_dir or self.run_dir.parents[2]) / SNAPSHOT


@dataclass
class Study:
    config: Path
    out: Path
    algos: dict[str, dict]  # name -> algo settings (the table row, with overrides applied)
    seeds: list[int]
    steps: int
    eval_every: int
    runs: list[RunSpec] = field(default_factory=list)
    common: list[str] = field(default_factory=list)
    made_model: Path | None = None
    sweep: Sweep | None = None


def algo_table(
    configs_dir: Path = CONFIGS_DIR,
    fallback: Path | None = None,
    base: Path | None = None,
    arms: list[str] | tuple[str, ...] = ALGOS,
) -> dict[str, dict]:
    """{arm: {loss, clip_low, ..., routing_replay[, reward.overlong_*]}} for each of `arms`,
    from the base config's family (`family`), else configs/tiny_moe_<name>.yaml (the
    repository's configs, else `fallback`: the base config's directory)."""
    table = {}
    siblings = family(base, arms) if base is not None else None
    for i, name in enumerate(arms):
        path = configs_dir / f"tiny_moe_{name}.yaml"
        if siblings is not None:
            path = siblings[i]
        elif not path.is_file() and fallback is not None:
            path = fallback / path.name
        if not path.is_file():
            have = ", ".join(available_arms(base, configs_dir))
            fix = (f"choose arms among {have}" if have else f"set MEGATRON_GSPO_HOME to the "
                   f"repository (no arm's config in {configs_dir})")  # fmt: skip
            raise UserError(f"{path} is missing: an arm's settings are read from its config of "
                            f"the family; add it, or {fix}")  # fmt: skip
        raw = rename_keys(read_yaml(path) or {}, str(path))
        algo, reward = raw.get("algo") or {}, raw.get("reward") or {}
        table[name] = {k: algo[k] for k in ALGO_KEYS if k in algo}
        table[name] |= {f"reward.{k}": reward[k] for k in REWARD_KEYS if k in reward}
        table[name] |= _unset(base, table[name])
    return table


def _unset(base: Path | None, row: dict) -> dict:
    """The arm's defaults for the keys its config leaves out and the base config sets (a
    cispo base's agg must not reach the gspo arm): the arm runs what its own config runs."""
    from megatron_gspo.algo.config import AlgoConfig
    from megatron_gspo.rewards.config import RewardSection

    raw = (read_yaml(base) or {}) if base and Path(base).is_file() else {}
    raw = rename_keys(raw, str(base))
    out = {}
    sections = (("algo", ALGO_KEYS, AlgoConfig(), ""),
                ("reward", REWARD_KEYS, RewardSection(), "reward."))  # fmt: skip
    for section, keys, defaults, prefix in sections:
        given = raw.get(section) or {}
        for k in keys:
            if k in given and prefix + k not in row:
                value = getattr(defaults, k)
                out[prefix + k] = value.value if isinstance(value, enum.Enum) else value
    return out


def split_names(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def parse_algos(text: str, table: dict[str, dict]) -> list[str]:
    names = split_names(text)
    unknown = [a for a in names if a not in table]
    if unknown or not names:
        raise UserError(f"--algos {text!r}: choose a comma-separated list of {', '.join(table)}")
    if len(set(names)) != len(names):
        raise UserError(f"--algos {text!r} names an algorithm twice; list each once")
    return names


def row_overrides(row: dict) -> list[str]:
    """`algo.<key>=<value>` (`reward.<key>=` for a dotted key) for a table row (strings bare,
    the rest as JSON, which YAML reads)."""
    return [f"{k if '.' in k else 'algo.' + k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in row.items()]  # fmt: skip


def build_study(
    config: Path,
    out: Path,
    algos: list[str],
    n_seeds: int,
    overrides: list[str],
    steps: int | None = None,
    table: dict[str, dict] | None = None,
    sweep: Sweep | None = None,
) -> Study:
    """Every run's overrides, each checked by loading its config (typos fail before any run)."""
    if n_seeds < 1:
        raise UserError(f"--seeds {n_seeds}: run at least one seed")
    table = table if table is not None else algo_table(arms=algos)
    common, per_algo = split_overrides(overrides, algos)
    check_arm_keys(arm_keys(table, algos), common, sweep)
    if steps is not None:
        common = [*common, f"train.steps={steps}"]
    base = load_config(config, common)
    study = Study(Path(config), Path(out), {}, [base.seed + i for i in range(n_seeds)],
                  base.train.steps, base.train.eval_every, common=common, sweep=sweep)  # fmt: skip
    points: list[tuple[str | None, list[str]]] = [(None, [])]
    if sweep:
        check_distinct(config, common, sweep)
        points = [(f"{j}_{_slug(v)}", [sweep.point(v)]) for j, v in enumerate(sweep.values)]
    for algo in algos:
        layered = [*row_overrides(table[algo]), *common, *per_algo[algo]]
        study.algos[algo] = _algo_settings(load_config(config, layered))
        for sub, at in points:
            run_cfg = load_config(config, layered + at)  # (checks the value)
            model = _starting_model(run_cfg, _sets_model(common + per_algo[algo] + at), study.out)
            study.made_model = model or study.made_model
            for seed in study.seeds:
                extra = [f"seed={seed}"] + ([f"model.path={model}"] if model else [])
                run_dir = study.out / "runs" / algo / (sub or "") / f"seed{seed}"
                study.runs.append(RunSpec(algo, seed, run_dir, tuple(layered + at + extra),
                                          at[0] if at else None, study.out,
                                          run_cfg.train.steps))  # fmt: skip
    study.steps = max(r.steps or 0 for r in study.runs)  # (a sweep of train.steps: the longest)
    # every arm at every sweep value per seed first; per value, every arm first
    order = {p: j for j, p in enumerate(sweep.point(v) for v in sweep.values)} if sweep else {}
    study.runs.sort(key=lambda r: (r.seed, order.get(r.point or "", 0), algos.index(r.algo)))
    return study


def _slug(value: str) -> str:
    """A directory name for a sweep value (a model path's last part, say)."""
    text = re.sub(r"[^A-Za-z0-9.=+-]+", "_", value.rstrip("/").rsplit("/", 1)[-1])
    return text[-40:] or "value"


def _algo_settings(cfg: Config) -> dict:
    a = cfg.algo
    return {
        "loss": a.loss,
        "level": LEVEL.get(a.loss, "token"),
        "clip_low": a.clip[0],
        "clip_high": a.clip[1],
        "agg": resolve_agg(a.loss, a.agg),
        "adv_norm": a.adv_norm,
        "mismatch": "/".join(a.correction) if a.correction[0] != Mismatch.NONE else "none",
        "overlong": cfg.reward.overlong_buffer,
        "routing_replay": a.routing_replay,
        "minibatches": a.minibatches,
        "lr": cfg.optim.lr,
    }


def _starting_model(cfg: Config, given: bool, out: Path) -> Path | None:
    """None when model.path exists. When it does not and it is the base config's own location
    of a built-in task's starting model (runs/task_model, runs/drift_model: what the configs
    say to make), DIR/model, made by `make-task-model` before the runs. A model.path given on
    the command line (or a sweep value) is not stood in for: a typo would train a tiny task
    model under the name of the real one; nor is a model for a data set of one's own."""
    from megatron_gspo.data.task_model import check_model_path

    path = cfg.model.path
    if Path(path).is_dir():
        return None
    if given or Path(path).exists() or not cfg.data.train.startswith("builtin:"):
        check_model_path(path, cfg.data.train)
    return (out / "model").resolve()


def _sets_model(overrides: list[str]) -> bool:
    return any(o.partition("=")[0].strip() in ("model.path", "model") for o in overrides)


def task_of(cfg_path: Path, common: list[str]) -> str:
    train = load_config(cfg_path, common).data.train
    return train.split(":", 1)[1] if train.startswith("builtin:") else "arith"
