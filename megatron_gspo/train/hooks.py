"""What happens around each RL step without cluttering the loop: greedy eval on held-out
prompts, the metrics sinks (rank 0), and checkpoints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_gspo.config import Config
from megatron_gspo.train import checkpointing
from megatron_gspo.train.state import TrainState

if TYPE_CHECKING:
    from megatron_gspo.train.metrics import MetricsLogger


class StepHooks:
    def __init__(self, cfg: Config, run_dir: Path, setup, rollouts):
        self.cfg, self.run_dir = cfg, run_dir
        self.setup, self.rollouts = setup, rollouts
        self.rank0 = dist.get_rank() == 0
        self.logger: MetricsLogger | None = None
        self.saved_step = -1
        self.last_finite = True

    def begin(self, state: TrainState, last: int) -> None:
        """Open the sinks (a resumed run's logger drops metrics of steps after its checkpoint). A
        fresh run logs step 0: the starting checkpoint's eval reward; a resumed run with no step
        left to train says so (`nothing_to_train`). `megatron-gspo train --resume` says it before
        anything starts (finished.py); this is the cover for what that does not see (a newest
        checkpoint that does not verify, resumed from an older one; a loop driven in-process)."""
        from megatron_gspo.train.metrics import MetricsLogger

        t = self.cfg.train
        if self.rank0:
            log = self.cfg.logging
            self.logger = MetricsLogger(
                self.run_dir,
                total_steps=max(last, state.step),
                start_step=state.step,
                tensorboard=log.tensorboard,
                wandb=log.wandb,
                console=log.console,
                config=self.cfg.to_dict(),
            )
        self.saved_step = state.step
        said = nothing_to_train(self.run_dir, state.step, last, t.steps)
        if self.rank0 and said is not None:
            print(said, flush=True)
        if state.step == 0 and t.eval_every:
            self._log(0, {"eval/reward": self.rollouts.evaluate(), "weight_version": 0})

    def end_step(
        self,
        step: int,
        metrics: dict,
        state: TrainState,
        t0: float,
        last: int,
        checkpoint: bool = True,
    ) -> None:
        """Eval, metrics, and the checkpoint when due (`checkpoint=False`: a step that skipped
        its update for a non-finite loss writes none)."""
        t = self.cfg.train
        self.last_finite = checkpoint
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.pop("rollout/tokens", 0.0) / metrics["time/step_s"]
        if t.eval_every and (step % t.eval_every == 0 or step == last):
            te = time.perf_counter()
            metrics["eval/reward"] = self.rollouts.evaluate()
            metrics["time/eval_s"] = time.perf_counter() - te
        self._log(step, metrics)
        if checkpoint and t.checkpoint_every and step % t.checkpoint_every == 0:
            self._save(step, state)

    def finish(self, state: TrainState) -> None:
        if state.step > self.saved_step and self.last_finite:
            self._save(state.step, state)
        if self.logger is not None:
            self.logger.close()

    def _save(self, step: int, state: TrainState) -> None:
        keep = self.cfg.train.keep_checkpoints
        checkpointing.save(self.setup.actor, self.run_dir, step, state.state_dict(), keep)
        self.saved_step = step

    def _log(self, step: int, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)


def last_step(cfg: Config, max_steps: int | None) -> int:
    """The step a run stops after: `train.steps`, or a smaller --steps (`max_steps`)."""
    return cfg.train.steps if max_steps is None else min(cfg.train.steps, max_steps)


def nothing_to_train(run_dir: Path, step: int, last: int, total: int) -> str | None:
    """The line for a resumed run already at (or past) the step it stops at, `last` (None when
    steps are left, or for a fresh run): `train.steps` (`total`), or a smaller --steps."""
    if step == 0 or step < last:
        return None
    at = f"step {step} of {last}" if step == last else f"step {step}, past step {last}"
    limit = "--steps" if last < total else "train.steps"
    head = f"{run_dir} is at {at} ({limit}): nothing to train; "
    if last < total and step < total:  # only --steps stops it
        return (head + f"pass --steps N with N > {step} (up to train.steps={total}), or leave "
                "--steps out, to train on")  # fmt: skip
    also = " and leave --steps out" if last < total else ""
    return head + f"pass train.steps=N with N > {step}{also} to train on"
