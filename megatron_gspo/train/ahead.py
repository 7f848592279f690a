"""Rollouts ahead of training (`rollout.max_staleness: N`): the servers generate the batches of
steps k+1..k+N while the trainer trains on step k's.

Schedule, per step k (rank 0 drives the servers; every rank takes the same turns):

    take step k's batch (generated ahead, or now when none is in flight)
    start step k+N's generation (queued behind the others: one runs at a time)    } overlap
    train on step k's batch                                                       }
    before the sync of version k: wait for every queued generation to end (with
    `rollout.partial`: to have started, then hold it), sync, let it go on

Every generation starts on the weights the servers held when it was queued: step s's on version
s-1-N (the sync after it waits for it), so a batch is exactly N versions older than the trainer
that trains on it (fewer for the first N steps), whatever the timing, and a resumed run draws the
same batches. With `rollout.partial` (rollout/partial.py) the sync does not wait for the
generation in flight to end: its requests are aborted, the weights synced, and each sample goes
on from its tokens so far on the new weights, so its tokens may come from several versions (the
per-token versions are on the sample) and the batch is fresher than N behind.

Samples a restarted server made from older weights than their generation's are dropped with
their groups and counted (`rollout/stale_groups_dropped`), not generated again as the
synchronous loop does: that would make the trainer wait. A batch whose every sample is stale
(older than N versions behind) is generated again now, as the synchronous loop's is
(loop.take_batch): a server that never takes the trainer's weights stops the run there rather
than leave every later step with nothing to train on. The rollout log-probs of a token are
those of the weights that drew it, the behavior policy (pi_behav). The step's old log-probs are
the trainer's at the start of the step: the proximal policy pi_prox, which the clipped ratio is
taken against. The decoupled objective ("Batch size-invariance for policy optimization", Hilton
et al., 2022; AReaL, Fu et al., 2025, uses it for asynchronous RL), with `algo.mismatch: tis`
at `algo.mismatch_level` token or sequence and `algo.tis_cap` = C (algo/mismatch.py):

    GRPO (tis: token):    J = E_{y ~ pi_behav} [ 1/|y| sum_t w_t min(r_t A, clip(r_t) A) ]
                          r_t = pi_theta(y_t) / pi_prox(y_t),  w_t = min(pi_prox(y_t) / pi_behav(y_t), C)
    GSPO (tis: sequence): J = E_{y ~ pi_behav} [ w min(s A, clip(s) A) ]
                          s = (pi_theta(y) / pi_prox(y))^(1/|y|),  w = min(pi_prox(y) / pi_behav(y), C)

w corrects for the sample coming from pi_behav; the clip keeps the update near pi_prox, not near
the stale behavior policy. Without a mismatch correction w = 1: the stale samples are used as if on-policy.

Generations in flight when the run stops are dropped: the checkpoint of step k stores the prompt
sampler's position before step k+1's prompts were drawn, so `--resume` draws them again and
generates them from the checkpoint's weights. No step is lost or doubled.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class Pending:
    """A step's batch being generated (rank 0 holds the future; other ranks only the step)."""

    step: int
    version: str  # the weights the servers hold when it starts
    sampler_state: dict[str, Any]  # the prompt sampler's position before its prompts were drawn
    prompts: list[int]  # (every rank draws them)
    future: Future | None = field(default=None, repr=False)
    started: threading.Event = field(default_factory=threading.Event, repr=False)
    t_start: float = 0.0


class Taken(NamedTuple):
    """A step's batch generated ahead: what every rank learns of it, the weights its
    generation started on, and its prompts (to generate it again: loop.take_batch)."""

    collected: Any  # train/results.Collected
    version: str
    prompts: list[int]


class Ahead:
    """The batches of the next N steps, generated on a thread of rank 0 while this one trains."""

    def __init__(self, rl, sampler, staleness: int, partial: bool = False):
        """`staleness`: rollout.max_staleness (0: nothing ahead); `partial`: rollout.partial."""
        self.rl, self.sampler, self.staleness, self.partial = rl, sampler, staleness, partial
        self.pending: list[Pending] = []  # in step order
        self._pool = ThreadPoolExecutor(1, "rollouts-ahead") if rl.rank0 and staleness else None

    def close(self) -> None:
        """Drop the generations in flight (the run is ending): their requests are aborted, so
        the thread ends before the clients' event loop stops."""
        if self._pool is None:
            return
        if any(p.future is not None and not p.future.done() for p in self.pending):
            self.rl.abort_generation()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's position as a checkpoint stores it: before the prompts of the first
        step whose generation is in flight (a resume draws them again)."""
        if self.pending:
            return self.pending[0].sampler_state
        return self.sampler.state_dict()

    def next_prompts(self) -> list[int]:
        """The prompts of a step generated now (every rank draws: the sampler stays in step)."""
        return self.sampler.next_batch()

    def fill(self, step: int, last: int, version: str) -> None:
        """After taking step `step`'s batch: queue the generations of steps up to step + N
        (at most `last`) on the servers' current weights (`version`); every rank draws their
        prompts. Staleness 0: nothing."""
        if not self.staleness:
            return
        queued = self.pending[-1].step if self.pending else step
        for s in range(queued + 1, min(step + self.staleness, last) + 1):
            self._start(s, version)

    def _start(self, step: int, version: str) -> None:
        state = self.sampler.state_dict()
        prompts = self.sampler.next_batch()
        p = Pending(step, version, state, prompts)
        if self._pool is not None:
            p.future = self._pool.submit(self._generate, p, prompts)
        self.pending.append(p)

    def _generate(self, p: Pending, prompts: list[int]):
        p.t_start = time.perf_counter()
        p.started.set()
        return self.rl.gather(prompts, p.step, p.version)

    def take(self, step: int) -> Taken | None:
        """Step `step`'s batch if it was generated ahead, once its generation ended (every rank:
        rank 0 shares it); None when none was."""
        if not self.pending or self.pending[0].step != step:
            return None
        p = self.pending.pop(0)
        result = p.future.result() if p.future is not None else None  # (its error, if any)
        return Taken(self.rl.share(result), p.version, p.prompts)

    def before_sync(self) -> float:
        """Before a weight sync (rank 0), so that the weights change under no request: wait for
        the queued generations to end, or with `partial` for them to start, then hold the one in
        flight. Returns how long the servers generated during the wait's window (0 where none,
        and on other ranks)."""
        live = [(p, p.future) for p in self.pending if p.future is not None]
        if not live:
            return 0.0
        busy = 0.0
        if self.partial:
            for p, f in live:
                if not f.done():  # (one that failed has its error raised when taken)
                    p.started.wait()
            self.rl.hold_generation(True)
            now = time.perf_counter()
            for p, f in live:  # (the one in flight: until now)
                busy += _generated(f) if f.done() else now - p.t_start
            return busy
        for _, f in live:
            f.exception()  # (waits; the error is raised when it is taken)
            busy += _generated(f)
        return busy

    def after_sync(self) -> None:
        """The held generation goes on, on the new weights (`partial`)."""
        if self.partial and any(p.future is not None for p in self.pending):
            self.rl.hold_generation(False)


def _generated(f: Future) -> float:
    """How long a finished generation's servers generated (0 if it failed)."""
    if f.exception() is not None:
        return 0.0
    return float(f.result().generation_s)
