"""The RL loop (`megatron-gspo train`).

One step: prompts -> G rollouts each -> rewards -> group advantages -> old log-probs (R2 records
routing) -> minibatch updates (R2/R3 replay) -> weight sync -> metrics -> checkpoint.
`run` reads like that list; its parts come built (parts.py): the servers (fleet.py), the batches
(producer.py, shared to every rank by share.py), actor.py (log-probs, the Megatron train step),
weight_sync/, and the step hooks in hooks.py (eval, metrics, checkpoints).
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_gspo.comm import bcast
from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.sample import version_index
from megatron_gspo.routing.metrics import CHANGED, TOKENS_CHANGED
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.train.ahead import Ahead
from megatron_gspo.train.batch import StepBatch
from megatron_gspo.train.guard import NonFiniteGuard
from megatron_gspo.train.hooks import StepHooks, last_step
from megatron_gspo.train.parts import Parts
from megatron_gspo.train.protocols import PolicyActor, RolloutSource, Servers
from megatron_gspo.train.results import Collected, Update
from megatron_gspo.train.reward_kl import apply_reward_kl
from megatron_gspo.train.shard import minibatch_parts, reduce_sums
from megatron_gspo.train.state import TrainState
from megatron_gspo.weight_sync.session import SyncReport, VerificationFailed
from megatron_gspo.weight_sync.sync import WeightSync, WeightSyncError

log = logging.getLogger(__name__)


def run(parts: Parts, *, max_steps: int | None = None) -> None:
    """Train on `parts` (parts.py `build_parts`) up to `train.steps` (or `max_steps`)."""
    cfg, setup, fleet, rl, sync = parts.cfg, parts.setup, parts.fleet, parts.rollouts, parts.sync
    ahead = Ahead(rl, parts.sampler, cfg.rollout.max_staleness, cfg.rollout.partial)
    try:
        hooks = StepHooks(cfg, parts.run_dir, setup, rl)
        state = setup.restore(parts.sampler, sync, fleet)  # resume: weights, optimizer, data
        last = last_step(cfg, max_steps)
        hooks.begin(state, last)
        current = str(state.weight_version) if state.step else sync.base_version
        guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
        for step in range(state.step + 1, last + 1):
            t0, busy0 = time.perf_counter(), fleet.servers_busy_s()
            caught_up = catch_up(sync, fleet, current)
            collected, waited = take_batch(ahead, sync, parts, step, current)
            ahead.fill(step, last, current)  # (the next batches generate while this trains)
            metrics = dict(collected.metrics) | caught_up | waited
            finite = train_phase(setup.actor, fleet, collected, cfg, step, guard, metrics)
            generating = ahead.before_sync()  # the weights change under no request
            t1 = time.perf_counter()
            busy = generating if cfg.rollout.max_staleness else collected.generation_s
            metrics["time/servers_idle_s"] = servers_idle(fleet, busy0, t1 - t0, busy)
            metrics |= sync_weights(sync, fleet, step)
            ahead.after_sync()
            current = str(step)
            metrics |= {"time/sync_s": time.perf_counter() - t1, "weight_version": step}
            state = TrainState(step, step, ahead.sampler_state())
            hooks.end_step(step, metrics, state, t0, last, checkpoint=finite)
            guard.stop_if_over()
        hooks.finish(state)
    finally:  # also after a failure: the generations in flight end before the servers stop
        ahead.close()


def refused_sync(e: WeightSyncError) -> str:
    """The error line for a sync the servers refused (each says why, often with its fix): the
    report's lines on one."""
    report = "; ".join(line.strip() for line in str(e).splitlines()).replace(":;", ":")
    return (f"{report}; fix what the servers say (their logs say more), then run again "
            "(--resume goes on from the last checkpoint)")  # fmt: skip


def servers_idle(fleet: Servers, busy0: float | None, wall: float, generating: float) -> float:
    """A server's mean idle seconds in the `wall` seconds of this step before its sync: from the
    servers' own working time where they report it (the built-in server; `busy0` at the step's
    start), else the trainer's view (`wall` minus the time it had generation in flight)."""
    busy1 = fleet.servers_busy_s() if busy0 is not None else None
    if busy0 is None or busy1 is None:
        return max(0.0, wall - generating)
    return max(0.0, wall - (busy1 - busy0) / max(len(fleet.urls), 1))


