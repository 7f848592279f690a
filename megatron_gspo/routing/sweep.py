"""One sweep of megatron's schedule over a batch's microbatches, seen from the routers.

A `Sweep` says, for this sweep: which stored routing to replay ("recorded" | "rollout" | None),
which to compare the natural routing with (counting changed positions), and whether to capture
the natural routing. The forward step calls `enter(model, mb)` before the chunk's forward and
`leave(model, mb, out)` after it. Targets are set per microbatch inside the forward step, since
with pipelining several microbatch forwards run before their backwards. With activation
recompute, `leave` hooks the chunk's output: its gradient arrives before any layer of the chunk
is recomputed, and the hook switches that chunk's routers to REPLAY_BACKWARD (the core then pops
the targets in forward order) and stops observing; the next forward step sets REPLAY_FORWARD again.

Per-token drift: with a reference to compare with, `leave` also ORs, over the chunk's MoE
layers, which router tokens moved (top-k set != the reference's); `moved_positions` turns that
into one flag per sample position over the whole model (every stage's layers).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.routing.gather import gather_stage
from megatron_gspo.routing.layout import token_map
from megatron_gspo.routing.storage import SampleRouting, microbatch_targets


class Sweep:
    def __init__(self, owner, samples, mbs, seq_len, *, replay=None, compare=None, capture=False,
                 within_replica=False):  # fmt: skip
        self.owner = owner
        self.within_replica = within_replica  # a shard: this replica's rows only
        self.samples: list[SampleRouting | None] = samples
        self.replay, self.compare, self.capture = replay, compare, capture
        self.order = {id(mb): m for m, mb in enumerate(mbs)}
        # per microbatch: (sample row, position) of each router token of this rank
        self.maps = [token_map(mb, owner.layout) for mb in mbs]
        self.buffer = None
        n_tok = max(len(rows) for rows, _ in self.maps)  # router tokens per microbatch (most)
        self.maps_M2N = torch.full((len(mbs), 2, n_tok), -1, dtype=torch.int64)
        for m, (rows, pos) in enumerate(self.maps):
            self.maps_M2N[m, 0, : len(rows)] = torch.from_numpy(rows)
            self.maps_M2N[m, 1, : len(rows)] = torch.from_numpy(pos)
        if capture:
            shape = (len(mbs), len(owner.layers), n_tok, owner.topk)
            self.buffer = torch.zeros(shape, dtype=owner.torch_dtype, device=owner.device)
        self.moved = None  # [M, 1, N, 1] uint8: moved in any of this rank's MoE layers
        if compare is not None:
            self.moved = torch.zeros(
                (len(mbs), 1, n_tok, 1), dtype=torch.uint8, device=owner.device
            )

    # ---- inside the forward step --------------------------------------------------------

    def enter(self, model, mb) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        taps = self.owner.taps_of(model)
        if not taps:
            return
        cols = [self.owner.column[t.layer] for t in taps]
        target = self._targets(mb, self.replay, cols)
        ref = target if self.compare == self.replay else self._targets(mb, self.compare, cols)
        for j, tap in enumerate(taps):
            tap.observing, tap.capture = True, self.capture
            if target is not None:
                tap.replay.set_router_replay_action(A.REPLAY_FORWARD)
                tap.replay.set_target_indices(target[j])
            elif self.capture:
                tap.replay.set_router_replay_action(A.RECORD)
            else:
                tap.replay.clear_router_replay_action()
            tap.ref_Nk = None if ref is None else ref[j]

    def leave(self, model, mb, out):
        taps = self.owner.taps_of(model)
        if self.moved is not None:
            m = self.order[id(mb)]
            for tap in taps:
                if tap.differs is not None:
                    n = tap.differs.shape[0]
                    self.moved[m, 0, :n, 0] |= tap.differs.to(self.moved.dtype)
                    tap.differs = None
        if self.capture:
            m = self.order[id(mb)]
            for tap in taps:
                n = tap.natural.shape[0]
                self.buffer[m, self.owner.column[tap.layer], :n] = tap.natural.to(self.buffer.dtype)
                tap.natural = None
        if taps and self.owner.recompute and torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(partial(_to_recompute, taps))
        return out

    def _targets(self, mb, kind, cols):
        if kind is None:
            return None
        rows, pos = self.maps[self.order[id(mb)]]
        arrays = {i: getattr(self.samples[i], kind) for i in set(rows.tolist()) if i >= 0}
        o = self.owner
        return microbatch_targets(arrays, rows, pos, cols, o.topk, o.device)

    # ---- after the schedule -------------------------------------------------------------

    def counts(self) -> dict[int, tuple[int, int]]:
        return {t.layer: t.counts() for t in self.owner.all_taps()}

    def captured(self, lengths: list[int]) -> dict[int, np.ndarray]:
        """{sample: [n, L, k]} natural routing of every sample (collective over the stage)."""
        return gather_stage(self.buffer, self.maps_M2N, lengths, self.within_replica)

    def moved_positions(self, lengths: list[int]) -> list[np.ndarray] | None:
        """Per sample, [n] bool: position p's top-k set differs from the reference in at least
        one MoE layer of the model (collective: the stage's group, then the pipeline group,
        whose stages hold the other layers). None without a reference."""
        if self.moved is None:
            return None
        mine = gather_stage(self.moved, self.maps_M2N, lengths, self.within_replica)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = torch.zeros(int(offsets[-1]), dtype=torch.int32, device=self.owner.device)
        for i, arr in mine.items():
            flat[offsets[i] : offsets[i + 1]] = torch.from_numpy(arr[:, 0, 0].astype(np.int32))
        pipeline_any(flat)
        flags = flat.cpu().numpy() > 0
        return [flags[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]


def pipeline_any(flags: torch.Tensor) -> None:
    """In place: the flags of every pipeline stage of this replica added up (nonzero: any)."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(flags, group=mpu.get_pipeline_model_parallel_group())


def _to_recompute(taps, grad):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

    for tap in taps:
        tap.observing = False
        if tap.replay.router_replay_action == A.REPLAY_FORWARD:
            tap.replay.set_router_replay_action(A.REPLAY_BACKWARD)
    return None
