"""One generation request as the engine holds it: what was asked, and what it produced."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_gspo.server.sampling import SamplingParams


@dataclass(eq=False)  # identity: the engine looks requests up in its lists
class Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    group: str = ""  # the rid the client sent, shared by the n samples of one prompt
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed: bool = False
    on_done: Callable[[Request], object] | None = None  # its result is ignored
    # Filled in by the engine.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # [n, L, k] per forward chunk
    finish_reason: dict | None = None
    error: str | None = None  # set when the engine failed on this request (HTTP 500)
    refused: str | None = None  # set when its id was in use (HTTP 400)
    weight_version: str = ""
    created: float = field(default_factory=time.perf_counter)
    finished: float = 0.0
    slot: int | None = None
    fed: int = 0  # tokens whose k/v are in the cache
    generator: torch.Generator | None = None
    abort_message: str | None = None
    # Set on admission, so the per-token checks stay cheap: the ids that may stop it, the output
    # length that ends it, and whether its logits are adjusted regardless of the output so far.
    stop_ids: frozenset[int] = frozenset()
    limit: int = 0
    adjusted: bool = False
