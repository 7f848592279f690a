"""A rollout sample: one response, or one episode of a multi-turn rollout."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The finish reasons the client knows (SGLang's). Another one (a newer SGLang's) ends its sample,
# which is not trained on (`Sample.ended_unknown`).
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Sample:
    """One response. routed_experts is int32 [prompt + len(tokens) - 1, layers, topk] over every
    decoder layer, as SGLang sends it: the rows of dense (non-MoE) layers are zeros. Episodes
    (rollout/episodes.py) add a loss mask, 0 on the environment's tokens (log-prob None)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    finish_reason: str = "abort"  # length | stop | abort, or one the client does not know
    # the weights that wrote it (the server's word; a sample written by several: the oldest);
    # None: no weights wrote any of it (an episode whose environment failed before the model's
    # first turn), so it is never stale
    weight_version: str | None = ""
    routed_experts: np.ndarray | None = None
    rid: str = ""
    server: str = ""
    latency_s: float = 0.0
    loss_mask: list[int] | None = None  # None: every token is the model's
    versions: list[str] = field(default_factory=list)  # per turn, or per partial segment
    # the weights that wrote each token (None: the environment's), where they may differ: a
    # partial rollout's (rollout/partial.py), an episode's
    token_versions: list[str | None] | None = None
    turns: int = 0
    env_reward: float | None = None
    env_error: str | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @property
    def ended_unknown(self) -> bool:
        """Its server ended it for a reason the client does not know (a newer SGLang's finish
        reason): what it is worth is unknown, so it is not trained on (train/generate.py)."""
        return self.finish_reason not in FINISH_REASONS


def version_index(version: str) -> int:
    """Weight versions are step numbers; the base model's ("default": no step yet) is 0."""
    return int(version) if version.isdigit() else 0


def older_than(sample: Sample, version: str) -> bool:
    """Whether weights older than `version` wrote `sample` (it is stale); never for a sample no
    weights wrote. A server that does not report its weight_version ("") counts as older."""
    wrote = sample.weight_version
    return wrote is not None and version_index(wrote) < version_index(version)


def oldest_version(versions: list[str]) -> str:
    """The oldest of weight versions (a sample's: the one its staleness counts from)."""
    return min(versions, key=version_index)
