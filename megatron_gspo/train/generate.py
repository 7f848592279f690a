"""How a step's prompts become scored samples: one completion per sample or, with `env.fn`, one
episode per sample (rollout/episodes.py), and the rewards of either.

A completion's reward is `reward.fn(prompt, response, answer)`. An episode's is the last reward
its environment gave, else `reward.fn` on its last model turn (the answer, for a tool-calling
episode); an episode whose environment failed gets 0 (RUN_DIR/logs/env.log says why), or, when it
failed before the model wrote anything, counts as a failed reward (its group is dropped). Either
is a failed sample, as one whose reward failed (RUN_DIR/logs/reward.log): a step on which every
sample failed ends the run (train/samples.py).

Each prompt's group is generated on its own, and its samples go to the reward's worker processes
(rewards/scoring.py) as soon as the group is done (an episode: as soon as it ends), so scoring
overlaps the generation of the other groups and the calls run side by side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from megatron_gspo.bounded import Kind, Outcome
from megatron_gspo.config import Config
from megatron_gspo.rewards import Failure, Scored
from megatron_gspo.rewards.scoring import RewardScorer
from megatron_gspo.rollout.answers import snippet
from megatron_gspo.rollout.partial import finish
from megatron_gspo.rollout.sample import Sample

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """A generation's samples (groups[i][j]: sample j of prompt i) and their rewards."""

    groups: list[list[Sample]]
    scored: Scored
    generate_s: float  # until the last sample's generation ended
    reward_wait_s: float  # then, until the last reward was in


class Generation:
    """Rank 0: the step's samples and their rewards (`rollout`)."""

    def __init__(self, cfg: Config, tokenizer, run_dir: Path | None):
        self.cfg, self.tokenizer = cfg, tokenizer
        logs = None if run_dir is None else run_dir / "logs"
        r = cfg.reward
        self.rewards = RewardScorer(r.fn, r.workers, r.timeout_s,
                                    None if logs is None else logs / "reward.log",
                                    start_timeout_s=r.start_timeout_s)  # fmt: skip
        self.runner = None
        if cfg.env.fn is not None:
            try:
                self.runner = _runner(cfg, tokenizer, None if logs is None else logs / "env.log")
            except BaseException:
                self.rewards.close()
                raise

    def close(self) -> None:
        self.rewards.close()
        if self.runner is not None:
            self.runner.calls.close()

    async def rollout(self, client: RolloutClient, rows, prompts: list[list[int]], n: int,
                      sampling: dict, routed: bool = False, grouped: bool = False,
                      step: int | None = None) -> Rollout:  # fmt: skip
        """n samples of each prompt (completions, or episodes), each scored as soon as its
        generation ends; `step` (None: eval) labels the logs."""
        t0, where = time.perf_counter(), "eval" if step is None else f"step {step}"
        if self.runner is None:
            parts = await asyncio.gather(*(
                self._completions(client, rows[i], i, ids, n, sampling, routed, grouped, where)
                for i, ids in enumerate(prompts)
            ))  # fmt: skip
        else:
            done = await asyncio.gather(*(
                self._episode(client, row, ids, _seeded(sampling, i * n + j), routed, (i, j),
                              len(prompts) * n, where)
                for i, (row, ids) in enumerate(zip(rows, prompts)) for j in range(n)
            ))  # fmt: skip
            parts = [list(done[i * n : (i + 1) * n]) for i in range(len(prompts))]
        t1 = time.perf_counter()
        groups = [[s for s, _ in part] for part in parts]
        futures = [f for part in parts for _, f in part]
        if client.hold.stopped:  # aborted for good, the run is ending: no reward is waited for
            futures = [_done(None, "the run is ending", Kind.CLOSED) for _ in futures]
        outcomes = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        samples = [s for g in groups for s in g]
        scored = self._scored(samples, outcomes)
        # (a step on which every sample failed ends the run on its own line: train/samples.py)
        if self.runner is not None and not (step is not None and scored.all_failed):
            _env_summary(samples, where, self.cfg.env.fn, self.runner.log.path)
        return Rollout(groups, scored, t1 - t0, time.perf_counter() - t1)

    async def _completions(self, client: RolloutClient, row, i: int, ids: list[int], n: int,
                           sampling: dict, routed: bool, grouped: bool,
                           where: str) -> list[tuple[Sample, Future]]:  # fmt: skip
        """Prompt i's group, generated (its samples drawn with the seeds one request for every
        prompt would give them), then sent to be scored."""
        holds = client.hold.holds
        [group] = await client.generate([ids], n=n, sampling_params=_seeded(sampling, i * n),
                                        return_routed_experts=routed, grouped=grouped)  # fmt: skip
        for s in group:
            s.prompt_index = i
        # samples a weight update interrupted go on on the new weights (rollout/partial.py)
        cut = [(s, _seeded(sampling, i * n + s.sample_index)) for s in group if s.aborted]
        await asyncio.gather(*(finish(client.hold, s, sp, routed, holds) for s, sp in cut))
        return [(s, self._submit(row, s, where)) for s in group]

    async def _episode(self, client: RolloutClient, row, ids: list[int], sampling: dict,
                       routed: bool, where_ij: tuple[int, int], stride: int,
                       where: str) -> tuple[Sample, Future]:  # fmt: skip
        assert self.runner is not None  # (episodes only)
        s = await self.runner.run(client, row, ids, sampling, routed, where_ij, stride)
        return s, self._submit(row, s, where)

    def score(self, rows, samples: list[Sample], where: str = "") -> Scored:
        """Each sample's reward (None: failed, `failures` says why), waited for here."""
        futures = [self._submit(rows[s.prompt_index], s, where) for s in samples]
        return self._scored(samples, [f.result() for f in futures])

    def _submit(self, row, s: Sample, where: str) -> Future:
        """Future of the sample's reward Outcome: its environment's, or reward.fn's."""
        if s.ended_unknown:  # (counted as a failed reward: its group is dropped)
            return _done(None, f"{s.server} ended its generation with finish reason "
                               f"{snippet(s.finish_reason)}, which this trainer does not "
                               "know")  # fmt: skip
        if s.env_error is not None and not s.tokens:
            return _done(None, self._env_failed(s))
        if s.env_error is not None:
            return _done(0.0)
        if s.env_reward is not None:
            return _done(float(s.env_reward))
        if s.aborted:  # (the run is ending: nothing will train on it)
            return _done(None, "its generation was aborted", Kind.CLOSED)
        return self.rewards.submit(row.prompt, self.text(s), row.answer, where)

    def _env_failed(self, s: Sample) -> str:
        return f"environment {self.cfg.env.fn!r} failed: {s.env_error}"

    def _scored(self, samples: list[Sample], outcomes: list[Outcome]) -> Scored:
        """The samples' rewards and why each that failed did: its environment (whose log has
        it, with the traceback), else its reward (the reward's log; none where the run ended
        before it was scored, Kind.CLOSED, or its server's finish reason was unknown)."""
        env_log = None if self.runner is None else self.runner.log.path
        errors: list[Failure | None] = []
        for s, o in zip(samples, outcomes):
            if s.env_error is not None:
                errors.append(Failure(self._env_failed(s), env_log))
            elif not o.ok:
                # (reward.log has neither a sample never scored nor one the client refused)
                unscored = o.kind is Kind.CLOSED or s.ended_unknown
                log = None if unscored else self.rewards.log.path
                errors.append(Failure(o.message, log))
            else:
                errors.append(None)
        return Scored([o.value if o.ok else None for o in outcomes], errors)

    def text(self, s: Sample) -> str:
        """The response text a reward function sees: the last model turn of an episode."""
        tokens = s.tokens
        if s.loss_mask is not None and 0 in s.loss_mask:
            last_env = len(s.loss_mask) - 1 - s.loss_mask[::-1].index(0)
            tokens = tokens[last_env + 1 :]
        return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True))


