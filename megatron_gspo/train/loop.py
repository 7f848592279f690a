"""The RL loop (`megatron-gspo train`).

One step: prompts -> G rollouts each -> rewards -> group advantages -> old log-probs (R2 records
routing) -> minibatch updates (R2/R3 replay) -> weight sync -> metrics -> checkpoint.
`run` reads like that list; the parts live in rollouts.py (servers, generation, rewards),
actor.py (log-probs, the Megatron train step), weight_sync/ and the step hooks in hooks.py
(eval, metrics, checkpoints).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np

from megatron_gspo.comm import bcast
from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.sample import version_index
from megatron_gspo.routing.metrics import CHANGED, TOKENS_CHANGED
from megatron_gspo.routing.replay import ReplayMode
from megatron_gspo.train.ahead import Ahead
from megatron_gspo.train.batch import RLBatch
from megatron_gspo.train.hooks import StepHooks
from megatron_gspo.train.protocols import PolicyActor, RolloutSource
from megatron_gspo.train.rollouts import Rollouts
from megatron_gspo.train.samples import NONFINITE_INPUTS
from megatron_gspo.train.setup import TrainerSetup
from megatron_gspo.train.shard import minibatch_parts, reduce_sums
from megatron_gspo.train.state import TrainState
from megatron_gspo.weight_sync.session import SyncReport, VerificationFailed
from megatron_gspo.weight_sync.sync import WeightSync, WeightSyncError

log = logging.getLogger(__name__)


def run(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    allow_config_change: bool = False,
) -> None:
    setup = TrainerSetup(cfg, run_dir, resume, allow_config_change)
    with setup, Rollouts(cfg, run_dir, setup.hf_dir) as rl:
        actor, sampler = setup.actor, setup.sampler(rl.n_train_prompts)
        sync = setup.weight_sync(rl.urls, rl.api_key)
        ahead = Ahead(rl, sampler, cfg.rollout.max_staleness, cfg.rollout.partial)
        try:
            hooks = StepHooks(cfg, run_dir, setup, rl)
            state = setup.restore(sampler, sync, rl)  # resume: weights, optimizer, data position
            last = cfg.train.steps if max_steps is None else min(cfg.train.steps, max_steps)
            hooks.begin(state, last)
            current = str(state.weight_version) if state.step else sync.base_version
            guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
            for step in range(state.step + 1, last + 1):
                t0, busy0 = time.perf_counter(), rl.servers_busy_s()
                caught_up = catch_up(sync, rl, current)
                collected, waited = take_batch(ahead, sync, rl, step, current)
                ahead.fill(step, last, current)  # (the next batches generate while this trains)
                metrics = dict(collected.metrics) | caught_up | waited
                finite = train_phase(actor, rl, collected, cfg, step, guard, metrics)
                generating = ahead.before_sync()  # the weights change under no request
                t1 = time.perf_counter()
                busy = generating if cfg.rollout.max_staleness else metrics["time/rollout_s"]
                metrics["time/servers_idle_s"] = servers_idle(rl, busy0, t1 - t0, busy)
                metrics |= sync_weights(sync, rl, step)
                ahead.after_sync()
                current = str(step)
                metrics |= {"time/sync_s": time.perf_counter() - t1, "weight_version": step}
                state = TrainState(step, step, ahead.sampler_state())
                hooks.end_step(step, metrics, state, t0, last, checkpoint=finite)
                guard.stop_if_over()
            hooks.finish(state)
        finally:  # also after a failure: e.g. the update groups kept with the servers
            ahead.close()
            sync.close()


def servers_idle(rl: RolloutSource, busy0: float | None, wall: float, generating: float) -> float:
    """A server's mean idle seconds in the `wall` seconds of this step before its sync: from the
    servers' own working time where they report it (the built-in server; `busy0` at the step's
    start), else the trainer's view (`wall` minus the time it had generation in flight)."""
    busy1 = rl.servers_busy_s() if busy0 is not None else None
    if busy0 is None or busy1 is None:
        return max(0.0, wall - generating)
    return max(0.0, wall - (busy1 - busy0) / max(len(rl.urls), 1))


def train_phase(actor, rl: RolloutSource, collected, cfg: Config, step: int,
                guard: NonFiniteGuard, metrics: dict) -> bool:  # fmt: skip
    """The step's training, into `metrics`: whether it was finite (a checkpoint may follow)."""
    t0 = time.perf_counter()
    rl.release_memory()  # colocated GPUs: the servers' memory goes to training
    if collected.rows:
        metrics |= train_on(actor, collected.batch, cfg, step, collected.rows)
    finite = guard.check(step, metrics)
    rl.resume_memory()
    metrics["time/train_s"] = time.perf_counter() - t0
    return finite


