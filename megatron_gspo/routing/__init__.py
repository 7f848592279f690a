"""Routing replay (R2, R3) over megatron-core's RouterReplay, per-sample storage, drift metrics."""

from megatron_gspo.routing.align import align_rollout_experts
from megatron_gspo.routing.replay import MODES, RoutingReplay
from megatron_gspo.routing.storage import SampleRouting, bytes_per_token, index_dtype

__all__ = [
    "MODES",
    "RoutingReplay",
    "SampleRouting",
    "align_rollout_experts",
    "bytes_per_token",
    "index_dtype",
]