def _done(value: float | None, failure: str = "", kind: Kind = Kind.RAISED) -> Future:
    f: Future = Future()
    f.set_result(Outcome(Kind.VALUE, value=value) if value is not None
                 else Outcome(kind, message=failure))  # fmt: skip
    return f


def _env_summary(samples: list[Sample], where: str, fn: str | None, path: Path | None) -> None:
    """One console line for the episodes whose environment failed (each is in `path`, the
    run's logs/env.log, when there is one)."""
    failed = [s.env_error for s in samples if s.env_error is not None]
    if failed:
        log.warning("%s: the environment %r failed on %d of %d episodes (first: %s)%s",
                    where or "rollout", fn, len(failed), len(samples), failed[0],
                    "" if path is None else f"; {path} has each")  # fmt: skip


def _seeded(sampling: dict, k: int) -> dict:
    if sampling.get("sampling_seed") is None:
        return sampling
    return sampling | {"sampling_seed": int(sampling["sampling_seed"]) + k}


def _runner(cfg: Config, tokenizer, log_path: Path | None):
    """The episode runner; the environment's code is imported once in each of its worker
    processes, never here (a broken import or a bad tool fails at start, in EnvCalls)."""
    from megatron_gspo.rollout.env import EnvCalls
    from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits

    e = cfg.env
    fn = cast(str, e.fn)
    calls = EnvCalls(fn, e.tools, timeout_s=e.timeout_s, vocab_size=len(tokenizer),
                     workers=e.workers, start_timeout_s=e.start_timeout_s)  # fmt: skip
    limits = Limits(e.max_turns, e.max_turn_tokens or cfg.rollout.max_new_tokens, e.max_tokens,
                    cfg.data.max_prompt_tokens)  # fmt: skip
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
    return EpisodeRunner(calls, ChatRender(tokenizer), limits, log_path)
