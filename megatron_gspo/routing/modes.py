"""The routing replay modes (`algo.routing_replay`), with no torch import, so the config can name
them without loading the replay (routing/replay.py says what each mode does)."""

from __future__ import annotations

from enum import StrEnum


class ReplayMode(StrEnum):
    NONE = "none"
    R2 = "r2"  # the trainer's own routing of the old log-probs, replayed in training
    R3 = "r3"  # the rollout server's routing, replayed in the old log-probs and training


MODES: tuple[ReplayMode, ...] = tuple(ReplayMode)
