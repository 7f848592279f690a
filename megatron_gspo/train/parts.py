"""What the RL loop runs on, built in one place (`build_parts`): the trainer's setup (process
groups, the run directory, the actor), the rollout servers, the batches, the prompt sampler and
the weight sync. `megatron-gspo train` builds them here and hands them to `loop.run`; a test can
build the same parts (or hand the loop others that fit protocols.py) and drive it in-process."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_gspo.config import Config
from megatron_gspo.train.protocols import RolloutSource, Servers, Setup

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import PromptSampler
    from megatron_gspo.weight_sync.sync import WeightSync


@dataclass
class Parts:
    """The loop's parts; closing them stops what they started (last started first)."""

    cfg: Config
    run_dir: Path
    setup: Setup  # the actor, checkpoints, the restore on --resume
    fleet: Servers  # the rollout servers: supervision, restore point, memory release
    rollouts: RolloutSource  # a step's batch and the eval, every rank
    sampler: PromptSampler  # the step's prompts; its position is checkpointed
    sync: WeightSync  # the trainer's weights into the servers
    stack: ExitStack = field(default_factory=ExitStack, repr=False)

    def __enter__(self) -> Parts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stack.close()


def build_parts(
    cfg: Config, run_dir: Path, *, resume: bool = False, allow_config_change: bool = False
) -> Parts:
    """Every part of a training run, started: process groups and the locked run directory, the
    actor (its checkpoint loaded on `resume` by the loop's restore), the servers, the batch
    producer (rank 0), the prompt sampler and the weight sync. A failure closes what started."""
    from megatron_gspo.train.setup import TrainerSetup
    from megatron_gspo.train.share import rollout_side

    stack = ExitStack()
    setup = None
    try:
        setup = stack.enter_context(TrainerSetup(cfg, run_dir, resume, allow_config_change))
        # the run directory is written once the prompts and the reward load, before the servers
        fleet, rollouts = rollout_side(cfg, run_dir, setup.hf_dir, stack, setup.commit)
        sampler = setup.sampler(rollouts.n_train_prompts)
        sync = setup.weight_sync(fleet.urls, fleet.api_key)
        stack.callback(sync.close)
    except BaseException:
        if setup is not None:
            setup.abandon()  # (refused before commit: the directory as it was found)
        stack.close()
        raise
    return Parts(cfg, run_dir, setup, fleet, rollouts, sampler, sync, stack)
