"""Verifiable rewards: exact answers for the built-in tasks, math answers, or the user's function.

A reward function is fn(prompt, response_text, answer) -> float, 1.0 for a right answer and 0.0
for a wrong one (the built-in ones return exactly these); a plugin may be `async def`. Training
scores it in bounded worker processes, a failure ending its sample alone (rewards/scoring.py);
`score_rewards` calls it here, on a batch of the built-in tasks (the warm start), and turns what
can go wrong into a one-line UserError; `dynamic_sampling_keep` drops the groups that carry no
learning signal.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.rewards.exact import exact_answer
from megatron_gspo.rewards.math_answer import math_answer
from megatron_gspo.rewards.overlong import overlong_shaped
from megatron_gspo.rewards.plugin import load_plugin

RewardFn = Callable[[str, str, str], float]
BUILTIN: dict[str, RewardFn] = {"exact": exact_answer, "math": math_answer}

__all__ = [
    "Failure",
    "RewardFn",
    "Scored",
    "load_reward",
    "score_rewards",
    "dynamic_sampling_keep",
    "overlong_shaped",
]


def load_reward(spec: str) -> RewardFn:
    """ "exact", "math", or a plugin "module:function" / "file.py:function"."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise UserError(
            f"unknown reward {spec!r}; use exact, math, or module:function for your own"
        )
    return load_plugin(spec)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _score(fn: RewardFn, item: tuple[str, str, str], i: int, name: str) -> float:
    prompt, response, answer = item
    try:
        value = fn(prompt, response, answer)
    except Exception as e:
        raise UserError(
            f"reward {name!r} raised {type(e).__name__}: {e} on item {i} (prompt "
            f"{_short(prompt)!r}); fix the reward function"
        ) from e
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(
            f"reward {name!r} returned {_short(repr(value))} ({type(value).__name__}) on "
            f"item {i} (prompt {_short(prompt)!r}); it must return a finite number"
        )
    return float(value)


def score_rewards(fn: RewardFn, items: list[tuple[str, str, str]], name: str) -> list[float]:
    """[float(fn(prompt, response, answer)) for each item]; any failure is a UserError."""
    return [_score(fn, item, i, name) for i, item in enumerate(items)]


@dataclass(frozen=True)
class Failure:
    """Why a sample failed, in one line, and the log that has it with its traceback (None: no
    log has it)."""

    line: str
    log: Path | None = None


@dataclass
class Scored:
    """Rewards of a batch where a failure ends its item alone: `rewards[i]` is None where the
    function failed on it (rewards/scoring.py); `errors[i]` says why item i failed (None: it did
    not), also where it still has a reward: 0 for an episode whose environment failed after the
    model's first turn (train/generate.py)."""

    rewards: list[float | None]
    errors: list[Failure | None]

    @property
    def failed(self) -> list[int]:
        """The items without a reward (their groups are dropped)."""
        return [i for i, v in enumerate(self.rewards) if v is None]

    @property
    def failures(self) -> list[str]:
        """Why each item without a reward has none, one line each."""
        return [e.line if (e := self.errors[i]) is not None else "" for i in self.failed]

    @property
    def all_failed(self) -> bool:
        """Every item failed, whatever the stage: nothing of the batch is worth training on."""
        return bool(self.errors) and all(e is not None for e in self.errors)

    def logs_text(self, items: list[int]) -> str:
        """The end of a line about the failures of `items`: "; LOG has each, with its traceback",
        naming the logs that have them ("" where none does)."""
        found = [e.log for i in items if (e := self.errors[i]) is not None]
        logs = list(dict.fromkeys(log for log in found if log is not None))
        if not logs:
            return ""
        verb = "has" if len(logs) == 1 else "have"
        return f"; {' and '.join(map(str, logs))} {verb} each, with its traceback"


def dynamic_sampling_keep(rewards: list[float], group_size: int) -> list[int]:
    """Indices of the groups to keep: group g (rewards[g*G:(g+1)*G]) is kept when
    max(group) > min(group). A group whose rewards are all equal has zero advantage everywhere
    (A_i = r_i - mean(r) = 0) and only dilutes the batch."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = [rewards[g : g + group_size] for g in range(0, len(rewards), group_size)]
    return [k for k, group in enumerate(groups) if max(group) > min(group)]
