"""What the RL loop needs of its parts, as protocols: the actor (log-probs and updates), the
rollouts (a step's batch on every rank), the servers (their supervision around a weight sync)
and the setup. `Actor`, `SharedRollouts`, `ServerFleet` and `TrainerSetup` are the
implementations (parts.py builds them); an asynchronous rollout source or another trainer
backend fits the loop by providing the same methods."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from megatron_gspo.algo.config import AlgoConfig
    from megatron_gspo.train.batch import StepBatch
    from megatron_gspo.train.results import Collected, Update
    from megatron_gspo.train.state import TrainState
    from megatron_gspo.weight_sync.disk import RestorePoint
    from megatron_gspo.weight_sync.sync import WeightSync


class PolicyActor(Protocol):
    @property
    def reference(self) -> object | None: ...  # the KL's reference weights (None: no KL)

    def set_lr(self, lr: float) -> None: ...

    def shard(self, batch: StepBatch | None, parts: list[list[int]]) -> StepBatch: ...

    def logprobs(
        self,
        batch: StepBatch,
        micro_batch_size: int = 8,
        *,
        fit_logits: bool = False,
        trained_only: bool = False,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...

    def reference_logprobs(self, batch: StepBatch, micro_batch_size: int = 8) -> torch.Tensor: ...

    def train_step(
        self,
        batch: StepBatch,
        loss_cfg: AlgoConfig,
        micro_batch_size: int = 8,
        *,
        on_policy: bool = False,
    ) -> Update: ...


class RolloutSource(Protocol):
    """A step's batch and the eval (share.py): rank 0 produces, every rank receives."""

    rank0: bool
    n_train_prompts: int

    def collect(
        self, prompt_index: list[int], step: int, version: str | None = None
    ) -> Collected: ...

    def gather(
        self, prompt_index: list[int], step: int, version: str | None = None
    ) -> Collected: ...

    def share(self, result: Collected | None) -> Collected: ...

    def evaluate(self) -> float: ...

    def hold_generation(self, on: bool) -> None: ...

    def abort_generation(self) -> None: ...


class Servers(Protocol):
    """The rollout servers (fleet.py): their supervision around a weight sync, and memory."""

    urls: list[str]
    api_key: str | None

    def weights_at(self, point: RestorePoint) -> None: ...

    def wait_for_restarts(self) -> None: ...

    def ready_servers(self) -> list[int] | None: ...

    def restart_counts(self) -> list[int] | None: ...

    def being_restarted(self, urls: list[str], since: list[int] | None = None) -> bool: ...

    def servers_busy_s(self) -> float | None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


class Setup(Protocol):
    actor: PolicyActor
    hf_dir: Path

    def sampler(self, n_rows: int) -> Any: ...

    def weight_sync(self, urls: list[str], api_key: str | None = None) -> WeightSync: ...

    def restore(self, sampler: Any, sync: WeightSync, fleet: Servers) -> TrainState: ...


if TYPE_CHECKING:  # mypy checks that the implementations provide what the loop needs
    from megatron_gspo.train.actor import Actor
    from megatron_gspo.train.fleet import ServerFleet
    from megatron_gspo.train.setup import TrainerSetup
    from megatron_gspo.train.share import SharedRollouts

    def _implementations(
        actor: Actor, rollouts: SharedRollouts, fleet: ServerFleet, setup: TrainerSetup
    ) -> tuple[PolicyActor, RolloutSource, Servers, Setup]:
        return actor, rollouts, fleet, setup
