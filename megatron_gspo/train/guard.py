"""The non-finite guard: a step whose loss or gradient norm is not finite is skipped; too many
in a row end the run with an error that names the cause. It decides on the step's typed
`Update`s and the rollout side's counts of non-finite inputs (train/results.py), never on
metrics."""

from __future__ import annotations

import logging

import numpy as np

from megatron_gspo.errors import UserError
from megatron_gspo.train.results import Update
from megatron_gspo.train.samples import NONFINITE_INPUTS

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """A step whose loss or gradient norm is not finite has its update skipped (actor) and
    writes no checkpoint; `limit` such steps in a row end the run with an error (the last
    checkpoint is from before them) that names the step's inputs that were not finite
    (advantages, the servers' log-probs: train/samples.py), or else points at the update's
    size. Every rank sees the same reduced loss and norm."""

    def __init__(self, limit: int):
        self.limit, self.in_row = limit, 0
        self.inputs: dict[str, int] = {}  # non-finite inputs over the steps in a row

    def check(self, step: int, updates: list[Update], inputs: dict[str, int]) -> bool:
        """Whether the step's `updates` were all finite (the step's non-finite `inputs`, by
        name, are kept for the error)."""
        bad = _not_finite(updates)
        if not bad and all(u.finite for u in updates):
            self.in_row, self.inputs = 0, {}
            return True
        self.in_row += 1
        for key, n in inputs.items():
            self.inputs[key] = self.inputs.get(key, 0) + n
        what = ", ".join(f"{k} {v}" for k, v in bad.items()) or "a non-finite gradient"
        named = _inputs(inputs)
        log.warning("step %d: %s%s; its update was skipped (%d in a row)", step, what,
                    f", with {named} not finite" if named else "", self.in_row)  # fmt: skip
        self.last = (step, what)
        return False

    def stop_if_over(self) -> None:
        """After the step's metrics are logged: the error, once `limit` steps in a row failed."""
        if self.in_row < self.limit:
            return
        step, what = self.last
        inputs = _inputs(self.inputs)
        if inputs:
            fix = (f"the cause is the steps' inputs, not the learning rate: {inputs} were not "
                   "finite (advantages: rewards too large for them, where "
                   "algo.adv_norm=none keeps the rewards' scale, so scale the rewards "
                   "down; log-probs: check the rollout servers); fix that")  # fmt: skip
        else:
            fix = "lower optim.lr (or optim.clip_grad), check the data and rewards"
        raise UserError(
            f"training is not finite: {self.in_row} steps in a row up to step {step} had "
            f"{what}; their updates were skipped and no checkpoint was written since; {fix}, "
            f"then --resume from the last checkpoint (the limit is "
            f"train.max_nonfinite_steps={self.limit})"
        )


def _not_finite(updates: list[Update]) -> dict[str, float]:
    """The step's loss and gradient norm (means over its updates, as logged) where not finite."""
    if not updates:
        return {}
    loss = sum(u.loss for u in updates) / len(updates)
    norm = sum(u.grad_norm for u in updates) / len(updates)
    return {k: v for k, v in (("loss/policy", loss), ("grad_norm", norm)) if not np.isfinite(v)}


def _inputs(counts: dict[str, int]) -> str:
    """The inputs counted as not finite: "3 advantages and 2 rollout log-probs"."""
    return " and ".join(f"{int(counts[k])} {name}" for k, name in NONFINITE_INPUTS.items()
                        if counts.get(k))  # fmt: skip
