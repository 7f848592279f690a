"""The run config: typed nested dataclasses, read from YAML plus dotted command-line overrides.

    cfg = load_config("configs/tiny_moe_gspo.yaml", ["algo.loss=grpo", "train.steps=5"])

Every key is checked when the config is built: an unknown key is an error that suggests the
nearest valid one, a value of the wrong type or out of range is an error naming the key and what
it accepts. Every number goes through one check, `_in_range`: finite (no NaN or inf) and within
the bounds its section gives. Each section builds the objects it configures (`OptimSection.build()` ...), so the
rest of the code never sees a loose dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.errors import UserError


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
    backend: str = "builtin"  # builtin | sglang
    servers: int = 1  # servers the trainer starts and supervises (when urls is empty)
    urls: list[str] = field(default_factory=list)  # servers started by someone else
    # the node (the launcher's node index) each of `urls` runs on; with sync.method=tensor, servers
    # on several nodes get their buckets through a trainer rank on their own node (a relay).
    # launch/torchrun.sh sets it, and tells each trainer rank its node (MEGATRON_GSPO_NODE_RANK)
    url_nodes: list[int] = field(default_factory=list)
    # sglang-router in front of `urls`: generation goes through it (it balances the requests);
    # weight syncs, health checks and memory release still address every server in `urls`
    router_url: str | None = None
    placement: str = "colocated"  # colocated | disaggregated
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

    def check(self) -> None:
        _choice(self.backend, "rollout.backend", ("builtin", "sglang"))
        if self.dtype is not None:
            _choice(self.dtype, "rollout.dtype", SERVER_DTYPES)
        _choice(self.placement, "rollout.placement", ("colocated", "disaggregated"))
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


@dataclass
class RewardSection:
    fn: str = "exact"  # exact | math | module:function

    def check(self) -> None:
        _need(self.fn, "reward.fn", "exact, math or module:function")


@dataclass
class AlgoSection:
    loss: str = "gspo"  # gspo | gspo_token | grpo
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    agg: str | None = None  # None: the loss's published aggregation
    minibatches: int = 4  # optimizer steps per rollout batch
    # The first update takes its old log-probs from its own forward (exact: the weights have not
    # moved yet), so the old-log-prob forward skips that minibatch. Not under r3.
    on_policy_first_update: bool = True
    routing_replay: str = "none"  # none | r2 | r3
    advantage_std_norm: bool = True  # False: Dr. GRPO (no division by the group std)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    # truncated importance sampling for the train-vs-rollout mismatch (off: none)
    tis: str = "none"  # none | token | sequence
    tis_cap: float = 2.0

    def check(self) -> None:
        from megatron_gspo.algo import AGGS, KINDS

        _choice(self.loss, "algo.loss", tuple(KINDS))
        if self.agg is not None:
            _choice(self.agg, "algo.agg", tuple(AGGS))
        _choice(self.routing_replay, "algo.routing_replay", ("none", "r2", "r3"))
        _in_range(self.clip_low, "algo.clip_low", 0, 1, lo_open=True, hi_open=True)
        _in_range(self.clip_high, "algo.clip_high", 0, lo_open=True)
        _positive(self.minibatches, "algo.minibatches")
        _choice(self.tis, "algo.tis", ("none", "token", "sequence"))
        _in_range(self.tis_cap, "algo.tis_cap", 1)

    def loss_config(self):
        from megatron_gspo.train.actor import LossConfig

        return LossConfig(
            self.loss, self.clip_low, self.clip_high, self.agg, self.tis, self.tis_cap
        )


@dataclass
class OptimSection:
    lr: float = 1e-6
    # per RL step: linear warmup from lr/warmup_steps to lr over the first warmup_steps steps,
    # then constant, or a linear / cosine decay to min_lr at train.steps
    warmup_steps: int = 0
    decay: str = "constant"  # constant | linear | cosine
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    distributed: bool = True  # megatron's distributed optimizer (state sharded over DP)

    def check(self) -> None:
        _in_range(self.lr, "optim.lr", 0, lo_open=True)
        _in_range(self.warmup_steps, "optim.warmup_steps", 0)
        _choice(self.decay, "optim.decay", ("constant", "linear", "cosine"))
        _in_range(self.min_lr, "optim.min_lr", 0, self.lr, hi_name="optim.lr")
        _in_range(self.weight_decay, "optim.weight_decay", 0)
        _in_range(self.clip_grad, "optim.clip_grad", 0)  # 0: no clipping
        for name in ("adam_beta1", "adam_beta2"):
            _in_range(getattr(self, name), f"optim.{name}", 0, 1, hi_open=True)
        _in_range(self.adam_eps, "optim.adam_eps", 0, lo_open=True)

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of RL step `step` (1-based) of a run of `total` steps."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "constant" or total <= self.warmup_steps:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / (total - self.warmup_steps))
        shape = 1 - done if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * done))
        return self.min_lr + (self.lr - self.min_lr) * shape

    def build(self):
        from megatron_gspo.train.actor import OptimConfig

        return OptimConfig(
            lr=self.lr,
            min_lr=self.min_lr,
            weight_decay=self.weight_decay,
            clip_grad=self.clip_grad,
            adam_beta1=self.adam_beta1,
            adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps,
            use_distributed_optimizer=self.distributed,
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


@dataclass
class SyncSection:
    method: str = "tensor"  # tensor | distributed | disk
    bucket_mb: float = 512.0
    verify_every: int = 0
    # the mean |server - trainer| probe log-prob a verification accepts (null: by the server's
    # dtype: 1e-4 for float32, 0.049 for float16, 0.39 for bfloat16; weight_sync/verify.py)
    verify_tolerance: float | None = None
    keep_groups: bool = True  # distributed: keep each stage's broadcast group between syncs

    def check(self) -> None:
        _choice(self.method, "sync.method", ("tensor", "distributed", "disk"))
        _in_range(self.bucket_mb, "sync.bucket_mb", 0, lo_open=True)
        _in_range(self.verify_every, "sync.verify_every", 0)  # 0: never
        if self.verify_tolerance is not None:
            _in_range(self.verify_tolerance, "sync.verify_tolerance", 0, lo_open=True)

    def build(self, run_dir: Path):
        from megatron_gspo.weight_sync.config import SyncConfig

        return SyncConfig(
            transport=self.method,
            bucket_mb=self.bucket_mb,
            verify_every=self.verify_every,
            tolerance=self.verify_tolerance,
            keep_groups=self.keep_groups,
            dir=str(run_dir / "weights") if self.method == "disk" else None,
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
    optim: OptimSection = field(default_factory=OptimSection)
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
        return dataclasses.asdict(self)


# ---- loading --------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
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


def _convert(hint, value: Any, key: str):
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


def _need(value, key: str, what: str) -> None:
    if not value:
        raise UserError(f"{key} is required: {what}")


def _choice(value, key: str, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key} must be one of {', '.join(map(str, choices))}, not {value!r}")


def _positive(value, key: str) -> None:
    _in_range(value, key, 1)


def _in_range(
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


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced from its directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
