"""The one place that calls the user's code (rewards, tools, environments): worker processes it
can kill and replace, a time limit per call, and every way a call can end (a value, a raise of
any kind, a time-out, a dead worker) an `Outcome` of that call alone (pool.py); the failures'
log, bounded too (failure_log.py).

Imports nothing else of the package, so rewards/ and rollout/ both use it."""

from megatron_gspo.bounded.failure_log import LOG_BYTES, FailureLog
from megatron_gspo.bounded.outcome import Kind, Outcome, Refused, one_line
from megatron_gspo.bounded.pool import Pool, default_workers

__all__ = [
    "LOG_BYTES",
    "FailureLog",
    "Kind",
    "Outcome",
    "Pool",
    "Refused",
    "default_workers",
    "one_line",
]
