"""What the parts of a step hand each other: typed results, on which the loop decides.

The rollout side returns a `Collected` (the batch, the weight versions its samples came from,
how many were stale or generated again, how long generation took); the actor's update returns an
`Update` (finite or not, applied or skipped, its gradient norm, its statistics). The loop, the
rollouts generated ahead (ahead.py) and the non-finite guard read these fields only; each
result's `metrics` dict is derived for logging and never read back to decide anything (renaming
a metric cannot switch a decision off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_gspo.train.batch import StepBatch


@dataclass
class Collected:
    batch: StepBatch | None  # rank 0's whole batch (None elsewhere; everywhere when it is empty)
    metrics: dict  # for logging
    rows: int = 0  # the batch's rows, on every rank (0: every group was dropped)
    # weight versions (indices) of the trained samples: the oldest any started on, the mean
    # over the model's tokens (None: no sample was kept)
    version_oldest: float | None = None
    version_mean: float | None = None
    samples: int = 0  # the samples generated
    stale_samples: int = 0  # samples from weights older than the generation's (a restart)
    stale_version: str = ""  # the weight_version one of those named (for an error)
    unwritten: int = 0  # samples no weights wrote (episodes failed before their first turn)
    regenerated_samples: int = 0  # stale samples generated again (loop.collect_current)
    generation_s: float = 0.0  # seconds until the generation ended (not the reward wait)
    # the samples' inputs that were not finite, by what the guard's error calls them
    nonfinite_inputs: dict[str, int] = field(default_factory=dict)

    @property
    def all_stale(self) -> bool:
        """Every sample weights wrote came from weights older than its generation's (none to
        train on: the others are failed episodes)."""
        return bool(self.stale_samples) and self.stale_samples == self.samples - self.unwritten

    def set_versions(self, oldest: float, mean: float, partial: float) -> None:
        """The trained samples' weight versions (train/samples.sample_versions), logged too."""
        self.version_oldest, self.version_mean = oldest, mean
        self.metrics |= {"rollout/version_oldest": oldest, "rollout/version_mean": mean,
                         "rollout/partial_fraction": partial}  # fmt: skip

    def set_nonfinite_inputs(self, counts: dict[str, int]) -> None:
        """The samples' non-finite inputs by name (train/samples.nonfinite_inputs), logged."""
        self.nonfinite_inputs = counts
        self.metrics |= {f"input/nonfinite_{k}": float(n) for k, n in counts.items()}


@dataclass
class Update:
    """One optimizer step of the actor. `finite`: its loss and gradient norm were finite;
    `applied`: the optimizer changed the weights (megatron skips a non-finite step)."""

    finite: bool
    applied: bool
    grad_norm: float
    loss: float
    stats: dict = field(default_factory=dict)  # the step's statistics (for logging)

    @property
    def ok(self) -> bool:
        return self.finite and math.isfinite(self.loss) and math.isfinite(self.grad_norm)
