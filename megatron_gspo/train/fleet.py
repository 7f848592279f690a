"""The rollout servers as the trainer sees them: started and supervised here (`rollout.backend`,
`rollout.servers`), or the ones a launch script started (`rollout.urls`: health-checked, and
refused where they serve another model, rollout/served_model.py); their restarts, the restore
point a restarted server loads, memory release for colocated GPUs, and the servers' own busy
time.

Rank 0 holds the real fleet (the supervisor and a client of every server). The other ranks hold
a view of it (`ServerFleet(urls, api_key)`, built in share.py): the URLs and key for the weight
sync, no supervisor and no client, so each question about restarts answers "no supervisor"
(None) there, as it does for servers someone else started.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_gspo.config import Config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.modes import Backend
from megatron_gspo.rollout.server_config import API_KEY_ENV
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.train.io_thread import IoThread
from megatron_gspo.train.samples import model_sizes

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient
    from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup
    from megatron_gspo.weight_sync.disk import RestorePoint

log = logging.getLogger(__name__)


class ServerFleet:
    """The servers' URLs and key (every rank); their supervisor and clients (rank 0)."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None,
        *,
        release_memory: bool = False,
        group: ServerGroup | None = None,
        io: IoThread | None = None,
        base_model: Path | None = None,
    ):
        self.urls, self.api_key = urls, api_key
        self.base_model = base_model  # what a server starts on
        self.release = release_memory  # rollout.release_memory: colocated GPUs
        self.group = group  # the supervisor: None for the user's servers, and on other ranks
        self.io = io
        self.client: RolloutClient | None = None  # every server: health, memory, busy time
        self.generator: RolloutClient | None = None  # generation: the router, else `client`

    @classmethod
    def start(
        cls,
        cfg: Config,
        run_dir: Path,
        hf_dir: Path,
        io: IoThread,
        longest_prompt: Callable[[], int],
    ) -> ServerFleet:
        """Rank 0: start the servers (or find the user's) and wait until they answer.
        `longest_prompt()`: the longest prompt's tokens, which SGLang's sizing needs."""
        # Servers we start get a random key (a local user or a web page cannot drive them);
        # servers a launch script started use the one it exported.
        key = api_key() or (None if cfg.rollout.urls else secrets.token_hex(32))
        group = None
        if not cfg.rollout.urls:
            group = _launch(cfg, run_dir, hf_dir, key, longest_prompt)
        urls = group.urls if group is not None else list(cfg.rollout.urls)
        release = cfg.rollout.release_memory
        fleet = cls(urls, key, release_memory=release, group=group, io=io, base_model=hf_dir)
        try:
            fleet._connect(cfg, hf_dir)
        except BaseException:
            fleet.close()
            raise
        return fleet

    def _connect(self, cfg: Config, hf_dir: Path) -> None:
        from megatron_gspo.rollout.client import RolloutClient
        from megatron_gspo.rollout.served_model import check_served_models

        r, (topk, vocab, layers) = cfg.rollout, model_sizes(hf_dir)
        outage = r.health_timeout_s  # servers down: wait this long for a restart
        logs = {s.url: str(s.log_path) for s in self.group.servers} if self.group else None
        self.client = RolloutClient(
            self.urls, api_key=self.api_key, topk=topk, timeout_s=r.health_timeout_s,
            outage_s=outage, vocab_size=vocab, layers=layers, server_logs=logs,
        )  # fmt: skip
        self._wait_healthy(cfg, self.client, "rollout.urls")
        if r.urls:  # servers someone else started: another model's would train on garbage
            assert self.io is not None  # (rank 0's fleet)
            self.io.run(check_served_models(self.client, hf_dir, vocab))
        self.generator = self.client
        if r.router_url:
            self.generator = RolloutClient(
                [r.router_url], api_key=self.api_key, topk=topk, timeout_s=r.health_timeout_s,
                max_concurrency=self.client.max_concurrency * len(self.urls), outage_s=outage,
                vocab_size=vocab, layers=layers,
            )  # fmt: skip
            self._wait_healthy(cfg, self.generator, "rollout.router_url")

    def _wait_healthy(self, cfg: Config, client: RolloutClient, key: str) -> None:
        """Servers someone else started (`key`) must answer soon: nothing listening at one of
        them is an error after rollout.connect_grace_s, not a wait of the whole health timeout."""
        from megatron_gspo.rollout.client import RolloutError

        r = cfg.rollout
        refused_s = r.connect_grace_s if r.urls else None  # ours: healthy when started
        assert self.io is not None  # (rank 0's fleet)
        try:
            self.io.run(client.wait_healthy(r.health_timeout_s, refused_s=refused_s))
        except RolloutError as e:
            raise UserError(f"{e}; check {key}") from None

    def close(self) -> None:
        """Close the clients (on the event loop, still running) and stop the servers we started."""
        if self.io is not None:
            for c in {id(c): c for c in (self.client, self.generator) if c is not None}.values():
                self.io.run(c.close())
        self.client = self.generator = None
        if self.group is not None:
            self.group.stop()
            self.group = None

    # ---- supervision --------------------------------------------------------------------

    def weights_at(self, point: RestorePoint) -> None:
        """Tell the supervisor what a restarted server loads: the weight sync's restore point
        (the last whole version on disk, else the base model, which a server starts on anyway),
        labelled with its own version. The trainer's catch_up brings it to the current weights
        before the next rollouts."""
        if self.group is None:
            return
        if self.base_model and Path(point.path).resolve() == Path(self.base_model).resolve():
            self.group.set_current_weights()
        else:
            self.group.set_current_weights(model_path=point.path, weight_version=point.version)

    def wait_for_restarts(self) -> None:
        """Wait until the servers that died are restarted (their supervisor's), so that the
        weight sync's catch_up finds them before the rollouts."""
        if self.group is None:
            return
        down = self.group.wait_restarts()
        if down:
            log.warning("rollout servers %s are down; the rollouts go to the others", down)

    def ready_servers(self) -> list[int] | None:
        """The servers (by index) a weight sync may update now: those up and on their weights,
        not one in the middle of a restart (which loads the restore point from disk and would
        mix it with the sync's buckets). None: all (no supervisor: the user's own)."""
        return None if self.group is None else self.group.ready()

    def restart_counts(self) -> list[int] | None:
        """How many times the supervisor has restarted each server so far (None: none)."""
        return None if self.group is None else [s.restarts for s in self.group.servers]

    def being_restarted(self, urls: list[str], since: list[int] | None = None) -> bool:
        """Whether the supervisor is restarting every one of `urls` (or is about to), or has
        restarted it since `since` (restart_counts() then): a server that died during a sync
        may be up again, quickly restarted, by the time the sync reports it."""
        if self.group is None:
            return False
        return self.group.recovering([self.group.urls.index(u) for u in urls], since)

    def servers_busy_s(self) -> float | None:
        """The servers' own working seconds so far, summed (None without a client, or where a
        server does not report them: SGLang)."""
        if self.client is None or self.io is None:
            return None
        return self.io.run(self.client.busy_seconds())

    # ---- memory (every rank: collective) -------------------------------------------------

    def release_memory(self) -> None:
        """Colocated servers give their GPU memory to the trainer while it trains."""
        self._memory("/release_memory_occupation")

    def resume_memory(self) -> None:
        """...and take it back before the weight sync, once the trainer's cached blocks are
        back with the driver."""
        if self.release and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._memory("/resume_memory_occupation")

    def _memory(self, path: str) -> None:
        if self.release and self.client is not None and self.io is not None:
            self.io.run(self.client.broadcast(path, {"tags": ["weights", "kv_cache"]}))
        dist.barrier()  # no rank trains before the memory is released


