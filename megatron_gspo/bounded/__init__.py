"""The one place that calls the user's code (rewards, tools, environments): worker processes it
can kill and replace, a time limit per call, and every way a call can end (a value, a raise of
any kind, a time-out, a dead worker) an `Outcome` of that call alone (pool.py).

Imports nothing else of the package, so rewards/ and rollout/ both use it."""

from megatron_gspo.bounded.outcome import Kind, Outcome, Refused, one_line
from megatron_gspo.bounded.pool import Pool, default_workers

__all__ = ["Kind", "Outcome", "Pool", "Refused", "default_workers", "one_line"]
