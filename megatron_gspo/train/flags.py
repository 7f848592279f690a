"""`train`'s own flags checked against each other and the config before anything starts, by
`megatron-gspo train` (cli.py) and by launch/plan.py for the launch scripts: no torch here."""

from __future__ import annotations

from megatron_gspo.errors import UserError

ALLOW_WITHOUT_RESUME = (
    "--allow-config-change applies only with --resume; add --resume to continue the run with "
    "this config, or leave the flag out to start a new run"
)


def check_steps(steps: int | None, train_steps: int) -> None:
    """--steps stops a run earlier than train.steps, never later: the learning-rate schedule
    and the step the run ends at are train.steps' (a larger --steps used to stop at train.steps
    without a word)."""
    if steps is not None and steps > train_steps:
        raise UserError(
            f"--steps {steps} is past train.steps {train_steps}; set train.steps={steps} to "
            "train longer (--steps only stops a run before train.steps)"
        )
