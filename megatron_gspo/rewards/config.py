"""The run config's `reward` section: which function scores a sample and how it is bounded."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.checks import in_range, need, seconds


@dataclass
class RewardSection:
    fn: str = "exact"  # exact | math | module:function
    # worker processes that score (rewards/scoring.py; null: 16, or one per core if more)
    workers: int | None = None
    timeout_s: float = 60.0  # one call's limit; past it the sample fails, its worker is replaced

    def check(self) -> None:
        need(self.fn, "reward.fn", "exact, math or module:function")
        if self.workers is not None:
            in_range(self.workers, "reward.workers", 1, 1024)
        seconds(self.timeout_s, "reward.timeout_s")
