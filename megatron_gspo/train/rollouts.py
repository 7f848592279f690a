"""The rollout side of the RL loop: servers, prompts, generation, rewards and advantages.

Global rank 0 owns it: it starts and supervises the rollout servers (or health-checks the ones a
launch script started), samples G responses per prompt, scores them and computes the group
advantages. The finished `StepBatch` and its metrics are broadcast to every trainer rank, so every
rank trains on exactly the same batch. Other ranks only learn the server URLs (for the weight
sync) and receive batches.

Determinism: every request carries `sampling_seed = f(seed, step)` + its index, so a resumed run
draws the same responses as an uninterrupted one (the servers hold the same weights after the
resume's first sync).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_gspo.algo import group_advantages
from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.modes import Backend
from megatron_gspo.rollout.sample import version_index
from megatron_gspo.routing.replay import ReplayMode
from megatron_gspo.train.generate import Generation
from megatron_gspo.train.results import Collected
from megatron_gspo.train.samples import (
    check_samples,
    model_topk,
    nonfinite_inputs,
    report_broken_rows,
    reward_failures,
    rollout_metrics,
    sample_versions,
    to_batch,
)

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient
    from megatron_gspo.rollout.launcher import ServerGroup

log = logging.getLogger(__name__)


class Rollouts:
    """Rank 0: servers + client + data + rewards. Every rank: `collect` and `evaluate`."""

    def __init__(self, cfg: Config, run_dir: Path, hf_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.hf_dir = hf_dir
        self.rank0 = dist.get_rank() == 0
        self.group: ServerGroup | None = None
        self.client: RolloutClient | None = None  # every server: health, memory release/resume
        # generation: the router when there is one, else `client`
        self.generator: RolloutClient | None = None
        self.gen: Generation | None = None  # rank 0: completions or episodes, and rewards
        self._loop: asyncio.AbstractEventLoop | None = None
        self.urls: list[str] = []
        self.api_key: str | None = None  # the servers' key: the launch script's, or one we made

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Rollouts:
        if self.rank0:
            self._start()
        box = [(self.urls, self.api_key)]
        dist.broadcast_object_list(box, src=0)  # the trainer's own ranks (the weight sync)
        self.urls, self.api_key = box[0]
        return self

    def __exit__(self, *exc) -> None:
        if self.gen is not None:
            self.gen.close()
        if self._loop is not None:
            for c in {id(c): c for c in (self.client, self.generator) if c is not None}.values():
                self._run(c.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._io.join()
            self._loop.close()
        if self.group is not None:
            self.group.stop()

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from megatron_gspo.data.prompts import load_prompts
        from megatron_gspo.rollout.client import RolloutClient

        cfg = self.cfg
        self.train_rows = load_prompts(cfg.data.train, "train", cfg.seed)
        self.eval_rows = load_prompts(cfg.data.eval or cfg.data.train, "eval", cfg.seed)
        report_broken_rows(self.train_rows, "data.train")
        if cfg.data.eval and cfg.data.eval != cfg.data.train:
            report_broken_rows(self.eval_rows, "data.eval")
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        self.gen = Generation(cfg, self.tokenizer, self.run_dir)
        # Servers we start get a random key (a local user or a web page cannot drive them);
        # servers a launch script started use the one it exported.
        self.api_key = api_key() or (None if cfg.rollout.urls else secrets.token_hex(32))
        self.urls = list(cfg.rollout.urls) or self._launch()
        # the clients' event loop runs on a thread of its own: rollouts generated ahead of
        # training (train/ahead.py) and the main thread's requests share it
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="rollout-io", daemon=True)
        self._io.start()
        topk = model_topk(self.hf_dir)
        outage = cfg.rollout.health_timeout_s  # servers down: wait this long for a restart
        self.client = RolloutClient(
            self.urls, api_key=self.api_key, topk=topk, timeout_s=cfg.rollout.health_timeout_s,
            outage_s=outage,
        )  # fmt: skip
        self._wait_healthy(self.client, "rollout.urls")
        self.generator = self.client
        if cfg.rollout.router_url:
            self.generator = RolloutClient(
                [cfg.rollout.router_url], api_key=self.api_key, topk=topk,
                timeout_s=cfg.rollout.health_timeout_s, max_concurrency=self.client.max_concurrency
                * len(self.urls), outage_s=outage,
            )  # fmt: skip
            self._wait_healthy(self.generator, "rollout.router_url")

    def _wait_healthy(self, client, key: str) -> None:
        """Servers someone else started (`key`) must answer soon: nothing listening at one of
        them is an error after rollout.connect_grace_s, not a wait of the whole health timeout."""
        from megatron_gspo.rollout.client import RolloutError

        r = self.cfg.rollout
        refused_s = r.connect_grace_s if r.urls else None  # ours: healthy when started
        try:
            self._run(client.wait_healthy(r.health_timeout_s, refused_s=refused_s))
        except RolloutError as e:
            raise UserError(f"{e}; check {key}") from None

    def _launch(self) -> list[str]:
        from megatron_gspo.rollout.launcher import ServerConfig, ServerFailed, ServerGroup

        r = self.cfg.rollout
        server = ServerConfig(
            model_path=str(self.hf_dir),
            kind=r.backend,
            enable_return_routed_experts=self.cfg.algo.routing_replay == ReplayMode.R3,
            tp_size=r.server_tp,
            dtype=r.dtype,
            quantization=r.quantization,
            extra_args=list(r.extra_server_args),
            threads=1 if r.backend == Backend.BUILTIN else 0,
            api_key=self.api_key,
        )
        python = r.sglang_python or os.environ.get("SGLANG_PYTHON")
        if r.backend == Backend.SGLANG:
            if python:
                server.python = python  # SGLang in its own environment (the image sets this)
            self._size_sglang(server)
        self.group = ServerGroup(
            [server] * r.servers, self.run_dir / "logs", health_timeout_s=r.health_timeout_s
        )
        try:
            self.group.start()
        except ServerFailed as e:
            raise UserError(f"a rollout server did not start: {e.summary()}") from None
        return self.group.urls

    def _size_sglang(self, server) -> None:
        """What SGLang needs from the machine and the run (rollout/server_config.py)."""
        from megatron_gspo.data.prompts import encode_prompt
        from megatron_gspo.rollout.server_config import size_sglang

        rows = self.train_rows.rows[:1024]
        longest = max((len(self._encode(encode_prompt, row.prompt)) for row in rows), default=0)
        size_sglang(server, self.cfg, self.hf_dir, longest, torch.cuda.is_available())

    @property
    def _gen(self) -> Generation:
        assert self.gen is not None  # rank 0 made it on entering
        return self.gen

    def _run(self, coro):
        assert self._loop is not None  # rank 0 made it on entering
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def n_train_prompts(self) -> int:
        box = [len(self.train_rows.rows) if self.rank0 else 0]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def weights_at(self, point) -> None:
        """Tell the supervisor what a restarted server loads: the weight sync's restore point
        (the last whole version on disk, else the base model, which a server starts on anyway),
        labelled with its own version. The trainer's catch_up brings it to the current weights
        before the next rollouts."""
        if self.group is None:
            return
        if Path(point.path).resolve() == Path(self.hf_dir).resolve():
            self.group.set_current_weights()
        else:
            self.group.set_current_weights(model_path=point.path, weight_version=point.version)

    def wait_for_restarts(self) -> None:
        """Rank 0: wait until the servers that died are restarted (their supervisor's), so that
        the weight sync's catch_up finds them before the rollouts."""
        if self.group is None:
            return
        down = self.group.wait_restarts()
        if down:
            log.warning("rollout servers %s are down; the rollouts go to the others", down)

    def ready_servers(self) -> list[int] | None:
        """Rank 0: the servers (by index) a weight sync may update now: those up and on their
        weights, not one in the middle of a restart (which loads the restore point from disk
        and would mix it with the sync's buckets). None: all (no supervisor: the user's own)."""
        if self.group is None or not self.rank0:
            return None
        return self.group.ready()

    def restart_counts(self) -> list[int] | None:
        """Rank 0: how many times the supervisor has restarted each server so far."""
        if self.group is None or not self.rank0:
            return None
        return [s.restarts for s in self.group.servers]

    def being_restarted(self, urls, since: list[int] | None = None) -> bool:
        """Rank 0: whether the supervisor is restarting every one of `urls` (or is about to),
        or has restarted it since `since` (restart_counts() then): a server that died during a
        sync may be up again, quickly restarted, by the time the sync reports it."""
        if self.group is None or not self.rank0:
            return False
        return self.group.recovering([self.group.urls.index(u) for u in urls], since)

    def servers_busy_s(self) -> float | None:
        """The servers' own working seconds so far, summed (rank 0; None elsewhere, or where a
        server does not report them: SGLang)."""
        return self._run(self.client.busy_seconds()) if self.rank0 and self.client else None

    def release_memory(self) -> None:
        """Colocated servers give their GPU memory to the trainer while it trains."""
        self._memory("/release_memory_occupation")

    def resume_memory(self) -> None:
        """...and take it back before the weight sync, once the trainer's cached blocks are
        back with the driver."""
        if self.cfg.rollout.release_memory and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._memory("/resume_memory_occupation")

    def _memory(self, path: str) -> None:
        if self.rank0 and self.cfg.rollout.release_memory:
            assert self.client is not None  # rank 0 made it on entering
            self._run(self.client.broadcast(path, {"tags": ["weights", "kv_cache"]}))
        dist.barrier()

    # ---- one step's batch ------------------------------------------------------------------

    def collect(self, prompt_index: list[int], step: int, version: str | None = None) -> Collected:
        """G responses for each prompt, scored: the batch on rank 0 (the actor's `shard` sends
        every rank its rows), its metrics and size on every rank."""
        return self.share(self.gather(prompt_index, step, version) if self.rank0 else None)

    def gather(self, prompt_index: list[int], step: int, version: str | None = None) -> Collected:
        """Rank 0: the step's batch and metrics (any thread: train/ahead.py runs it on one of
        its own while the trainer trains)."""
        return self._collect(prompt_index, step, version)

    def abort_generation(self) -> None:
        """Rank 0: abort every request in flight (they return what they have so far), for good."""
        if self.generator is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.generator.hold.stop)
            self._run(self.generator.abort())

    def hold_generation(self, on: bool) -> None:
        """Rank 0, rollout.partial: hold the generation in flight before a weight sync (its
        requests are aborted and none is sent), or let it go on after (rollout/partial.py)."""
        if self.generator is not None and self._loop is not None:
            hold = self.generator.hold
            self._run(hold.pause()) if on else self._loop.call_soon_threadsafe(hold.resume)

    def share(self, result: Collected | None) -> Collected:
        """Rank 0's `gather` result -> the batch on rank 0, its metrics and size everywhere."""
        if result is not None:
            result.rows = 0 if result.batch is None else len(result.batch)
        if dist.get_world_size() == 1:
            assert result is not None  # one process: it is rank 0
            return result
        box = [None if result is None else replace(result, batch=None)]
        dist.broadcast_object_list(box, src=0)  # (the step's facts and metrics, not its rows)
        shared = box[0]
        assert shared is not None  # rank 0's, on every rank
        return replace(shared, batch=result.batch if result is not None else None)

    def _collect(self, prompt_index: list[int], step: int, version: str | None) -> Collected:
        from megatron_gspo.data.prompts import encode_prompt
        from megatron_gspo.rewards import dynamic_sampling_keep, overlong_shaped

        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        rows = [self.train_rows.rows[i] for i in prompt_index]
        prompts = [self._encode(encode_prompt, row.prompt) for row in rows]
        assert self.generator is not None  # rank 0 made it on entering
        r3 = cfg.algo.routing_replay == ReplayMode.R3
        grouped = r.group_requests and not r.router_url  # (sglang-router takes no batches)
        out = self._run(self._gen.rollout(self.generator, rows, prompts, r.group_size,
                                          self._sampling(step), r3, grouped, step))  # fmt: skip
        t_gen = time.perf_counter() - t0 - out.reward_wait_s  # (until the generation ended)
        groups, scored = out.groups, out.scored
        samples = [s for g in groups for s in g]
        check_samples(samples)
        failed = reward_failures(scored, step)
        rewards = overlong_shaped(cfg, samples, [0.0 if v is None else v for v in scored.rewards])
        metrics = rollout_metrics(samples, scored.rewards, t_gen)
        facts = Collected(None, metrics, generation_s=t_gen)
        metrics["reward/failed_samples"] = float(len(failed))
        metrics["time/reward_wait_s"] = out.reward_wait_s  # (scoring after generation ended)
        G = r.group_size
        stale = set()  # groups with a sample from older weights than its generation's (a restart)
        if version is not None:
            old = [k for k, s in enumerate(samples)
                   if version_index(str(s.weight_version)) < version_index(version)]  # fmt: skip
            stale = {k // G for k in old}
            metrics["rollout/stale_samples"] = float(len(old))
            facts.stale_samples = len(old)
            metrics["rollout/stale_groups_dropped"] = float(len(stale))
            if old:
                log.warning("step %d: %d samples came from weights older than %s; their %d "
                            "groups are dropped", step, len(old), version, len(stale))  # fmt: skip
        keep = list(range(len(groups)))
        if cfg.algo.dynamic_sampling:
            keep = dynamic_sampling_keep(rewards, r.group_size)
            metrics["rollout/groups_kept"] = float(len(keep))
        # A group is trained on whole or not at all: its baseline is the mean of its samples,
        # which must all come from the policy the step's old log-probs belong to.
        unscored = {k // G for k in failed}  # (a group without its baseline sample)
        metrics["rollout/reward_failed_groups_dropped"] = float(len(unscored))
        dropped = stale | unscored
        keep = [g for g in keep if g not in dropped]
        if not keep:
            return facts
        samples = [samples[g * G + j] for g in keep for j in range(G)]
        facts.set_versions(*sample_versions(samples))  # (the weights the tokens came from)
        kept_rewards = torch.tensor(rewards, dtype=torch.float64).view(-1, G)[keep].flatten()
        adv = group_advantages(kept_rewards, G, scale_by_std=cfg.algo.advantage_std_norm)
        facts.set_nonfinite_inputs(nonfinite_inputs(samples, adv))  # (the guard names them)
        facts.batch = to_batch(samples, adv.tolist())
        return facts

    def _encode(self, encode_prompt, text: str) -> list[int]:
        ids = encode_prompt(self.tokenizer, text, self.cfg.data.template)
        if len(ids) > self.cfg.data.max_prompt_tokens:
            ids = ids[-self.cfg.data.max_prompt_tokens :]
        return ids

    def _sampling(self, step: int, greedy: bool = False) -> dict:
        r = self.cfg.rollout
        params = {"max_new_tokens": r.max_new_tokens}
        if greedy:
            return params | {"temperature": 0.0}
        seed = (self.cfg.seed * 1_000_003 + step * 65_537) % (2**31)
        return params | {"temperature": r.temperature, "top_p": r.top_p, "sampling_seed": seed}

    # ---- eval ------------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean greedy reward on the held-out prompts (every rank gets it)."""
        value = self._evaluate() if self.rank0 else 0.0
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _evaluate(self) -> float:
        from megatron_gspo.data.prompts import encode_prompt

        rows = self.eval_rows.rows[: self.cfg.train.eval_prompts]
        prompts = [self._encode(encode_prompt, row.prompt) for row in rows]
        assert self.generator is not None  # rank 0 made it on entering
        greedy = self._sampling(0, greedy=True)
        scored = self._run(self._gen.rollout(self.generator, rows, prompts, 1, greedy)).scored
        if scored.failures:
            log.warning("eval: the reward failed on %d of %d samples, counted wrong (first: %s)",
                        len(scored.failures), len(rows), scored.failures[0])  # fmt: skip
        return sum(v or 0.0 for v in scored.rewards) / max(len(rows), 1)


def api_key() -> str | None:
    """Servers a launch script started off loopback require a key; it comes in the environment
    (never on a command line or in the config file)."""
    return os.environ.get("MEGATRON_GSPO_API_KEY") or None
