"""The run config: typed nested dataclasses, read from YAML plus dotted command-line overrides.

    cfg = load_config("configs/tiny_moe_gspo.yaml", ["algo.loss=grpo", "train.steps=5"])

Every key is checked when the config is built: an unknown key is an error that suggests the
nearest valid one, a value of the wrong type or out of range is an error naming the key and what
it accepts. Every number goes through one check, `_in_range`: finite (no NaN or inf) and within
the bounds its section gives. A section is its component's own config dataclass (`optim`: model/optim.py), or builds it
(`algo.loss_config()`, `sync.build()`) from defaults defined once there; modes are StrEnums.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.algo.config import Agg, LossConfig, LossKind, Tis
from megatron_gspo.checks import choice as _choice
from megatron_gspo.checks import in_range as _in_range
from megatron_gspo.checks import need as _need
from megatron_gspo.checks import positive as _positive
from megatron_gspo.errors import UserError
from megatron_gspo.model.optim import OptimConfig
from megatron_gspo.rollout.modes import Backend, Placement
from megatron_gspo.routing.replay import ReplayMode
from megatron_gspo.weight_sync.config import SyncConfig, SyncMethod


@dataclass
class ModelSection:
    path: str = ""  # HF checkpoint directory (the starting policy)
    dtype: str = "float32"  # float32 | bfloat16
    recompute: bool = False  # full activation recompute in the training forward

    def check(self) -> None:
        _need(self.path, "model.path", "the HF checkpoint directory to start from")
        _choice(self.dtype, "model.dtype", ("float32", "bfloat16"))


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None

    def check(self) -> None:
        for name in ("tp", "pp", "ep", "vpp", "etp"):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), f"parallel.{name}")


@dataclass
class DataSection:
    train: str = "builtin:arith"  # builtin:<task> or a .jsonl / .parquet file
    eval: str | None = None  # default: the train source's eval split
    template: str = "{prompt}"
    max_prompt_tokens: int = 256

    def check(self) -> None:
        _need(self.train, "data.train", "builtin:<task> or a .jsonl/.parquet path")
        if "{prompt}" not in self.template:
            raise UserError("data.template must contain {prompt}")
        _positive(self.max_prompt_tokens, "data.max_prompt_tokens")


SERVER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RolloutSection:
    backend: Backend = Backend.BUILTIN
    servers: int = 1  # servers the trainer starts and supervises (when urls is empty)
    urls: list[str] = field(default_factory=list)  # servers started by someone else
    # the node (the launcher's node index) each of `urls` runs on; with sync.method=tensor, servers
    # on several nodes get their buckets through a trainer rank on their own node (a relay).
    # launch/torchrun.sh sets it, and tells each trainer rank its node (MEGATRON_GSPO_NODE_RANK)
    url_nodes: list[int] = field(default_factory=list)
    # sglang-router in front of `urls`: generation goes through it (it balances the requests);
    # weight syncs, health checks and memory release still address every server in `urls`
    router_url: str | None = None
    placement: Placement = Placement.COLOCATED
    # colocated on GPUs: servers free their memory while the trainer trains (SGLang needs
    # --enable-memory-saver) and take it back before the weight sync
    release_memory: bool = False
    server_tp: int = 1
    sglang_python: str | None = None  # python of SGLang's own environment
    extra_server_args: list[str] = field(default_factory=list)
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    health_timeout_s: float = 300.0
    # rollout.urls (and router_url) that refuse every connection this long end the run at once:
    # nothing listens there. Raise it when the servers start along with the trainer
    connect_grace_s: float = 15.0
    # the servers' numerics (null: the checkpoint's dtype). bfloat16 against an fp32 trainer
    # opens the train-inference gap real engines have: log-probs and MoE routing then differ
    # between rollout and trainer (what R3 and algo.tis address)
    dtype: str | None = None  # float32 | bfloat16 | float16
    # one /generate request per prompt group (a batch, each sample with its own rid and seed)
    # instead of one per sample: less per-request overhead (not through router_url: the router
    # takes one sampling_params per request)
    group_requests: bool = True
    # 1: the servers generate step k+1's batch while the trainer trains on step k's, which is
    # then one weight version old (algo.tis corrects for it); 0: synchronous. train/ahead.py
    max_staleness: int = 0

    def check(self) -> None:
        if self.dtype is not None:
            _choice(self.dtype, "rollout.dtype", SERVER_DTYPES)
        if not self.urls:
            _positive(self.servers, "rollout.servers")
        if self.url_nodes and len(self.url_nodes) != len(self.urls):
            raise UserError(
                f"rollout.url_nodes has {len(self.url_nodes)} entries for {len(self.urls)} "
                "rollout.urls; give the node index of each URL's server, in the same order"
            )
        for i, node in enumerate(self.url_nodes):
            _in_range(node, f"rollout.url_nodes[{i}]", 0)
        if self.router_url and not self.urls:
            raise UserError(
                "rollout.router_url needs rollout.urls: the servers behind the router (weight "
                "syncs go to each of them)"
            )
        if self.router_url and not self.router_url.startswith(("http://", "https://")):
            raise UserError(f"rollout.router_url must be an http(s) URL, got {self.router_url!r}")
        for name in ("server_tp", "group_size", "prompts_per_step", "max_new_tokens"):
            _positive(getattr(self, name), f"rollout.{name}")
        if self.group_size < 2:
            raise UserError("rollout.group_size must be >= 2 (group advantages need a spread)")
        _in_range(self.temperature, "rollout.temperature", 0)
        _in_range(self.top_p, "rollout.top_p", 0, 1, lo_open=True)
        for name in ("health_timeout_s", "connect_grace_s"):
            _in_range(getattr(self, name), f"rollout.{name}", 0, lo_open=True)
        _in_range(self.max_staleness, "rollout.max_staleness", 0, 1)
        if self.max_staleness and self.release_memory:
            raise UserError(
                "rollout.max_staleness 1 generates while the trainer trains, which "
                "rollout.release_memory (the servers' GPU memory lent to training) rules out; "
                "set one of them to 0, or place the servers on GPUs of their own"
            )


@dataclass
class RewardSection:
    fn: str = "exact"  # exact | math | module:function

    def check(self) -> None:
        _need(self.fn, "reward.fn", "exact, math or module:function")


_LOSS = LossConfig()  # the loss keys' defaults, defined once (algo/config.py)


@dataclass
class AlgoSection:
    loss: LossKind = _LOSS.kind
    clip_low: float = _LOSS.clip_low
    clip_high: float = _LOSS.clip_high
    agg: Agg | None = _LOSS.agg  # None: the loss's published aggregation
    minibatches: int = 4  # optimizer steps per rollout batch
    # The first update takes its old log-probs from its own forward (exact: the weights have not
    # moved yet), so the old-log-prob forward skips that minibatch. Not under r3.
    on_policy_first_update: bool = True
    routing_replay: ReplayMode = ReplayMode.NONE
    advantage_std_norm: bool = True  # False: Dr. GRPO (no division by the group std)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    # truncated importance sampling for the train-vs-rollout mismatch (off: none)
    tis: Tis = _LOSS.tis
    tis_cap: float = _LOSS.tis_cap

    def check(self) -> None:
        self.loss_config().check("algo")
        _positive(self.minibatches, "algo.minibatches")

    def loss_config(self) -> LossConfig:
        return LossConfig(
            self.loss, self.clip_low, self.clip_high, self.agg, self.tis, self.tis_cap
        )


@dataclass
class TrainSection:
    steps: int = 40
    micro_batch_size: int = 8
    eval_every: int = 5  # greedy eval on held-out prompts every N steps (0: never)
    eval_prompts: int = 64
    checkpoint_every: int = 10  # 0: only at the end
    keep_checkpoints: int = 2
    # a non-finite loss or grad norm skips the step's update; this many steps in a row end the run
    max_nonfinite_steps: int = 3

    def check(self) -> None:
        names = ("steps", "micro_batch_size", "eval_prompts", "keep_checkpoints")
        for name in (*names, "max_nonfinite_steps"):
            _positive(getattr(self, name), f"train.{name}")
        for name in ("eval_every", "checkpoint_every"):  # 0 turns it off
            _in_range(getattr(self, name), f"train.{name}", 0)


_SYNC = SyncConfig()  # the sync keys' defaults, defined once (weight_sync/config.py)


@dataclass
class SyncSection:
    """The keys of weight_sync's SyncConfig a run sets (the rest keep SyncConfig's defaults)."""

    method: SyncMethod = _SYNC.transport
    bucket_mb: float = _SYNC.bucket_mb
    verify_every: int = _SYNC.verify_every
    # the mean |server - trainer| probe log-prob a verification accepts (null: by the server's
    # dtype: 1e-4 for float32, 0.049 for float16, 0.39 for bfloat16; weight_sync/verify.py)
    verify_tolerance: float | None = _SYNC.tolerance
    keep_groups: bool = _SYNC.keep_groups  # distributed: keep each stage's group between syncs

    def check(self) -> None:
        self.build(Path("."))  # SyncConfig checks its values

    def build(self, run_dir: Path) -> SyncConfig:
        return SyncConfig(
            transport=self.method,
            bucket_mb=self.bucket_mb,
            verify_every=self.verify_every,
            tolerance=self.verify_tolerance,
            keep_groups=self.keep_groups,
            dir=str(run_dir / "weights") if self.method == SyncMethod.DISK else None,
        )


@dataclass
class LoggingSection:
    tensorboard: bool = True
    wandb: dict | None = None  # kwargs for wandb.init (project, name, ...); None: off
    console: bool = True


@dataclass
class Config:
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    sync: SyncSection = field(default_factory=SyncSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def check(self) -> None:
        _in_range(self.seed, "seed", 0, 2**63 - 1)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "check"):
                section.check()
        d = self.data
        if self.train.eval_every and d.eval is None and not d.train.startswith("builtin:"):
            raise UserError(
                "data.eval is required with a dataset file (only builtin tasks have a held-out "
                "split); set data.eval=FILE, or train.eval_every=0 to turn eval off"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.algo.minibatches:
            raise UserError(
                f"algo.minibatches ({self.algo.minibatches}) must divide the rollout batch "
                f"(rollout.prompts_per_step x rollout.group_size = {batch})"
            )

    def to_dict(self) -> dict:
        """Plain values (a mode as its string), as YAML and JSON write them."""
        return dataclasses.asdict(self, dict_factory=_plain)


# ---- loading --------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Config from a YAML file (None: defaults) with `key.sub=value` overrides applied in order."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found; pass --config FILE.yaml")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a mapping of config sections")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like key.sub=value")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else None)
    cfg = build(Config, raw, "")
    cfg.check()
    return cfg


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part} is not a section")
    node[parts[-1]] = value


def build(cls, raw: Any, where: str):
    """Build dataclass `cls` from a mapping, checking every key and value type."""
    if not isinstance(raw, dict):
        raise UserError(f"{where or 'config'} must be a mapping, not {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise UserError(f"unknown config key {full!r}{_suggest(key, names, where)}")
        values[key] = _convert(hints[key], value, full)
    return cls(**values)


def _suggest(key: str, names: list[str], where: str) -> str:
    near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    if not near:
        return f"; valid keys here: {', '.join(names)}"
    return f"; did you mean {(where + '.' if where else '') + near[0]!r}?"


def _plain(items: list[tuple[str, Any]]) -> dict:
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in items}


def _convert(hint, value: Any, key: str):
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        _choice(value, key, tuple(hint))
        return hint(value)
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, key)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, not {value!r}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, not {value!r}")
        return dict(value)
    return _scalar(hint, value, key)


def _scalar(hint, value: Any, key: str):
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key} must be true or false, not {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{key} must be an integer, not {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{key} must be a number, not {value!r}")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key} must be a string, not {value!r}")
    return value


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced from its directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
