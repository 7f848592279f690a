"""The non-finite guard's error names the step's inputs that were not finite (advantages from
huge rewards, the servers' log-probs) instead of always pointing at the learning rate."""

import math

import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.sample import Sample
from megatron_gspo.train.guard import NonFiniteGuard
from megatron_gspo.train.results import Update
from megatron_gspo.train.samples import nonfinite_inputs

pytestmark = pytest.mark.unit

NAN_STEP = [Update(finite=False, applied=False, grad_norm=math.nan, loss=math.nan)]
FINE_STEP = [Update(finite=True, applied=True, grad_norm=1.0, loss=0.1)]


def _stop(guard: NonFiniteGuard, steps: list[tuple[list[Update], dict]]) -> str:
    for k, (updates, inputs) in enumerate(steps, 1):
        assert guard.check(k, updates, inputs) is False
    with pytest.raises(UserError) as e:
        guard.stop_if_over()
    return str(e.value)


def test_the_error_names_the_inputs_that_were_not_finite():
    inputs = {"advantages": 8, "logprobs": 3}
    message = _stop(NonFiniteGuard(2), [(NAN_STEP, inputs), (NAN_STEP, inputs)])
    assert "2 steps in a row up to step 2 had loss/policy nan, grad_norm nan" in message
    assert (
        "the cause is the steps' inputs, not the learning rate: 16 advantages and 6 rollout "
        "log-probs were not finite"
    ) in message
    assert "lower optim.lr" not in message and "train.max_nonfinite_steps=2" in message


def test_without_such_inputs_the_error_still_points_at_the_update():
    message = _stop(NonFiniteGuard(1), [(NAN_STEP, {})])
    assert "lower optim.lr (or optim.clip_grad)" in message and "inputs" not in message


def test_a_finite_step_between_starts_the_count_again():
    guard = NonFiniteGuard(2)
    guard.check(1, NAN_STEP, {"advantages": 8})
    assert guard.check(2, FINE_STEP, {}) is True
    message = _stop(guard, [(NAN_STEP, {}), (NAN_STEP, {})])
    assert "lower optim.lr" in message


def test_an_update_that_reports_itself_not_finite_fails_the_step():
    """A finite loss and norm, but the optimizer found the gradients not finite."""
    bad = [Update(finite=False, applied=False, grad_norm=1.0, loss=0.1)]
    message = _stop(NonFiniteGuard(1), [(bad, {})])
    assert "had a non-finite gradient" in message


def test_nonfinite_inputs_counts_advantages_and_the_model_s_log_probs():
    samples = [Sample(0, 0, [1], [2, 3], logprobs=[-0.5, -math.inf], finish_reason="stop"),
               Sample(0, 1, [1], [2, 3, 4], logprobs=[None, math.nan, -1.0])]  # fmt: skip
    adv = torch.tensor([1.0, math.inf], dtype=torch.float64)
    assert nonfinite_inputs(samples, adv) == {"advantages": 1, "logprobs": 2}
    assert nonfinite_inputs([], torch.zeros(2)) == {}