def _launch(
    cfg: Config, run_dir: Path, hf_dir: Path, key: str | None, longest_prompt: Callable[[], int]
) -> ServerGroup:
    from megatron_gspo.rollout.launcher import ServerConfig, ServerFailed, ServerGroup

    r = cfg.rollout
    server = ServerConfig(
        model_path=str(hf_dir),
        kind=r.backend,
        enable_return_routed_experts=cfg.algo.routing_replay == ReplayMode.R3,
        tp_size=r.server_tp,
        dtype=r.dtype,
        quantization=r.quantization,
        deterministic=r.deterministic,
        extra_args=list(r.extra_server_args),
        threads=1 if r.backend == Backend.BUILTIN else 0,
        api_key=key,
    )
    if r.backend == Backend.SGLANG:
        _size_sglang(server, cfg, hf_dir, r.sglang_python, longest_prompt)
    group = ServerGroup([server] * r.servers, run_dir / "logs", health_timeout_s=r.health_timeout_s)
    try:
        group.start()
    except ServerFailed as e:
        raise UserError(f"a rollout server did not start: {e.summary()}") from None
    return group


def _size_sglang(server: ServerConfig, cfg: Config, hf_dir: Path, python: str | None,
                 longest_prompt: Callable[[], int]) -> None:  # fmt: skip
    """What SGLang needs from the machine and the run (rollout/server_config.py)."""
    from megatron_gspo.rollout.server_config import sglang_python, size_sglang

    # SGLang in its own environment (train.setup.check_sglang_start checked that it imports)
    server.python = sglang_python(python)
    size_sglang(server, cfg, hf_dir, longest_prompt(), torch.cuda.is_available())


def api_key() -> str | None:
    """Servers a launch script started off loopback require a key; it comes in the environment
    (never on a command line or in the config file)."""
    return os.environ.get(API_KEY_ENV) or None
