"""Partial rollouts (`rollout.partial: true`): a weight update does not wait for the generations
in flight. The trainer holds the client (`Hold.pause`): every request in flight is aborted and
comes back with the tokens it has so far, and no new one is sent; the weights are synced; the
hold is lifted (`Hold.resume`) and each interrupted sample goes on from where it stopped, as a
new /generate request from its prompt and tokens so far (`finish`), on the new weights.

This is the abort-and-continue form (slime's partial rollouts; SGLang's `/abort_request` returns
the partial output, and the built-in server does the same: contract-tested). It needs nothing
from the server beyond /generate and /abort_request, and the client knows exactly which
weights wrote which token: every segment's tokens carry the `weight_version` its answer names
(`Sample.token_versions`; `Sample.versions`, one per segment). The log-prob of each token is
the one its own weights gave when it was drawn (the behavior policy is per token: a mixture of
versions, which the decoupled objective's pi_prox / pi_behav weight corrects: train/ahead.py).
A continuation prefills the tokens so far under the new weights, so under R3 the sample keeps
the routing of its last segment, which covers every position.

Only aborts caused by a hold are continued: a sample aborted otherwise (the run ending, a server
that aborted it) stays aborted.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from megatron_gspo.rollout.sample import Sample, oldest_version

SEGMENT_SEED_STRIDE = 1_000_003  # segment s of a sample draws with sampling_seed + s * stride


class _Client(Protocol):  # rollout/client.py's RolloutClient, which holds a Hold
    async def generate(self, prompts: list[list[int]], n: int = 1,
                       sampling_params: dict | None = None, return_logprob: bool = True,
                       return_routed_experts: bool = False, grouped: bool = False
                       ) -> list[list[Sample]]: ...  # fmt: skip

    async def abort(self) -> None: ...

    def outstanding(self) -> int: ...


class Hold:
    """The client's switch between generating and holding for a weight update (one event loop:
    the client's)."""

    def __init__(self, client: _Client):
        self.client = client
        self.holds = 0  # pauses so far: a sample aborted during one is continued
        self.stopped = False
        self._open: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def pause(self) -> None:
        """Abort what is in flight and send nothing new, until `resume`; returns once no
        request of the client is outstanding (the weights can change under none)."""
        self.holds += 1
        self._event().clear()
        await self.client.abort()  # (from here on, `on` keeps every request unsent)
        while self.client.outstanding():
            await asyncio.sleep(0.005)

    def resume(self) -> None:
        self._event().set()

    @property
    def on(self) -> bool:
        """Between `pause` and `resume`: no request is sent (the client checks it)."""
        return self._open is not None and not self._open.is_set()

    def stop(self) -> None:
        """The run is ending: held samples stay as they are (aborted)."""
        self.stopped = True
        self.resume()

    def cut(self, holds_before: int) -> bool:
        """Whether a request sent when `holds` was `holds_before` may have been cut short (or
        kept unsent) by a hold."""
        return self.holds > holds_before or self.on

    async def wait(self) -> bool:
        """Until the hold is lifted; False when the run is ending instead."""
        await self._event().wait()
        return not self.stopped


async def finish(hold: Hold, sample: Sample, sampling: dict, routed: bool, holds_before: int
                 ) -> Sample:  # fmt: skip
    """`sample` (generated with `sampling` while `hold.holds` was `holds_before`), continued after
    every hold that interrupted it until it ends; in place."""
    if not (sample.aborted and hold.cut(holds_before)):
        return sample
    budget = int(sampling.get("max_new_tokens", 128))
    if sample.token_versions is None:
        sample.token_versions = [str(sample.weight_version)] * len(sample.tokens)
        sample.versions = [str(sample.weight_version)] if sample.tokens else []
    while sample.aborted and hold.cut(holds_before) and not hold.stopped:
        if not await hold.wait():
            break
        left = budget - len(sample.tokens)
        if left <= 0:
            sample.finish_reason = "length"
            break
        sp = dict(sampling, max_new_tokens=left)
        if sp.get("sampling_seed") is not None:
            sp["sampling_seed"] = (
                int(sp["sampling_seed"]) + len(sample.versions) * SEGMENT_SEED_STRIDE
            )
        holds_before = hold.holds
        ids = list(sample.prompt_ids) + list(sample.tokens)
        [[seg]] = await hold.client.generate([ids], 1, sp, return_routed_experts=routed)
        _append(sample, seg)
    if sample.versions:  # the oldest weights any of its tokens came from
        sample.weight_version = oldest_version(sample.versions)
    return sample


def _append(sample: Sample, seg: Sample) -> None:
    sample.tokens += seg.tokens
    sample.logprobs = list(sample.logprobs or []) + list(seg.logprobs or [None] * len(seg.tokens))
    assert sample.token_versions is not None  # set before the first segment
    sample.token_versions += [str(seg.weight_version)] * len(seg.tokens)
    if seg.tokens or not seg.aborted:
        sample.versions.append(str(seg.weight_version))
    sample.finish_reason, sample.server = seg.finish_reason, seg.server
    sample.latency_s += seg.latency_s
    if seg.routed_experts is not None:
        sample.routed_experts = seg.routed_experts
