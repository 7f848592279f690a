"""A resumed run with no step left to train says so in one line (train/hooks.py), naming the
limit that stops it and how to train on (it used to print nothing and exit 0)."""

from pathlib import Path

import pytest

from megatron_gspo.train.hooks import nothing_to_train

pytestmark = pytest.mark.unit

RUN = Path("runs/x")


def test_steps_left_or_a_fresh_run_say_nothing():
    assert nothing_to_train(RUN, step=3, last=40, total=40) is None
    assert nothing_to_train(RUN, step=0, last=0, total=40) is None  # --steps 0: step 0's eval


def test_a_run_at_train_steps_names_train_steps():
    assert nothing_to_train(RUN, step=40, last=40, total=40) == (
        "runs/x is at step 40 of 40 (train.steps): nothing to train; pass train.steps=N with "
        "N > 40 to train on"
    )
    # resumed with a smaller train.steps than it ran to
    assert nothing_to_train(RUN, step=40, last=20, total=20).startswith(
        "runs/x is at step 40, past step 20 (train.steps): nothing to train; "
    )


def test_a_run_stopped_by_steps_names_steps():
    # (the loop trains to min(train.steps, --steps): --steps alone cannot go past train.steps)
    assert nothing_to_train(RUN, step=2, last=2, total=40) == (
        "runs/x is at step 2 of 2 (--steps): nothing to train; pass --steps N with N > 2 "
        "(up to train.steps=40), or leave --steps out, to train on"
    )
    assert nothing_to_train(RUN, step=12, last=5, total=10) == (
        "runs/x is at step 12, past step 5 (--steps): nothing to train; pass train.steps=N with "
        "N > 12 and leave --steps out to train on"
    )
