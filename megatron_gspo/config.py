"""The run config: typed nested dataclasses, read from YAML plus dotted command-line overrides.

    cfg = load_config("configs/tiny_moe_gspo.yaml", ["algo.loss=grpo", "train.steps=5"])

Every key is checked when the config is built: an unknown key is an error that suggests the
nearest valid one, a value of the wrong type or out of range is an error naming the key and what
it accepts. Every number goes through one check, `checks.in_range`: finite (no NaN or inf) and within
the bounds its section gives. A section is its component's own config dataclass, which the
component takes as it is (`algo`: algo/config.py, `parallel`: model/parallel_config.py, `optim`:
model/optim.py, `sync`: weight_sync/config.py): one name per key, one set of defaults, one
`check()` per section (the checks across sections are `Config.check`'s). Modes are StrEnums. A key
renamed keeps loading under its earlier name (config_renames.RENAMED), with a one-line notice.
Nothing here imports torch: launch/plan.py loads a config before any node starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.checks import INT_MAX, choice, in_range, need, positive, show
from megatron_gspo.config_renames import rename_keys, rename_overrides, set_dotted
from megatron_gspo.errors import UserError, first_line
from megatron_gspo.model.lora_config import LoraConfig
from megatron_gspo.model.modes import DEFAULT_CHUNK_TOKENS, DEFAULT_KEEP_MB, GroupedGemm, Recompute
from megatron_gspo.model.optim import OptimConfig
from megatron_gspo.model.parallel_config import ParallelConfig
from megatron_gspo.rewards.config import RewardSection
from megatron_gspo.rollout.config import (
    EnvSection,
    RolloutSection,
    longest_prompt,
    longest_sequence,
)
from megatron_gspo.weight_sync.config import SyncConfig
from megatron_gspo.yaml_io import read_yaml


@dataclass
class ModelSection:
    # the starting policy: an HF checkpoint directory; a Megatron one (`convert hf-to-megatron`)
    # only with rollout.urls, as the servers train starts load HF weights (`convert megatron-to-hf`)
    path: str = ""
    dtype: str = "float32"  # float32 | bfloat16
    recompute: Recompute = Recompute.NONE  # activation recompute: none | selective | full
    moe_grouped_gemm: GroupedGemm = GroupedGemm.AUTO  # auto (GPU: grouped) | true | false
    lm_head_chunk: int = DEFAULT_CHUNK_TOKENS  # LM head tokens per chunk (0: whole logits)
    # A microbatch's chunked-head logits up to this size (MiB, per rank) are kept for the
    # backward instead of recomputed: faster, at that memory (0: always recompute)
    lm_head_keep_mb: int = DEFAULT_KEEP_MB

    def check(self) -> None:
        need(self.path, "model.path", "the HF checkpoint directory to start from")
        choice(self.dtype, "model.dtype", ("float32", "bfloat16"))
        in_range(self.lm_head_chunk, "model.lm_head_chunk", 0, INT_MAX)
        in_range(self.lm_head_keep_mb, "model.lm_head_keep_mb", 0, 1 << 30)


@dataclass
class DataSection:
    train: str = "builtin:arith"  # builtin:<task> or a .jsonl / .parquet file
    eval: str | None = None  # default: the train source's eval split
    template: str = "{prompt}"
    max_prompt_tokens: int = 256

    def check(self) -> None:
        need(self.train, "data.train", "builtin:<task> or a .jsonl/.parquet path")
        if "{prompt}" not in self.template:
            raise UserError("data.template must contain {prompt}")
        try:
            self.template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(
                f"data.template {show(self.template)} cannot be filled ({type(e).__name__}: "
                f"{e}); its only field is {{prompt}}, and literal braces are written {{{{ and }}}}"
            ) from None
        positive(self.max_prompt_tokens, "data.max_prompt_tokens")


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
    # pack whole sequences into microbatches of at most this many tokens (THD, no padding between
    # them; train/packing.py); false: rows of micro_batch_size, padded to the step's longest
    pack: bool = True
    max_tokens_per_microbatch: int = 8192  # (a longer sequence gets a microbatch of its own)

    def check(self) -> None:
        positive(self.max_tokens_per_microbatch, "train.max_tokens_per_microbatch")
        names = ("steps", "micro_batch_size", "eval_prompts", "keep_checkpoints")
        for name in (*names, "max_nonfinite_steps"):
            positive(getattr(self, name), f"train.{name}")
        for name in ("eval_every", "checkpoint_every"):  # 0 turns it off
            in_range(getattr(self, name), f"train.{name}", 0)


@dataclass
class LoggingSection:
    tensorboard: bool = True
    wandb: dict | None = None  # kwargs for wandb.init (project, name, ...); None: off
    console: bool = True


@dataclass
class Config:
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    env: EnvSection = field(default_factory=EnvSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0: full-weight training
    train: TrainSection = field(default_factory=TrainSection)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def check(self) -> None:
        """Each section's `check()`, then the checks across sections. Checks run here, once the
        tree is built (not in `__post_init__`): some need several sections, and a config is
        built from defaults before the keys a run must give (model.path) are in it."""
        in_range(self.seed, "seed", 0, INT_MAX)
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
        self.reward.check_limit(*self.length_limit())
        self.lora.check_layout(self.parallel.tp, self.parallel.etp)
        if self.model.moe_grouped_gemm == GroupedGemm.ON:  # auto is decided at build
            self.lora.experts_build(True, te=False)
        if self.rollout.temperature == 0:  # (eval samples greedily on its own)
            raise UserError(
                "rollout.temperature=0 samples greedily: every answer of a prompt's group is the "
                "same, so every group advantage is 0 and the run learns nothing; set "
                "rollout.temperature > 0 (1.0, the default; eval is greedy whatever it is)"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.algo.minibatches:
            raise UserError(
                f"algo.minibatches ({self.algo.minibatches}) must divide the rollout batch "
                f"(rollout.prompts_per_step x rollout.group_size = {batch})"
            )

    def length_limit(self) -> tuple[int, str]:
        """The most tokens a response may have after its prompt, and the key that sets it."""
        if self.env.fn is not None:  # an episode's tokens after the prompt
            return self.env.max_tokens, "env.max_tokens"
        return self.rollout.max_new_tokens, "rollout.max_new_tokens"

    def check_context(self, context: int, where: str) -> None:
        """A sequence (the longest prompt and what is generated after it) fits what SGLang 0.5.23
        serves in the model's context of `context` tokens (max_position_embeddings in `where`;
        the built-in server serves the same, and the trainer's position embeddings reach it):
        a prompt of at most `longest_prompt`, a prompt and its answer of at most
        `longest_sequence` (past it SGLang cuts max_new_tokens without a word). An episode's last
        turn may have all but one of its tokens as its prompt: those and the first prompt at
        most `longest_prompt` + 1."""
        prompt, top = self.data.max_prompt_tokens, longest_prompt(context)
        n, most = self.rollout.max_new_tokens, longest_sequence(context)
        limits = [("rollout.max_new_tokens", n, most, "a rollout", _CUT)]
        if self.env.fn is not None:  # an episode's tokens after the prompt
            limits.append(("env.max_tokens", self.env.max_tokens, top + 1, "an episode", _TURN))
        served = f"in the model's context of {context} tokens (max_position_embeddings in {where})"
        for key, after, limit, what, why in limits:
            if prompt + after > limit:
                raise UserError(
                    f"data.max_prompt_tokens ({prompt}) + {key} ({after}) = {prompt + after} "
                    f"tokens exceed the {limit} tokens {what} may hold {served}: {why}; "
                    f"{_context_fix(prompt, key, after, limit, top)}"
                )
        if prompt > top:
            raise UserError(
                f"data.max_prompt_tokens ({prompt}) exceeds the {top} tokens a prompt may hold "
                f"{served}: SGLang 0.5.23 refuses a prompt of context - 6 tokens or more; lower "
                f"data.max_prompt_tokens to at most {top}"
            )

    def to_dict(self) -> dict:
        """Plain values (a mode as its string), as YAML and JSON write them."""
        return dataclasses.asdict(self, dict_factory=_plain)


# why a rollout, and an episode, hold fewer tokens than the context (rollout/config.py)
_CUT = (
    "SGLang 0.5.23 ends a generation at context - 2 tokens with its prompt, whatever "
    "max_new_tokens asks"
)
_TURN = (
    "the last turn may have all but one of them in its prompt, and SGLang 0.5.23 takes a prompt "
    "of at most context - 7 tokens"
)


def _context_fix(prompt: int, key: str, n: int, limit: int, top: int) -> str:
    """What lowers a prompt budget `prompt` and `n` tokens after it (`key`) into `limit` tokens
    with the prompt at most `top`: each one down to what the other leaves, where it leaves at
    least one token (a prompt budget over `top` is lowered whatever `key` is)."""
    fixes = []
    if prompt <= top:
        fixes.append(f"{key} to at most {limit - prompt}")
    if min(limit - n, top) >= 1:
        fixes.append(f"data.max_prompt_tokens to at most {min(limit - n, top)}")
    if not fixes:
        return f"lower data.max_prompt_tokens and {key} to {limit} tokens together"
    return "lower " + " or ".join(fixes)


# ---- loading --------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Config from a YAML file (None: defaults) with `key.sub=value` overrides applied in order."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} not found; pass --config FILE.yaml")
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a mapping of config sections")
    told: set[str] = set()
    rename_keys(raw, str(path), told)
    for key, value in _overrides(overrides, told):
        set_dotted(raw, key, value)
    cfg = build(Config, raw, "")
    cfg.check()
    return cfg


def _overrides(items: Sequence[str], told: set[str]) -> list[tuple[str, Any]]:
    """(key, value) of each `key.sub=value` override, in order, earlier key names renamed."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {show(item)} must look like key.sub=value")
        pairs.append((key.strip(), value))
    return rename_overrides(pairs, _override_value, told)


