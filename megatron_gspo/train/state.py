"""The trainer's own state between steps, saved with every checkpoint (trainer_state.json)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step: int = 0  # the last step done (0: none yet)
    weight_version: int = 0  # the weights' version the servers hold after that step
    sampler: dict[str, Any] = field(default_factory=dict)  # the prompt sampler's position

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weight_version": self.weight_version, "sampler": self.sampler}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        return cls(int(state["step"]), int(state["weight_version"]), dict(state["sampler"]))
