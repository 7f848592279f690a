"""Routing replay for one rank's model chunks: R2, R3, and drift metrics (object state only).

Modes (algo.routing_replay):
- "none": old log-probs record the natural routing; training routes naturally. Drift is still
  measured: routing/changed_fraction = share of (real token, MoE layer) positions whose top-k set
  under the weights of the minibatch's forward differs from the recorded one.
- "r2": old log-probs record the natural routing; every training forward of that batch (and the
  recompute in its backward) replays it.
- "r3": old log-probs and training replay the rollout server's routing (aligned with the tokens,
  dense layers dropped, this stage's layers kept); the natural routing is recorded at the same
  time, and routing/rollout_train_agreement = share of positions where the trainer's natural
  top-k set (given the replayed earlier layers) equals the server's.

Per-sample storage (`SampleRouting`, on host memory, this stage's layers only) lives in
`RLBatch.routing`; each sweep builds its microbatches' targets from it at this rank's token
positions (sequence / context parallel slice) only.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.routing import metrics as M
from megatron_gspo.routing.align import align_rollout_experts
from megatron_gspo.routing.layout import current_layout
from megatron_gspo.routing.modes import MODES, ReplayMode
from megatron_gspo.routing.storage import SampleRouting, index_dtype
from megatron_gspo.routing.sweep import Sweep
from megatron_gspo.routing.taps import RouterTap


class RoutingReplay:
    def __init__(self, chunks, mode: str = "none"):
        if mode not in MODES:
            raise UserError(f"routing_replay {mode!r} is not one of {', '.join(MODES)}")
        first = getattr(chunks[0], "module", chunks[0])
        self.spec, config = first.model_spec, first.config
        if not self.spec.is_moe:
            raise UserError(f"routing_replay {mode} needs an MoE model; set it to none")
        if getattr(config, "moe_router_fusion", False):
            raise UserError(
                "the fused router skips routing replay; build with moe_router_fusion off"
            )
        self.mode = mode
        self.topk, self.num_experts = self.spec.topk, self.spec.num_experts
        self.taps = [sorted(map(RouterTap, _routers(c)), key=lambda t: t.layer) for c in chunks]
        self._chunk = {id(c): i for i, c in enumerate(chunks)}
        self.layers = tuple(sorted(t.layer for t in self.all_taps()))
        self.column = {layer: j for j, layer in enumerate(self.layers)}
        self.recompute = router_recomputed(config)
        self.layout = current_layout(bool(config.sequence_parallel))
        self.device = next(first.parameters()).device
        self.np_dtype = index_dtype(self.num_experts)
        self.torch_dtype = torch.from_numpy(np.zeros(1, self.np_dtype)).dtype

    def all_taps(self):
        return [t for taps in self.taps for t in taps]

    def taps_of(self, model):
        return self.taps[self._chunk[id(model)]]

    # ---- sweeps -------------------------------------------------------------------------

    def record_sweep(self, batch, mbs, seq_len) -> Sweep:
        """The old-log-prob sweep: capture the natural routing (r3: while replaying the
        rollout's, compared with it). Every sample is checked before anything runs."""
        samples = [SampleRouting(self.layers) for _ in range(len(batch))]
        if self.mode == ReplayMode.R3:
            for i, s in enumerate(samples):
                s.rollout = self._align(batch, i)
            return self._sweep(samples, mbs, seq_len, "rollout", "rollout", True, batch.sharded)
        return self._sweep(samples, mbs, seq_len, None, None, True, batch.sharded)

    def train_sweep(self, batch, mbs, seq_len, source: str | None = "mode") -> Sweep:
        """A training forward: replay `source` ("mode": r2 recorded, r3 rollout, none nothing;
        or "recorded" | "rollout" | None) and count drift against the recorded routing."""
        samples = batch.routing
        if source == "mode":
            source = {ReplayMode.NONE: None, ReplayMode.R2: "recorded", ReplayMode.R3: "rollout"}[
                self.mode
            ]
        if samples is None:
            if source is not None:
                raise UserError(
                    f"replaying {source} routing needs the batch's routing; compute old log-probs "
                    "with actor.logprobs(batch) and train on batch.rows(...) of that batch"
                )
            return self._sweep(None, mbs, seq_len, None, None, False, batch.sharded)
        self._check(samples, source)
        return self._sweep(samples, mbs, seq_len, source, "recorded", False, batch.sharded)

    def finish_record(self, sweep: Sweep, batch) -> dict[str, float]:
        """Store the captured routing in batch.routing; the sweep's metrics."""
        lengths = batch.lengths.tolist()
        captured = sweep.captured(lengths)
        differs = sweep.moved_positions(lengths)  # r3: natural vs rollout, whole model
        for i, s in enumerate(sweep.samples):
            none = np.zeros((lengths[i], 0, self.topk), self.np_dtype)  # a stage without MoE
            s.recorded = captured.get(i, none)
            s.rollout_differs = None if differs is None else differs[i]
        batch.routing = sweep.samples
        stored = sum(s.nbytes for s in sweep.samples)
        total, tokens = M.model_bytes(stored, sum(lengths), batch.sharded, self.device)
        out = {M.BYTES_PER_TOKEN: total / max(tokens, 1)}
        if self.mode == ReplayMode.R3:
            out.update(M.fraction_metrics(M.AGREEMENT, self._counts(sweep), agreement=True))
        self.reset()
        return out

    def finish_train(self, sweep: Sweep) -> dict[str, float]:
        out = {}
        if sweep.compare is not None:
            out = M.fraction_metrics(M.CHANGED, self._counts(sweep))
        self.reset()
        return out

    def reset(self) -> None:
        for t in self.all_taps():
            t.reset()

    # ---- helpers ------------------------------------------------------------------------

    def _sweep(self, samples, mbs, seq_len, replay, compare, capture, within_replica) -> Sweep:
        self.reset()
        return Sweep(self, samples, mbs, seq_len, replay=replay, compare=compare, capture=capture,
                     within_replica=within_replica)  # fmt: skip

    def _counts(self, sweep: Sweep) -> M.LayerCounts:
        return M.reduce_counts(
            sweep.counts(), self.layout.counts_tokens, self.spec.moe_layer_ids, self.device
        )

    def _align(self, batch, i: int) -> np.ndarray:
        experts = batch.rollout_experts
        if experts is None or len(experts) != len(batch):
            raise UserError(
                "routing_replay r3 needs batch.rollout_experts, one entry per sample (the "
                "samples' routed_experts)"
            )
        spec = self.spec
        return align_rollout_experts(
            experts[i], int(batch.lengths[i]), spec.num_layers, spec.moe_layer_ids,
            self.layers, self.topk, self.num_experts, sample=batch.global_index()[i],
            given_layers=batch.expert_layers,
        )  # fmt: skip

    def _check(self, samples, source) -> None:
        for i, s in enumerate(samples):
            if not isinstance(s, SampleRouting) or s.layers != self.layers or not s.has_recorded:
                raise UserError(
                    f"batch.routing[{i}] was not recorded by this actor's logprobs; compute old "
                    "log-probs with actor.logprobs(batch) first"
                )
            if source == "rollout" and s.rollout is None:
                raise UserError(
                    f"batch.routing[{i}] has no rollout routing; the actor's logprobs must run "
                    "with routing_replay r3 and batch.rollout_experts set"
                )


def _routers(chunk) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def router_recomputed(config) -> bool:
    """The backward runs the routers again: full recompute, or selective recompute of whole MoE
    layers (`moe`). Selective recompute of the core attention and the experts' activation
    (`core_attn`, `moe_act`) does not, so no replay target is kept for a recompute."""
    from megatron_gspo.model.modes import Recompute

    granularity = config.recompute_granularity
    if granularity is None:
        return False
    if Recompute(granularity) is Recompute.FULL:
        return True
    return "moe" in (config.recompute_modules or ())