def train_phase(actor, fleet: Servers, collected: Collected, cfg: Config, step: int,
                guard: NonFiniteGuard, metrics: dict) -> bool:  # fmt: skip
    """The step's training, its metrics into `metrics`: whether it was finite (a checkpoint
    may follow)."""
    t0 = time.perf_counter()
    fleet.release_memory()  # colocated GPUs: the servers' memory goes to training
    updates: list[Update] = []
    if collected.rows:
        trained, updates = train_on(actor, collected.batch, cfg, step, collected.rows)
        metrics |= trained
    finite = guard.check(step, updates, collected.nonfinite_inputs)
    fleet.resume_memory()
    metrics["time/train_s"] = time.perf_counter() - t0
    return finite


def take_batch(ahead: Ahead, sync: WeightSync, parts: Parts, step: int, current: str):
    """The step's batch: the one generated ahead during the last steps (ahead.py), else one
    generated now (`collect_current`); with its staleness (the versions between the weights
    that generated it and `current`, the trainer's) and the trainer's wait for it. A batch
    generated ahead whose every sample came from weights older than its generation started on
    (beyond rollout.max_staleness) is generated again now: a restarted server is caught up, and
    one that never takes the trainer's weights stops the run, where it used to train nothing
    on every step and end with exit 0."""
    t0 = time.perf_counter()
    taken = ahead.take(step)
    if taken is not None and not taken.collected.all_stale:
        collected, version = taken.collected, taken.version
    else:
        if taken is not None:  # (a server on older weights: generated again, or the run stops)
            log.warning("step %d: every sample generated ahead came from weights older than %s "
                        "(%r); generating the batch again", step, taken.version,
                        taken.collected.stale_version)  # fmt: skip
        prompts = ahead.next_prompts() if taken is None else taken.prompts
        collected = collect_current(sync, parts.rollouts, parts.fleet, prompts, step, current)
        version = current
    # every trained sample started on `version` or later (groups from older weights were
    # dropped); the samples' own versions say which (producer.py)
    now = version_index(current)
    oldest = collected.version_oldest
    oldest = float(version_index(version)) if oldest is None else oldest
    mean = oldest if collected.version_mean is None else collected.version_mean
    return collected, {"time/trainer_idle_s": time.perf_counter() - t0,
                       "rollout/staleness_mean": now - mean,
                       "rollout/staleness_max": now - oldest}  # fmt: skip


def collect_current(
    sync: WeightSync,
    rl: RolloutSource,
    fleet: Servers,
    prompts: list[int],
    step: int,
    current: str,
    tries: int = 3,
) -> Collected:
    """The step's rollouts, from the trainer's weights: when a server restarted during them
    (onto older weights) gave some samples, it is caught up and the batch generated again (the
    same seeds: the same samples from the other servers), up to `tries` times in all; groups
    still stale after that are dropped (producer.py); when that is every sample, the servers
    do not take the trainer's weights (or do not say so), and the run stops with an error
    rather than train nothing step after step. Every rank sees the same facts, so every rank
    takes the same turns (catch_up is collective)."""
    regenerated = 0
    for attempt in range(tries):
        collected = rl.collect(prompts, step, current)
        stale = collected.stale_samples
        if not stale or attempt == tries - 1:
            break
        log.warning("step %d: %d samples came from older weights; generating again", step, stale)
        catch_up(sync, fleet, current)
        regenerated += stale
    if collected.all_stale:
        raise UserError(
            f"step {step}: every rollout sample came from weights older than the trainer's "
            f"(version {current}; the servers answered weight_version "
            f"{collected.stale_version!r}), {tries} times with the servers caught up in between: "
            "they do not load the weights the trainer sends, or do not report them; check that "
            "rollout.urls points at SGLang-compatible servers of this run (not a cache or a "
            "server another run updates)"
        )
    collected.regenerated_samples = regenerated
    collected.metrics["rollout/regenerated_samples"] = float(regenerated)
    return collected


