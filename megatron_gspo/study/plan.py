"""What a study runs: the algorithm table, one run per (algorithm, seed), and its record.

The per-algorithm settings come from the `algo` sections of the base config's family: for a base
config named PREFIX_<algo>.yaml with every PREFIX_<name>.yaml beside it (configs/drift_moe_*.yaml),
those files; else configs/tiny_moe_<name>.yaml (the files are read, not copied), so the study
compares exactly what those configs run. A run's
config is layered, later wins:

    BASE.yaml < the algorithm's row < overrides for every run < `ALGO:key=value` overrides
              < seed=<k> (and model.path when the study made the starting model)

The base config is copied to DIR/base_config.yaml when the study starts and every run reads
that copy, so editing the source file mid-study cannot change the runs still to come. DIR/study.json
records each run's resolved overrides; a later invocation whose base config or settings differ for
a run that already started is refused instead of mixing two settings in one comparison.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gspo.config import Config, load_config
from megatron_gspo.errors import UserError

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
ALGOS = ("gspo", "grpo", "grpo_r2", "grpo_r3")
# The keys of a config's `algo` section that make an algorithm; the schedule (minibatches) and
# everything else stay the base config's, shared by every algorithm.
ALGO_KEYS = ("loss", "clip_low", "clip_high", "agg", "routing_replay")
LEVEL = {"gspo": "sequence", "gspo_token": "sequence", "grpo": "token"}
MANIFEST = "study.json"
SNAPSHOT = "base_config.yaml"


@dataclass(frozen=True)
class RunSpec:
    algo: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.algo}/seed{self.seed}"

    @property
    def train_config(self) -> Path:
        """The config file the runs read: the study's copy of the base config."""
        return self.run_dir.parents[2] / SNAPSHOT


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


def family(base: Path) -> list[Path] | None:
    """PREFIX_<name>.yaml for every algorithm when `base` is PREFIX_<algo>.yaml and all of them
    exist beside it; else None."""
    stem = Path(base).stem
    for algo in sorted(ALGOS, key=len, reverse=True):  # grpo_r2 before grpo
        if stem.endswith(f"_{algo}"):
            prefix = stem[: -len(algo) - 1]
            paths = [Path(base).parent / f"{prefix}_{name}.yaml" for name in ALGOS]
            return paths if all(p.is_file() for p in paths) else None
    return None


def algo_table(
    configs_dir: Path = CONFIGS_DIR, fallback: Path | None = None, base: Path | None = None
) -> dict[str, dict]:
    """{name: {loss, clip_low, clip_high, routing_replay[, agg]}} from the base config's family
    (`family`), else configs/tiny_moe_<name>.yaml (the repository's configs, else `fallback`:
    the base config's directory)."""
    table = {}
    siblings = family(base) if base is not None else None
    for i, name in enumerate(ALGOS):
        path = configs_dir / f"tiny_moe_{name}.yaml"
        if siblings is not None:
            path = siblings[i]
        elif not path.is_file() and fallback is not None:
            path = fallback / path.name
        if not path.is_file():
            raise UserError(f"{path} is missing: the study reads each algorithm's settings there")
        algo = (yaml.safe_load(path.read_text()) or {}).get("algo") or {}
        table[name] = {k: algo[k] for k in ALGO_KEYS if k in algo}
    return table


def parse_algos(text: str, table: dict[str, dict]) -> list[str]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in table]
    if unknown or not names:
        raise UserError(f"--algos {text!r}: choose a comma-separated list of {', '.join(table)}")
    if len(set(names)) != len(names):
        raise UserError(f"--algos {text!r} names an algorithm twice; list each once")
    return names


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


def row_overrides(row: dict) -> list[str]:
    """`algo.<key>=<value>` for a table row (strings bare, the rest as JSON, which YAML reads)."""
    return [f"algo.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in row.items()]


def build_study(
    config: Path,
    out: Path,
    algos: list[str],
    n_seeds: int,
    overrides: list[str],
    steps: int | None = None,
    table: dict[str, dict] | None = None,
) -> Study:
    """Every run's overrides, each checked by loading its config (typos fail before any run)."""
    if n_seeds < 1:
        raise UserError(f"--seeds {n_seeds}: run at least one seed")
    table = table if table is not None else algo_table()
    common, per_algo = split_overrides(overrides, algos)
    if steps is not None:
        common = [*common, f"train.steps={steps}"]
    base = load_config(config, common)
    study = Study(Path(config), Path(out), {}, [base.seed + i for i in range(n_seeds)],
                  base.train.steps, base.train.eval_every, common=common)  # fmt: skip
    model = _starting_model(base, study.out)
    for algo in algos:
        layered = [*row_overrides(table[algo]), *common, *per_algo[algo]]
        cfg = load_config(config, layered)
        study.algos[algo] = _algo_settings(cfg)
        for seed in study.seeds:
            extra = [f"seed={seed}"] + ([f"model.path={model}"] if model else [])
            run_dir = study.out / "runs" / algo / f"seed{seed}"
            study.runs.append(RunSpec(algo, seed, run_dir, tuple(layered + extra)))
    study.made_model = model
    study.runs.sort(key=lambda r: (r.seed, algos.index(r.algo)))  # every algorithm per seed first
    return study


def _algo_settings(cfg: Config) -> dict:
    a = cfg.algo
    return {
        "loss": a.loss,
        "level": LEVEL.get(a.loss, "token"),
        "clip_low": a.clip_low,
        "clip_high": a.clip_high,
        "routing_replay": a.routing_replay,
        "minibatches": a.minibatches,
        "lr": cfg.optim.lr,
    }


def _starting_model(cfg: Config, out: Path) -> Path | None:
    """None when model.path exists; else DIR/model, made by `make-task-model` before the runs."""
    if Path(cfg.model.path).exists():
        return None
    return (out / "model").resolve()


def task_of(cfg_path: Path, common: list[str]) -> str:
    train = load_config(cfg_path, common).data.train
    return train.split(":", 1)[1] if train.startswith("builtin:") else "arith"


# ---- DIR/study.json -------------------------------------------------------------------------


def check_manifest(study: Study) -> None:
    """Refuse to continue a run that was started with other settings; record the new ones and
    (re)write the base config's copy that the runs read."""
    path = study.out / MANIFEST
    old = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    sha = _sha(study.config)
    new = {r.name: {"overrides": list(r.overrides), "config_sha256": sha} for r in study.runs}
    started = [r for r in study.runs if r.run_dir.exists()]
    for run in started:
        before = old["runs"].get(run.name)
        if before is None or before == new[run.name]:
            continue
        changed = sorted(set(run.overrides) ^ set(before["overrides"]))
        what = ", ".join(changed) or f"{study.config} changed since"
        raise UserError(
            f"{run.run_dir} was started with other settings ({what}); "
            "pass a new --out, or delete that run directory to redo it"
        )
    record = {"config": str(study.config.resolve()), "runs": old["runs"] | new}
    _write_json(path, record)
    snapshot = study.out / SNAPSHOT
    if not started or not snapshot.is_file():
        _copy_atomic(study.config, snapshot)


def _copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.write_bytes(Path(src).read_bytes())
    os.replace(tmp, dst)


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
