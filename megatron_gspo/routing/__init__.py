"""Routing replay (R2, R3) over megatron-core's RouterReplay, per-sample storage, drift metrics.

The RL loop uses it through the actor:

    actor = Actor(chunks, optim, routing_replay="r3")   # "none" | "r2" | "r3"
    batch.rollout_experts = [s.routed_experts for s in samples]   # R3 only
    old, metrics = actor.logprobs(batch, mbs)     # records batch.routing;
    batch.set("old_logprobs", old)
    # metrics: routing/bytes_per_token, routing/rollout_train_agreement[/layer_i]
    actor.train_step(batch.rows(idx), loss_cfg, mbs)    # replays; routing/changed_fraction[/layer_i]

The routers' RouterReplay objects are reached through the model chunks: those a model built with
BuildOptions(routing_replay=True) has, or, for a model built without, one per router that the
actor adds (kept out of megatron's class-level list, which nothing here uses).

The names below are imported from their modules on first use (megatron_gspo/lazy.py): the run
config imports routing/modes.py, which runs this file, without loading torch.
"""

from typing import TYPE_CHECKING

from megatron_gspo.lazy import lazy_exports

if TYPE_CHECKING:
    from megatron_gspo.routing.align import align_rollout_experts
    from megatron_gspo.routing.modes import MODES, ReplayMode
    from megatron_gspo.routing.replay import RoutingReplay
    from megatron_gspo.routing.storage import SampleRouting, bytes_per_token, index_dtype

__all__ = [
    "MODES",
    "ReplayMode",
    "RoutingReplay",
    "SampleRouting",
    "align_rollout_experts",
    "bytes_per_token",
    "index_dtype",
]

lazy_exports(
    __name__,
    {
        "MODES": "modes",
        "ReplayMode": "modes",
        "RoutingReplay": "replay",
        "SampleRouting": "storage",
        "align_rollout_experts": "align",
        "bytes_per_token": "storage",
        "index_dtype": "storage",
    },
)
