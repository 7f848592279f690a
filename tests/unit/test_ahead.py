"""train/ahead.py's schedule, on its own: what is queued, on which weights, what a checkpoint
keeps, what a sync waits for. The rollout side is a recorder (the real one, share.py, runs on
real servers in tests/e2e/test_train.py and test_episodes.py); the prompt sampler is real."""

from __future__ import annotations

import threading

import pytest

from megatron_gspo.data.prompts import PromptSampler
from megatron_gspo.train.ahead import Ahead

pytestmark = pytest.mark.unit


class Recorder:
    """Rank 0's rollout side: `gather` records (prompts, step, version) and waits for `go`."""

    rank0 = True

    def __init__(self):
        self.calls: list[tuple] = []
        self.go = threading.Event()
        self.holds: list[bool] = []

    def gather(self, prompts, step, version):
        self.go.wait(30)
        self.calls.append((tuple(prompts), step, version))
        return _Collected(step)

    def share(self, result):
        return result

    def hold_generation(self, on: bool) -> None:
        self.holds.append(on)

    def abort_generation(self) -> None:
        self.go.set()


class _Collected:
    def __init__(self, step):
        self.step, self.metrics, self.generation_s = step, {}, 0.5


class Untouchable:
    rank0 = True

    def __getattr__(self, name):
        raise AssertionError(f"staleness 0 used the rollout side: {name}")


def test_staleness_0_is_the_synchronous_loop():
    """Nothing is queued, taken, waited for or held; the sampler is drawn only by the step."""
    sampler, ref = PromptSampler(40, 4, 0), PromptSampler(40, 4, 0)
    ahead = Ahead(Untouchable(), sampler, 0)
    for step in range(1, 4):
        assert ahead.take(step) is None
        assert ahead.next_prompts() == ref.next_batch()
        ahead.fill(step, 5, str(step - 1))
        assert ahead.before_sync() == 0.0
        ahead.after_sync()
        assert ahead.sampler_state() == ref.state_dict() and not ahead.pending
    ahead.close()


def test_staleness_2_queues_two_steps_each_on_the_weights_it_was_queued_on():
    sampler, ref = PromptSampler(40, 4, 0), PromptSampler(40, 4, 0)
    rl = Recorder()
    ahead = Ahead(rl, sampler, 2)
    try:
        assert ahead.take(1) is None
        first = ahead.next_prompts()
        assert first == ref.next_batch()
        ahead.fill(1, 5, "default")  # steps 2 and 3, on the base weights
        assert [(p.step, p.version) for p in ahead.pending] == [(2, "default"), (3, "default")]
        before_2 = ref.state_dict()
        assert ahead.sampler_state() == before_2  # a checkpoint now redraws steps 2 and 3
        want = [ref.next_batch(), ref.next_batch()]
        rl.go.set()
        assert ahead.before_sync() == 1.0  # waited for both: 0.5 s of generation each
        assert [c[:2] for c in rl.calls] == [(tuple(want[0]), 2), (tuple(want[1]), 3)]
        collected, version, prompts = ahead.take(2)
        assert (collected.step, version, prompts) == (2, "default", want[0])
        ahead.fill(2, 5, "1")  # step 4, on version 1
        assert [(p.step, p.version) for p in ahead.pending] == [(3, "default"), (4, "1")]
        ahead.fill(3, 5, "2")  # up to step 5 = last
        ahead.fill(4, 5, "3")  # nothing past the last step
        assert [p.step for p in ahead.pending] == [3, 4, 5]
        assert rl.holds == []
    finally:
        ahead.close()


def test_partial_holds_the_generation_in_flight_instead_of_waiting_for_it():
    rl = Recorder()
    ahead = Ahead(rl, PromptSampler(40, 4, 0), 1, partial=True)
    try:
        ahead.fill(1, 5, "default")
        ahead.before_sync()  # step 2's generation has started (it waits in gather): held
        assert rl.holds == [True] and not ahead.pending[0].future.done()
        ahead.after_sync()
        assert rl.holds == [True, False]
        rl.go.set()
        assert ahead.take(2)[1] == "default"
    finally:
        ahead.close()