class NonFiniteGuard:
    """A step whose loss or gradient norm is not finite has its update skipped (actor) and
    writes no checkpoint; `limit` such steps in a row end the run with an error (the last
    checkpoint is from before them) that names the step's inputs that were not finite
    (advantages, the servers' log-probs: train/samples.py), or else points at the update's
    size. Every rank sees the same reduced loss and norm."""

    def __init__(self, limit: int):
        self.limit, self.in_row = limit, 0
        self.inputs: dict[str, float] = {}  # non-finite inputs over the steps in a row

    def check(self, step: int, metrics: dict) -> bool:
        bad = {k: metrics[k] for k in ("loss/policy", "grad_norm") if k in metrics}
        bad = {k: v for k, v in bad.items() if not np.isfinite(v)}
        if not bad and not metrics.get("update/nonfinite"):
            self.in_row, self.inputs = 0, {}
            return True
        self.in_row += 1
        for key in NONFINITE_INPUTS:
            self.inputs[key] = self.inputs.get(key, 0.0) + metrics.get(key, 0.0)
        what = ", ".join(f"{k} {v}" for k, v in bad.items()) or "a non-finite gradient"
        inputs = _inputs(metrics)
        log.warning("step %d: %s%s; its update was skipped (%d in a row)", step, what,
                    f", with {inputs} not finite" if inputs else "", self.in_row)  # fmt: skip
        self.last = (step, what)
        return False

    def stop_if_over(self) -> None:
        """After the step's metrics are logged: the error, once `limit` steps in a row failed."""
        if self.in_row < self.limit:
            return
        step, what = self.last
        inputs = _inputs(self.inputs)
        if inputs:
            fix = (f"the cause is the steps' inputs, not the learning rate: {inputs} were not "
                   "finite (advantages: rewards too large for them, where "
                   "algo.adv_norm=none keeps the rewards' scale, so scale the rewards "
                   "down; log-probs: check the rollout servers); fix that")  # fmt: skip
        else:
            fix = "lower optim.lr (or optim.clip_grad), check the data and rewards"
        raise UserError(
            f"training is not finite: {self.in_row} steps in a row up to step {step} had "
            f"{what}; their updates were skipped and no checkpoint was written since; {fix}, "
            f"then --resume from the last checkpoint (the limit is "
            f"train.max_nonfinite_steps={self.limit})"
        )


def _inputs(metrics: dict) -> str:
    """The inputs `metrics` counts as not finite: "3 advantages and 2 rollout log-probs"."""
    named = [f"{int(metrics[k])} {name}" for k, name in NONFINITE_INPUTS.items() if metrics.get(k)]
    return " and ".join(named)


def take_batch(ahead: Ahead, sync: WeightSync, rl: RolloutSource, step: int, current: str):
    """The step's batch: the one generated ahead during the last step (staleness 1), else one
    generated now (`collect_current`); with its staleness (the versions between the weights
    that generated it and `current`, the trainer's) and the trainer's wait for it."""
    t0 = time.perf_counter()
    taken = ahead.take(step)
    if taken is None:
        collected, version = collect_current(sync, rl, ahead.next_prompts(), step, current), current
    else:
        collected, version = taken
    # every trained sample started on `version` or later (groups from older weights were
    # dropped); the samples' own versions say which (rollouts.py: rollout/version_*)
    m, now = collected.metrics, version_index(current)
    oldest = m.get("rollout/version_oldest", float(version_index(version)))
    mean = m.get("rollout/version_mean", oldest)
    return collected, {"time/trainer_idle_s": time.perf_counter() - t0,
                       "rollout/staleness_mean": now - mean,
                       "rollout/staleness_max": now - oldest}  # fmt: skip


def collect_current(
    sync: WeightSync, rl: RolloutSource, prompts, step: int, current: str, tries: int = 3
):
    """The step's rollouts, from the trainer's weights: when a server restarted during them
    (onto older weights) gave some samples, it is caught up and the batch generated again (the
    same seeds: the same samples from the other servers), up to `tries` times in all; groups
    still stale after that are dropped (rollouts.py). Every rank sees the same metrics, so
    every rank takes the same turns (catch_up is collective)."""
    regenerated = 0.0
    for attempt in range(tries):
        collected = rl.collect(prompts, step, current)
        stale = collected.metrics.get("rollout/stale_samples", 0.0)
        if not stale or attempt == tries - 1:
            break
        log.warning("step %d: %d samples came from older weights; generating again", step, stale)
        catch_up(sync, rl, current)
        regenerated += stale
    collected.metrics["rollout/regenerated_samples"] = regenerated
    return collected


def catch_up(sync: WeightSync, rl: RolloutSource, current: str) -> dict:
    """Before a step's rollouts: wait for the servers their supervisor is restarting (onto
    the restore point), then bring every ready server that is on other weights to `current`."""
    t0 = time.perf_counter()
    rl.wait_for_restarts()
    urls = sync.catch_up(current, among=rl.ready_servers())
    return {"sync/caught_up_servers": len(urls), "time/catch_up_s": time.perf_counter() - t0}


