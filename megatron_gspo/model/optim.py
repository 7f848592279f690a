"""The optimizer's settings: the run config's `optim` section, turned into megatron-core's
OptimizerConfig by the actor. One definition of its keys, defaults, checks and lr schedule.
No torch import at the top, so a config loads and is checked without it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from megatron_gspo.checks import in_range

if TYPE_CHECKING:
    import torch


class Decay(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    # per RL step: linear warmup from lr/warmup_steps to lr over the first warmup_steps steps,
    # then constant, or a linear / cosine decay to min_lr at train.steps
    warmup_steps: int = 0
    decay: Decay = Decay.CONSTANT
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # 0: no clipping
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    distributed: bool = True  # megatron's distributed optimizer (state sharded over DP)

    def check(self) -> None:
        in_range(self.lr, "optim.lr", 0, lo_open=True)
        in_range(self.warmup_steps, "optim.warmup_steps", 0)
        in_range(self.min_lr, "optim.min_lr", 0, self.lr, hi_name="optim.lr")
        in_range(self.weight_decay, "optim.weight_decay", 0)
        in_range(self.clip_grad, "optim.clip_grad", 0)
        for name in ("adam_beta1", "adam_beta2"):
            in_range(getattr(self, name), f"optim.{name}", 0, 1, hi_open=True)
        in_range(self.adam_eps, "optim.adam_eps", 0, lo_open=True)

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of RL step `step` (1-based) of a run of `total` steps."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == Decay.CONSTANT or total <= self.warmup_steps:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / (total - self.warmup_steps))
        shape = 1 - done if self.decay == Decay.LINEAR else 0.5 * (1 + math.cos(math.pi * done))
        return self.min_lr + (self.lr - self.min_lr) * shape

    def megatron(self, params_dtype: torch.dtype):
        """megatron-core's OptimizerConfig (Adam) for these settings and the model's dtype."""
        import torch
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            min_lr=self.min_lr,
            weight_decay=self.weight_decay,
            clip_grad=self.clip_grad,
            adam_beta1=self.adam_beta1,
            adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=self.distributed,
        )
