"""The coordinator's side of a weight sync (global rank 0, sync.py): it talks to the servers
about the update as a whole. It begins the sync on the chosen servers, commits the new version
on those that took every bucket, restores the others onto the restore point, ends the sync, and
finds the servers a sync must reach (`recover`, catch-up). Also the report every rank gets.

`Coordinator` is WeightSync's half that faces the servers; it uses WeightSync's `servers`,
`transport`, `config`, `dirs`, `restore_point`, `base_hf`, `count` and `coordinator`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gspo.errors import UserError
from megatron_gspo.rollout import weight_payload as wp
from megatron_gspo.weight_sync.disk import RestorePoint
from megatron_gspo.weight_sync.transports.base import PARTIAL

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    version: str
    transport: str
    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0
    servers: dict[str, str] = field(default_factory=dict)  # url -> version it is on now
    failures: dict[str, str] = field(default_factory=dict)  # url -> what went wrong
    trainer_error: str | None = None
    checksums: dict[int, list[int]] = field(default_factory=dict)  # stage -> per bucket
    lent_bytes: int = 0  # of `bytes`, sent as views of the trainer's parameters (not copied)
    sent_by: dict[str, dict[int, int]] = field(default_factory=dict)  # url -> {stage: its rank}
    stage_times: dict[int, tuple[float, float]] = field(default_factory=dict)  # stage -> sent
    groups: dict[int, str] = field(default_factory=dict)  # stage -> its update group (distributed)

    @property
    def ok(self) -> bool:
        return not self.failures and self.trainer_error is None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0

    def message(self) -> str:
        lines = [f"weight sync to version {self.version!r} ({self.transport}) failed:"]
        if self.trainer_error:
            lines.append(f"  trainer side: {self.trainer_error}")
        lines += [f"  server {url}: {why}" for url, why in self.failures.items()]
        lines.append("  servers now: " + ", ".join(f"{u} = {v}" for u, v in self.servers.items()))
        return "\n".join(lines)


class WeightSyncError(RuntimeError):
    def __init__(self, message: str, report: SyncReport | None = None):
        super().__init__(message)
        self.report = report


class VerificationFailed(WeightSyncError, UserError):
    """The servers' probe log-probs are not the trainer's (one line per server, joined): the
    run ends with this message, not a traceback. `unreachable`: the servers whose probe got no
    answer (died after the sync?); `only_unreachable`: that was every problem. `report`: the
    sync's, which itself succeeded."""

    def __init__(self, message: str, unreachable: list[str], only_unreachable: bool):
        super().__init__(message)
        self.unreachable, self.only_unreachable = unreachable, only_unreachable


