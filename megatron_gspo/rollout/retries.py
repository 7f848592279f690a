"""How the rollout client retries a /generate request that failed, and the line it stops with.

A failure that another try may get past (`Retryable`: a 5xx, a time-out, a lost connection) is
retried on another server at once, `retries` times with back-off; after those the request waits,
up to `outage_s`, for any server to answer /health (its supervisor restarting it) and is sent
there, still backing off (a server whose /health is fine while /generate answers 5xx, an
overloaded one or a proxy's, is not sent a request per millisecond), and gives up at the same
deadline whatever /health says. That is how an outage is handled, and every failure that may be
one still is: a lost connection, a time-out, a 502/503/504 (a proxy, a starting or overloaded
server), and a 500 from a server whose /health fails (the built-in server whose engine died
answers /generate 500 and /health 503 until it is restarted).

A server whose /health is fine while it answers this request with the same HTTP 500 again and
again is not down: the request trips a bug of the server's, and no wait gets past it. It used to
be retried for the whole outage wait (`rollout.health_timeout_s`, 300 s: a prompt as long as
the built-in server's KV cache, which it failed on, was sent again for minutes) and end with
"check that the servers are up", though they were. After SAME_500S such answers (the quick
retries and the try that /health let through: ~6 s with the default back-off), the last from a
server that then answers /health 200, the request stops the run in one line with the server's
message and its log. An out-of-memory answer is never counted so (`OUT_OF_MEMORY`): the same
OOM text five times in ~6 s may be a load that passes (other requests holding the memory), and
stopping a run on it costs more than the wait.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from megatron_gspo.rollout.answers import Retryable, RolloutError

# The same HTTP 500 message this many times for one request (other failures between them do not
# count, another 500 message starts the count again), the last from a server whose /health then
# answers 200: a server's failure on this request, reported instead of waited out.
SAME_500S = 5
# A 500 that says the server ran out of memory (torch's "CUDA out of memory", SGLang's "Not
# enough memory", "OOM"): perhaps the load of the moment, waited for as an outage.
OUT_OF_MEMORY = re.compile(r"out of memory|not enough memory|\bOOM\b", re.IGNORECASE)
MAX_BACKOFF_S = 2.0  # the longest wait between two tries of a request


@dataclass
class Tries:
    """What the tries of one request (`rid`, its first sample's) have met so far."""

    rid: str
    urls: list[str] = field(default_factory=list)  # the servers tried, in order
    outage_until: float | None = None  # when the wait for a server to come back ends
    last_error: str = ""
    last_5xx: str = ""  # the last 5xx answer's text ("HTTP 5xx: message")
    same_500s: int = 0  # answers of the same HTTP 500 text (last_5xx) so far

    @property
    def attempt(self) -> int:
        return len(self.urls)

    def failed(self, e: Retryable) -> None:
        text = str(e)
        if e.status == 500 and OUT_OF_MEMORY.search(text):
            self.same_500s = 0
        elif e.status == 500:
            self.same_500s = self.same_500s + 1 if text == self.last_5xx else 1
        if e.status is not None:
            self.last_5xx = text
        self.last_error = text

    def wait_until(self, outage_s: float) -> float:
        """When the wait for a server to come back ends (`outage_s` after its first call)."""
        if self.outage_until is None:
            self.outage_until = time.monotonic() + outage_s
        return self.outage_until

    def backoff_s(self, base_s: float, cap_s: float | None = None) -> float:
        """The wait before the next try: `base_s` doubling with each try (at most `cap_s`)."""
        wait = base_s * 2 ** (self.attempt - 1)
        return wait if cap_s is None else min(wait, cap_s)

    def server_bug(self, url: str, log: str | None) -> RolloutError:
        """The line for a request that `url` (healthy) answers the same 500 to, again and again."""
        where = log or "that server's log"
        return RolloutError(
            f"{url}/generate answered request {self.rid} with the same error {self.same_500s} "
            f"times while its /health answers 200 ({self.last_5xx}): the server fails on this "
            f"request, it is not down, so the request is not retried further; its traceback is "
            f"in {where}"
        )

    def gave_up(self, outage_s: float) -> RolloutError:
        """The line for a request no server took within the outage wait."""
        last = self.last_error
        if self.last_5xx and self.last_5xx != last:
            last += f"; the last 5xx answer: {self.last_5xx}"
        return RolloutError(
            f"request {self.rid} failed on {', '.join(sorted(set(self.urls)))} after "
            f"{self.attempt} attempts (last: {last}) and no server took it within "
            f"{outage_s:.0f} s after; check that the servers are up and their logs"
        )
