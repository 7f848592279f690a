"""The run config's `reward` section: which function scores a sample, how it is bounded, and
DAPO's over-long shaping added to what it returns (rewards/overlong.py)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.checks import MIN_CALL_SECONDS, in_range, need, plugin_spec, seconds


@dataclass
class RewardSection:
    fn: str = "exact"  # exact | math | module:function
    # worker processes that score (rewards/scoring.py; null: 16, or one per core if more)
    workers: int | None = None
    # one call's limit (at least 0.01 s); past it the sample fails, its worker is replaced
    timeout_s: float = 60.0
    # a worker's start: importing the plugin (and a judge model it loads then), at most this
    start_timeout_s: float = 120.0
    # DAPO's soft over-long penalty: ramps from 0 to -overlong_penalty over the last
    # overlong_buffer tokens before the length limit (0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def check(self) -> None:
        need(self.fn, "reward.fn", "exact, math or module:function")
        plugin_spec(self.fn, "reward.fn", ("exact", "math"), "function")
        if self.workers is not None:
            in_range(self.workers, "reward.workers", 1, 1024)
        seconds(self.timeout_s, "reward.timeout_s", at_least=MIN_CALL_SECONDS)
        seconds(self.start_timeout_s, "reward.start_timeout_s")
        in_range(self.overlong_buffer, "reward.overlong_buffer", 0)
        in_range(self.overlong_penalty, "reward.overlong_penalty", 0)

    def check_limit(self, limit: int, key: str) -> None:
        """The buffer fits in the length limit `limit` (the value of `key`)."""
        in_range(self.overlong_buffer, "reward.overlong_buffer", 0, limit, hi_name=key)