def sync_weights(sync: WeightSync, rl: RolloutSource, step: int) -> dict:
    """The step's weight sync, as version `step`, into the servers that are ready (one that
    is being restarted is caught up before the next rollouts). A server that fails it while
    its supervisor restarts it (it died) does not end the run: it is restored or lost, never
    half-updated, and caught up next step. Any other failure ends the run."""
    before = rl.restart_counts()
    lost: list[str] = []
    report: SyncReport | None
    try:
        report = sync.sync(step, only=rl.ready_servers())
    except WeightSyncError as e:
        report = e.report
        if isinstance(e, VerificationFailed):  # synced, then its probe got no answer: it died?
            died, lost = e.only_unreachable, e.unreachable
        else:
            died = report is not None and not report.trainer_error
            lost = list(report.failures) if report is not None else []
        restarted = died and rl.being_restarted(lost, since=before)
        if not bcast(restarted if rl.rank0 else None):
            raise
        log.warning("%s\ntheir supervisor restarts them; the next step catches them up", e)
    rl.weights_at(sync.restore_point)  # what a restarted server loads
    # a failure the run goes on after carries its sync's report (sync() attaches it)
    assert report is not None
    failed = len(set(report.failures) | set(lost))
    return {"sync/gb_per_s": report.gb_per_s, "sync/failed_servers": failed}


def train_on(
    actor: PolicyActor, batch: RLBatch | None, cfg: Config, step: int, rows: int | None = None
) -> dict:
    """Old log-probs, then `algo.minibatches` optimizer steps over a shuffled split of the batch.

    `batch` is rank 0's whole batch of `rows` rows (None on the other ranks); every rank trains
    on its shard of it (train/shard.py: its replica's rows of each minibatch), and the
    metrics are reduced over the ranks.

    With `algo.on_policy_first_update` (default; not under R3) the first minibatch's old
    log-probs are those of its own training forward: its update runs on the very weights old
    log-probs are defined by, so they are exact there (ratios exactly 1) and the old-log-prob
    forward runs over the other minibatches only. The routing drift of that update is 0 by
    construction (its recorded routing is its natural routing) and is counted as such."""
    t0 = time.perf_counter()
    actor.set_lr(cfg.optim.lr_at(step, cfg.train.steps))
    n = len(batch) if batch is not None else rows
    assert n, "train_on needs the batch's size on every rank"
    parts = minibatch_parts(n, cfg.algo.minibatches, cfg.seed, step)
    batch = actor.shard(batch, parts)
    first_on_policy = cfg.algo.on_policy_first_update and cfg.algo.routing_replay != ReplayMode.R3
    ahead = [i for p in parts[1:] for i in p] if first_on_policy else list(range(n))
    # As many rows per forward as fit (one forward on a small model). The minibatches below are
    # other row sets with their own padding, so their forwards equal these to fp32 rounding.
    metrics = _old_logprobs(actor, batch, sorted(ahead), cfg.train.micro_batch_size)
    metrics["time/old_logprobs_s"] = time.perf_counter() - t0
    loss_cfg, mbs = cfg.algo.loss_config(), cfg.train.micro_batch_size
    per_update = []
    for k, part in enumerate(parts):
        mine = batch.positions_of(part)  # (all of them when every rank holds the batch)
        sub = batch.rows(mine, total=len(part))
        if k == 0 and first_on_policy:
            update = actor.train_step(sub, loss_cfg, mbs, on_policy=True)
            # both set: by this on-policy step, and by _old_logprobs above
            assert sub.old_logprobs is not None and batch.old_logprobs is not None
            for i, lp in zip(mine, sub.old_logprobs):
                batch.old_logprobs[i] = lp
        else:
            update = actor.train_step(sub, loss_cfg, mbs)
        per_update.append(update)
        if update.get("nonfinite"):  # the weights stay as they were; the step ends here
            break
    if first_on_policy and len(per_update) > 1:
        drift = {k for m in per_update[1:] for k in m if k.startswith((CHANGED, TOKENS_CHANGED))}
        per_update[0].update(dict.fromkeys(drift, 0.0))
    metrics |= _mismatch(batch)
    return metrics | _combine_updates(per_update)