class Coordinator:
    """The servers-facing half of WeightSync (a base class: WeightSync holds the state)."""

    def _begin(self, version: str, only: list[int] | None = None, snapshot: bool = True) -> dict:
        snap = self.config.snapshot_every if snapshot else 0
        write = self.transport.writes_files or bool(snap and self.count % snap == 0)
        chosen = sorted(only) if only is not None else list(range(len(self.servers)))
        live, errors = chosen, {}
        if self.config.pause_generation:
            _, errors = self.servers.post_many(live, "/pause_generation", {"mode": "in_place"})
        if self.transport.needs_session:
            live = [i for i in live if i not in errors]
            begin = wp.begin_body(self.senders)
            _, more = self.servers.post_many(live, "/begin_weight_update", begin)
            errors.update(more)
        if write:
            self.dirs.start(version)
        live = [i for i in chosen if i not in errors]
        return {"live": live, "errors": errors, "write": write, "chosen": chosen}

    def _finish_session(
        self, version: str, plan: dict, outcomes: list[dict], crashed: bool = False
    ) -> SyncReport:
        report = SyncReport(version, self.transport.name)
        failed = dict(plan["errors"])
        touched = set(plan["live"]) if crashed else set()
        errors = ["this rank's gather failed"] if crashed else []
        for o in outcomes:
            failed.update(o["failed"])
            touched.update(o["touched"])
            errors += [f"{_who(o)}: {o['error']}"] if o["error"] else []
            for i in o["touched"]:
                report.sent_by.setdefault(self.servers.url(i), {})[o["stage"]] = o["rank"]
            if o["relay"] is None:  # a relay moves its sender's bytes again: counted once
                report.bytes += o["bytes"]
                report.lent_bytes += o["lent"]
                report.buckets += o["buckets"]
                report.checksums[o["stage"]] = o["checksums"]
                report.stage_times[o["stage"]] = o["sent"]
                if o["group"]:
                    report.groups[o["stage"]] = o["group"]
        if not errors:
            errors = [
                f"{_who(o)}: received buckets whose checksums differ from its sender's"
                for o in outcomes
                if o["relay"] is not None and o["checksums"] != report.checksums.get(o["stage"])
            ]
        report.trainer_error = "; ".join(errors) or None
        live = [i for i in plan["live"] if i not in failed]
        if report.trainer_error is None:
            new_dir = self._finish_files(version, plan, outcomes)
            failed.update(self.transport.commit(self.servers, live, version, new_dir))
            if self.transport.writes_files:
                touched.update(live)
        elif plan["write"]:
            self.dirs.discard(version)
        restore = touched if report.trainer_error else touched & set(failed)
        states = self._restore(sorted(restore))
        for i in range(len(self.servers)):
            url = self.servers.url(i)
            if i in states:
                report.servers[url] = states[i]
            elif i not in plan["chosen"]:
                report.servers[url] = "not in this sync"
            elif i in failed:
                report.servers[url] = "unchanged (not updated)"
            else:
                report.servers[url] = version
            if i in failed:
                report.failures[url] = failed[i]
        self._end(plan, states)
        return report

    def _finish_files(self, version: str, plan: dict, outcomes: list[dict]) -> Path | None:
        if not plan["write"]:
            return None
        files = [o["files"] for o in outcomes if o["relay"] is None]
        new_dir = self.dirs.finish(version, files, self.base_hf)
        self.dirs.set_restore(RestorePoint(str(new_dir), version))
        return new_dir

    def _restore(self, indices: list[int]) -> dict[int, str]:
        """Reload the restore point on `indices`: {index: the version each is on now}."""
        if not indices:
            return {}
        point = self.restore_point
        if self.dirs and point.path in self.dirs.created:
            try:
                self.dirs.check(point.path)
            except ValueError as e:
                return {i: f"lost (restore point damaged: {e})" for i in indices}
        body = {"model_path": point.path, "weight_version": point.version, "flush_cache": True}
        _, errors = self.servers.post_many(indices, "/update_weights_from_disk", body)
        for i, msg in errors.items():
            log.error("could not restore %s to version %s: %s", self.servers.url(i), point, msg)
        return {
            i: f"lost (restore failed: {errors[i]})"
            if i in errors
            else f"{point.version} (restored)"
            for i in indices
        }

    def _end(self, plan: dict, states: dict[int, str]) -> None:
        reachable = [i for i in plan["live"] if not states.get(i, "").startswith("lost")]
        if self.transport.needs_session:
            self.servers.post_many(reachable, "/end_weight_update", {})
        if self.config.pause_generation:
            self.servers.post_many(reachable, "/continue_generation", {})
        self._flush(reachable)

    def _flush(self, indices: list[int], wait_s: float = 10.0) -> list[int]:
        """Empty the servers' prefix caches: KV computed with the old weights must not serve the
        next prompts. A server refuses while it has a request (SGLang: also the one-token
        generation of its own /health probe), so a refusal is asked again until `wait_s`; a
        server that does not answer is left to its supervisor. Returns those still refusing."""
        deadline = time.monotonic() + wait_s
        while indices:
            _, errors = self.servers.post_many(indices, "/flush_cache", {})
            indices = [i for i, msg in errors.items() if "answered HTTP" in msg]
            if indices and time.monotonic() > deadline:
                for i in indices:
                    log.warning("weight sync: %s kept its prefix cache: %s", self.servers.url(i),
                                errors[i])  # fmt: skip
                return indices
            if indices:
                time.sleep(0.05)
        return []

    def _versions(self, indices, timeout_s: float | None = None) -> dict[int, str]:
        """{index: the weight_version it answers with} of `indices`; one that does not answer
        is left out (down: its supervisor restarts it)."""
        versions = {}
        for i in indices:
            try:
                versions[i] = str(
                    self.servers.get(i, "/model_info", timeout_s).get("weight_version")
                )
            except Exception as e:  # noqa: BLE001 - down: its supervisor's
                log.warning("weight sync: %s did not answer: %s", self.servers.url(i), e)
        return versions

    def _behind(self, version: str, among: list[int] | None) -> dict[int, str]:
        """The servers (of `among`, else all) that answer on another weight_version than
        `version`: {index: the one they are on}."""
        indices = range(len(self.servers)) if among is None else among
        behind = {i: on for i, on in self._versions(indices, 60.0).items() if on != version}
        for i, on in behind.items():
            log.warning(
                "weight sync: %s is on weight_version %r, not %r; bringing it there",
                self.servers.url(i), on, version,
            )  # fmt: skip
        return behind

    def recover(self) -> dict[str, str]:
        """Restore every server whose weight_version says a sync was cut short (coordinator)."""
        if not self.coordinator:
            return {}
        versions = self._versions(range(len(self.servers)))
        partial = [i for i, on in versions.items() if on.startswith(PARTIAL)]
        return {self.servers.url(i): v for i, v in self._restore(partial).items()}


def _who(outcome: dict) -> str:
    if outcome["relay"] is None:
        return f"stage {outcome['stage']}"
    return f"stage {outcome['stage']} relay (rank {outcome['rank']}, node {outcome['relay']})"