def catch_up(sync: WeightSync, fleet: Servers, current: str) -> dict:
    """Before a step's rollouts: wait for the servers their supervisor is restarting (onto
    the restore point), then bring every ready server that is on other weights to `current`."""
    t0 = time.perf_counter()
    fleet.wait_for_restarts()
    urls = sync.catch_up(current, among=fleet.ready_servers())
    return {"sync/caught_up_servers": len(urls), "time/catch_up_s": time.perf_counter() - t0}


def sync_weights(sync: WeightSync, fleet: Servers, step: int) -> dict:
    """The step's weight sync, as version `step`, into the servers that are ready (one that
    is being restarted is caught up before the next rollouts). A server that fails it while
    its supervisor restarts it (it died) does not end the run: it is restored or lost, never
    half-updated, and caught up next step. Any other failure ends the run."""
    before = fleet.restart_counts()
    lost: list[str] = []
    report: SyncReport | None
    try:
        report = sync.sync(step, only=fleet.ready_servers())
    except WeightSyncError as e:
        report = e.report
        if isinstance(e, VerificationFailed):  # synced, then its probe got no answer: it died?
            died, lost = e.only_unreachable, e.unreachable
        else:
            died = report is not None and not report.trainer_error
            lost = list(report.failures) if report is not None else []
        # (rank 0's answer: only its fleet has the supervisor)
        if not bcast(died and fleet.being_restarted(lost, since=before)):
            if isinstance(e, UserError) or report is None or report.trainer_error:
                raise
            raise UserError(refused_sync(e)) from None
        log.warning("%s\ntheir supervisor restarts them; the next step catches them up", e)
    fleet.weights_at(sync.restore_point)  # what a restarted server loads
    # a failure the run goes on after carries its sync's report (sync() attaches it)
    assert report is not None
    failed = len(set(report.failures) | set(lost))
    return {"sync/gb_per_s": report.gb_per_s, "sync/failed_servers": failed}


