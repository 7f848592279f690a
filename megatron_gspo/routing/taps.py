"""One MoE router's megatron-core `RouterReplay`, plus what we observe on it.

The core replays (REPLAY_FORWARD: `target_topk_idx`; REPLAY_BACKWARD: pops `replay_backward_list`
in the recompute of the backward) and records (RECORD: `recorded_topk_idx`). A `RouterTap`
wraps that instance's `get_replay_topk` (object state only, nothing global) and adds:

- natural routing: the router's own top-k under the current weights (the ids the core returns
  when nothing is replayed, or one extra top-k on the same scores when it replays);
- partial targets: where a target row is -1 (padding, a sample's last token, which the rollout
  server never fed) the natural ids are replayed, so padding routes exactly as in an unreplayed
  forward of the same microbatch (expert matmuls see the same token counts: same rounding);
- observation (forward only, never in the recompute): with `capture` it keeps the natural ids
  (`natural`); with a reference (`ref_Nk`, -1 where none) it counts the positions whose natural
  top-k SET differs from the reference's, and keeps which ones did (`differs`, [N] bool, for
the per-token drift of routing/sweep.py):

    changed += sum_j valid_j * [set(natural_j) != set(ref_j)],   seen += sum_j valid_j
"""

from __future__ import annotations

import torch


class RouterTap:
    def __init__(self, router):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        replay = router.router_replay
        if replay is None:  # the model was built without moe_enable_routing_replay
            replay = RouterReplay()
            # Ours alone: keep it out of the class-level list megatron's global calls walk.
            RouterReplay.global_router_replay_instances.remove(replay)
            router.router_replay = replay
        old = getattr(replay, "_tap", None)
        self._default = old._default if old is not None else replay.get_replay_topk
        replay.get_replay_topk = self._get_replay_topk
        replay._tap = self
        self.replay = replay
        self.layer = int(router.layer_number) - 1  # global decoder layer id
        self.observing = False
        self.capture = False
        self.natural: torch.Tensor | None = None  # [N, k] of the last observed forward
        self.ref_Nk: torch.Tensor | None = None  # [N, k], -1 rows: no reference
        self.differs: torch.Tensor | None = None  # [N] bool of the last observed forward
        self.changed = torch.zeros((), dtype=torch.long)
        self.seen = torch.zeros((), dtype=torch.long)

    def _get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default=None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        action, replay = self.replay.router_replay_action, self.replay
        natural = None
        if action in (A.REPLAY_FORWARD, A.REPLAY_BACKWARD):
            natural = default(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            if action == A.REPLAY_FORWARD:
                replay.target_topk_idx = _fill(replay.target_topk_idx, natural)
            else:
                replay.replay_backward_list[0] = _fill(replay.replay_backward_list[0], natural)
        probs, ids = self._default(scores, topk, num_groups, group_topk, default)
        if self.observing and action != A.REPLAY_BACKWARD:
            self._observe((ids if natural is None else natural).detach())
        return probs, ids

    def _observe(self, natural: torch.Tensor) -> None:
        if self.capture:
            self.natural = natural
        if self.ref_Nk is not None:
            valid = self.ref_Nk[:, 0] >= 0
            same = natural.sort(-1).values == self.ref_Nk.sort(-1).values
            differs = ~same.all(-1) & valid
            self.differs = differs
            self.changed = self.changed.to(differs.device) + differs.sum()
            self.seen = self.seen.to(differs.device) + valid.sum()

    def reset(self) -> None:
        """Back to plain routing: no action, no targets, nothing observed or counted."""
        self.replay.clear_router_replay_action()
        self.replay.clear_indices()
        self.observing = self.capture = False
        self.natural = self.ref_Nk = self.differs = None
        self.changed = torch.zeros((), dtype=torch.long)
        self.seen = torch.zeros((), dtype=torch.long)

    def counts(self) -> tuple[int, int]:
        return int(self.changed), int(self.seen)


def _fill(target: torch.Tensor, natural: torch.Tensor) -> torch.Tensor:
    """The target ids, natural ones where the target row is -1."""
    target = target.to(natural.device)
    return torch.where(target >= 0, target, natural)