def _override_value(key: str, text: str) -> Any:
    """The value of override `key=text`, read as YAML (`3`, `true`, `[a, b]`, `null`). For a
    string key, text that YAML cannot read as a string (`data.template={prompt}{x}`, invalid
    YAML or a mapping) is the string as written; for any other key it is an error naming it."""
    if not text.strip():
        return None
    hint = _hint(key)
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as e:
        if hint is None or hint is str:  # (an unknown key is named by `build`)
            return text
        if not isinstance(e, yaml.YAMLError):  # Python reads no integer of > 4300 digits
            raise UserError(f"{key} must be a number that fits, not {show(text)}") from None
        raise UserError(
            f"override {key}: {show(text)} is not valid YAML ({_yaml_problem(e)}); "
            "write the value as YAML, quoted if it holds : { } [ ] or #"
        ) from None
    if hint is str and isinstance(value, dict | list):
        return text
    return value


def _hint(key: str):
    """The type of dotted key `key` (str for an optional string), None for an unknown key."""
    hint: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hints = typing.get_type_hints(hint)
        if part not in hints:
            return None
        hint = hints[part]
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return inner[0] if typing.get_origin(hint) in _UNIONS and len(inner) == 1 else hint


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the parser found in an override's value, and at which character."""
    if not isinstance(e, yaml.MarkedYAMLError) or not e.problem:
        return first_line(e)
    mark = e.problem_mark
    return e.problem + ("" if mark is None else f" at character {mark.index + 1}")


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


_UNIONS = (typing.Union, types.UnionType)


def _convert(hint, value: Any, key: str):
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        value = getattr(hint, "coerce", lambda v: v)(value)  # a mode's YAML spellings
        choice(value, key, tuple(hint))
        return hint(value)
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, key)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, not {show(value)}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, not {show(value)}")
        return dict(value)
    return _scalar(hint, value, key)


def _scalar(hint, value: Any, key: str):
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{key} must be true or false, not {show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT_MAX:  # torch and numpy would overflow where it is used
                raise UserError(
                    f"{key} must be a 64-bit integer (|x| <= {INT_MAX}), not {show(value)}"
                )
            return value
        raise UserError(f"{key} must be an integer, not {show(value)}")
    if hint is float:
        try:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
                return float(value)
        except OverflowError:  # an integer beyond any float
            raise UserError(f"{key} must be a finite number, not {show(value)}") from None
        except ValueError:
            pass
        raise UserError(f"{key} must be a number, not {show(value)}")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key} must be a string, not {show(value)}")
    return value


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced from its directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