def train_on(
    actor: PolicyActor, batch: StepBatch | None, cfg: Config, step: int, rows: int | None = None
) -> tuple[dict, list[Update]]:
    """Old log-probs, then `algo.minibatches` optimizer steps over a shuffled split of the batch:
    the step's metrics (for logging) and its updates (for deciding).

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
    # (a KL in the reward needs every row's old log-probs before the first update)
    first_on_policy = (cfg.algo.on_policy_first_update and not cfg.algo.kl_in_reward
                       and cfg.algo.routing_replay != ReplayMode.R3)  # fmt: skip
    ahead = [i for p in parts[1:] for i in p] if first_on_policy else list(range(n))
    # As many rows per forward as fit (one forward on a small model). The minibatches below are
    # other row sets with their own padding, so their forwards equal these to fp32 rounding.
    if actor.reference is not None:  # algo.kl_coef > 0: once per step, every row
        batch.set("ref_logprobs", actor.reference_logprobs(batch, cfg.train.micro_batch_size))
    metrics = _old_logprobs(actor, batch, sorted(ahead), cfg.train.micro_batch_size)
    if actor.reference is not None and cfg.algo.kl_in_reward:  # the advantages, penalized
        G = cfg.rollout.group_size
        metrics |= apply_reward_kl(batch, cfg.algo, G)
    metrics["time/old_logprobs_s"] = time.perf_counter() - t0
    loss_cfg, mbs = cfg.algo, cfg.train.micro_batch_size
    updates: list[Update] = []
    for k, part in enumerate(parts):
        mine = batch.positions_of(part)  # (all of them when every rank holds the batch)
        sub = batch.rows(mine, total=len(part))
        on_policy = k == 0 and first_on_policy
        updates.append(actor.train_step(sub, loss_cfg, mbs, on_policy=on_policy))
        if on_policy:  # its old log-probs: those of this on-policy step
            batch.set_rows("old_logprobs", mine, sub["old_logprobs"])
        if not updates[-1].finite:  # the weights stay as they were; the step ends here
            break
    per_update = [dict(u.stats) for u in updates]
    if first_on_policy and len(per_update) > 1:
        drift = {k for m in per_update[1:] for k in m if k.startswith((CHANGED, TOKENS_CHANGED))}
        per_update[0].update(dict.fromkeys(drift, 0.0))
    metrics |= mismatch_metrics(batch)
    return metrics | _combine_updates(updates, per_update), updates


def _old_logprobs(
    actor: PolicyActor, batch: StepBatch, rows: list[int], micro_batch_size: int
) -> dict:
    """Old log-probs (and recorded routing) of the whole batch's `rows` into the batch (of a
    shard: those it holds) at their tokens with a loss, NaN elsewhere; returns the forward's
    routing metrics."""
    if len(rows) == batch.global_size:
        every, metrics = actor.logprobs(batch, micro_batch_size, fit_logits=True,
                                        trained_only=True)  # fmt: skip
        batch.set("old_logprobs", every)
        return metrics
    mine = batch.positions_of(rows)
    sub = batch.without("old_logprobs", "routing").rows(mine, total=len(rows))
    batch.set("old_logprobs", torch.full((batch.num_tokens,), float("nan")))
    if not rows:  # one minibatch, on policy: no old-log-prob pass at all
        return {}
    old, metrics = actor.logprobs(sub, micro_batch_size, fit_logits=True, trained_only=True)
    batch.set_rows("old_logprobs", mine, old)
    routing = [None] * len(batch) if sub.routing is not None else None
    for j, i in enumerate(mine):
        if routing is not None:
            assert sub.routing is not None  # routing is made only then
            routing[i] = sub.routing[j]
    batch.routing = routing
    return metrics


def mismatch_metrics(batch: StepBatch) -> dict:
    """mean |old - rollout| log-prob over trained tokens: the train-vs-inference gap; under R3
    also split by whether the trainer's routing of the position that produced the token agreed
    with the rollout server's in every MoE layer (`_routing_same`) or not (`_routing_differs`).
    Tokens without both log-probs (a shard's rows on a stage before the last) are not counted."""
    roll, old = batch.get("rollout_logprobs"), batch.get("old_logprobs")
    if roll is None or old is None:
        return {}
    ok = batch["loss_mask"] & ~old.isnan() & ~roll.isnan()
    diff = (old - roll).abs().double()
    known, differs = _rollout_differs(batch)
    keys = {"": ok, "_routing_same": ok & known & ~differs, "_routing_differs": ok & differs}
    sums = [[float(diff[m].sum()), float(m.sum())] for m in keys.values()]
    if batch.sharded:  # every replica's tokens (counted once: on its last stage's first rank)
        sums = reduce_sums(sums)
    return {f"mismatch/logprob_abs_diff{k}": total / n for k, (total, n) in zip(keys, sums) if n}


def _rollout_differs(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token [T] (R3): whether its producing position's rollout-vs-trainer routing flag is
    known, and whether it differs (token t of a row: position t - 1; token 0 has none)."""
    known = torch.zeros(batch.num_tokens, dtype=torch.bool)
    differs = torch.zeros(batch.num_tokens, dtype=torch.bool)
    cu = batch.cu_seqlens.tolist()
    for i, s in enumerate(batch.routing or []):
        flags = getattr(s, "rollout_differs", None)
        if flags is None:
            continue
        n = min(len(flags), cu[i + 1] - cu[i] - 1)
        known[cu[i] + 1 : cu[i] + 1 + n] = True
        differs[cu[i] + 1 : cu[i] + 1 + n] = torch.as_tensor(flags[:n], dtype=torch.bool)
    return known, differs


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
    "kl_ref": ("kl/ref", "mean"),
    "log_ratio_std_same": ("ratio/token_std_routing_same", "mean"),
    "log_ratio_std_moved": ("ratio/token_std_routing_changed", "mean"),
    "padding_fraction": ("train/padding_fraction", "mean"),
    "tokens_per_microbatch": ("train/tokens_per_microbatch", "mean"),
}


def _combine_updates(updates: list[Update], per_update: list[dict]) -> dict:
    """The step's update metrics (logging): each actor statistic combined over the updates."""
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
    out["update/skipped"] = float(sum(not u.applied for u in updates))
    out["update/nonfinite"] = float(sum(not u.finite for u in updates))
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