def _old_logprobs(
    actor: PolicyActor, batch: RLBatch, rows: list[int], micro_batch_size: int
) -> dict:
    """Old log-probs (and recorded routing) of the whole batch's `rows` into the batch (of a
    shard: those it holds), None for the others; returns the forward's routing metrics."""
    n = len(batch)
    if len(rows) == batch.global_size:
        every, metrics = actor.logprobs(batch, micro_batch_size, fit_logits=True)
        batch.old_logprobs = cast(list[list[float | None] | None], every)  # (no copy)
        return metrics
    mine = batch.positions_of(rows)
    sub = replace(batch, old_logprobs=None, routing=None).rows(mine, total=len(rows))
    batch.old_logprobs = [None] * n
    if not rows:  # one minibatch, on policy: no old-log-prob pass at all
        return {}
    old, metrics = actor.logprobs(sub, micro_batch_size, fit_logits=True)
    routing = [None] * n if sub.routing is not None else None
    for j, i in enumerate(mine):
        batch.old_logprobs[i] = old[j]
        if routing is not None:
            assert sub.routing is not None  # routing is made only then
            routing[i] = sub.routing[j]
    batch.routing = routing
    return metrics


def _mismatch(batch: RLBatch) -> dict:
    """mean |old - rollout| log-prob over trained tokens: the train-vs-inference gap; under R3
    also split by whether the trainer's routing of the position that produced the token agreed
    with the rollout server's in every MoE layer (`_routing_same`) or not (`_routing_differs`)."""
    if batch.rollout_logprobs is None:
        return {}
    sums = {"": [0.0, 0], "_routing_same": [0.0, 0], "_routing_differs": [0.0, 0]}
    # train_on computed every row's old log-probs before this
    old_rows = cast("list[list[float | None] | None]", batch.old_logprobs)
    rows = zip(old_rows, batch.rollout_logprobs, batch.loss_mask)
    for i, (old, roll, mask) in enumerate(rows):
        if old is None:  # (a shard's rows on a stage before the last: no log-probs here)
            continue
        differs = _rollout_differs(batch, i)
        for t, (o, r, m) in enumerate(zip(old, roll, mask)):
            if m and o is not None and r is not None:
                keys = [""]
                if differs is not None and t >= 1:
                    keys.append("_routing_differs" if differs[t - 1] else "_routing_same")
                for key in keys:
                    sums[key][0] += abs(o - r)
                    sums[key][1] += 1
    if batch.sharded:  # every replica's tokens (counted once: on its last stage's first rank)
        sums = dict(zip(sums, reduce_sums(list(sums.values()))))
    return {f"mismatch/logprob_abs_diff{k}": total / n for k, (total, n) in sums.items() if n}


def _rollout_differs(batch: RLBatch, i: int):
    """Sample i's per-position rollout-vs-trainer routing flags (R3), or None."""
    routing = batch.routing[i] if batch.routing is not None else None
    return getattr(routing, "rollout_differs", None)


# actor metric -> (metrics key, how the minibatch updates of one step combine)
_KEYS = {
    "loss": ("loss/policy", "mean"),
    "grad_norm": ("grad_norm", "mean"),
    "lr": ("lr", "last"),
    "ratio_mean": ("ratio/mean", "mean"),
    "ratio_std": ("ratio/std", "mean"),
    "ratio_max": ("ratio/max", "max"),
    "ratio_min": ("ratio/min", "min"),
    "clip_frac_tokens": ("ratio/clip_fraction_tokens", "mean"),
    "clip_frac_seqs": ("ratio/clip_fraction_seqs", "mean"),
    "approx_kl_old": ("kl/old", "mean"),
    "entropy": ("entropy", "mean"),
    "tis_weight_mean": ("tis/weight_mean", "mean"),
    "mismatch_masked_frac_tokens": ("mismatch/masked_fraction_tokens", "mean"),
    "mismatch_masked_frac_seqs": ("mismatch/masked_fraction_seqs", "mean"),
    "sapo_gate_mean": ("sapo/gate_mean", "mean"),
    "log_ratio_std_same": ("ratio/token_std_routing_same", "mean"),
    "log_ratio_std_moved": ("ratio/token_std_routing_changed", "mean"),
}


def _combine_updates(per_update: list[dict]) -> dict:
    out: dict[str, float] = {}
    if not per_update:
        return out
    for src, (dst, how) in _KEYS.items():
        values = [m[src] for m in per_update if src in m]
        if values:
            out[dst] = _reduce(values, how)
    extra = {k for m in per_update for k in m if k.startswith("routing/")}
    for k in sorted(extra):
        out[k] = _reduce([m[k] for m in per_update if k in m], "mean")
    out["update/skipped"] = float(sum(not m.get("update_ok", True) for m in per_update))
    out["update/nonfinite"] = float(sum(m.get("nonfinite", 0.0) for m in per_update))
    out["ratio/first_update_mean"] = per_update[0].get("ratio_mean", float("nan"))
    return out


def _reduce(values: list[float], how: str) -> float:
    if how == "max":
        return float(max(values))
    if how == "min":
        return float(min(values))
    if how == "last":
        return float(values[-1])
    return float(sum(values) / len(values))
