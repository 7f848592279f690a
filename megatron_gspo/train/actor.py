"""The Megatron actor: old log-probs and one optimizer step over a batch of RL samples.

The step runs megatron's `forward_backward_func` (no pipelining, 1F1B, or interleaved 1F1B) over
microbatches, under TP (+ sequence parallel), EP and DP (megatron DDP + distributed optimizer).

Batches. In the RL loop each rank holds a shard (train/shard.py): its replica's rows, sent by
rank 0 (`shard`); the log-probs and routing it records stay with it. A whole batch on every rank
(tests, tools) works too: each replica picks its rows, and results are gathered to every rank.

Loss denominators. The batch's denominator D (sequences for seq-mean aggregations, tokens for
token-mean) is counted once per step over the WHOLE batch (of a shard: its count all-reduced over
the data-parallel replicas), so it is the same number on every rank. Each microbatch returns
sum(objective in microbatch) / D, so summing microbatches and replicas gives the full-batch
loss. Megatron then divides each microbatch loss by the number of microbatches M and DDP averages
gradients over the dp data-parallel replicas; the loss function multiplies by M * dp to undo both.
The gradient therefore does not depend on how the batch was split.

Routing (MoE models, megatron_gspo/routing): `logprobs` records every sample's natural routing
into batch.routing (r3: while replaying the rollout server's); `train_step` replays it (r2:
recorded, r3: rollout) and reports routing/changed_fraction, in every mode, and the mechanism
the study looks for: the token log-ratio's std over the loss tokens whose routing moved since
the old log-probs (any MoE layer, at the position that produced the token) and over the others.

Fixed costs per call are kept off the step (they dominate on a small model): the parallel
layout is read once, train()/eval() walk the modules only when the mode changes, world-size-1
runs skip their object gathers, and torch's Adam takes its fused kernel on a CPU (one pass over
memory per parameter instead of seven). `logprobs(..., fit_logits=True)` (the
RL loop's choice) scores up to `_FORWARD_LOGITS` logits per microbatch (train/layout.py) without pipelining, never
fewer rows than asked: a forward-only pass keeps no activations for a backward.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.algo.policy_loss import loss_denominator, policy_loss
from megatron_gspo.errors import UserError
from megatron_gspo.model.builder import set_logits_from
from megatron_gspo.model.lm_head import lm_head_of
from megatron_gspo.model.optim import OptimConfig
from megatron_gspo.model.parallel import device_type
from megatron_gspo.model.reference import ReferenceWeights
from megatron_gspo.routing.metrics import TOKENS_CHANGED
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.routing.replay import RoutingReplay
from megatron_gspo.train.batch import StepBatch, loss_mask_tensor
from megatron_gspo.train.layout import MicrobatchLayout
from megatron_gspo.train.packing import (
    packed,
    packing_budget,
    token_logprobs,
    trained_only_values,
)
from megatron_gspo.train.results import Update
from megatron_gspo.train.shard import RankNeeds, distribute, needs_table
from megatron_gspo.train.step_parts import (
    check_step,
    correction_weights_of,
    flat_logprobs,
    fused_adam,
    kl_penalty,
    moved_split,
    optimizer_step,
    padding_stats,
    reduce_stats,
)


class Actor(MicrobatchLayout):
    """Owns the DDP-wrapped model chunks and the megatron optimizer of this rank."""

    # the KL's reference policy (`keep_reference`): the starting weights; None without a KL
    reference: ReferenceWeights | None = None

    def __init__(
        self,
        chunks,
        optim: OptimConfig | None = None,
        routing_replay: ReplayMode | str = ReplayMode.NONE,
        max_tokens_per_microbatch: int | None = None,
    ):
        optim = optim or OptimConfig()
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.spec = chunks[0].model_spec
        self.config = chunks[0].config
        self.device = next(chunks[0].parameters()).device
        self.optim = optim
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim.distributed,
        )
        self.chunks = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c)
            for c in chunks
        ]
        self.config.finalize_model_grads_func = finalize_model_grads
        if device_type() == "cpu":
            from megatron_gspo.model import cpu_compat

            cpu_compat.enable_wgrad_accumulation(self.chunks)
        self.optimizer = get_megatron_optimizer(
            optim.megatron(self.config.params_dtype), self.chunks
        )
        fused_adam(self.optimizer)
        # The layout is fixed for the actor's life: read it once, not per step.
        self.dp = mpu.get_data_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.tp = mpu.get_tensor_model_parallel_world_size()
        self.pp = mpu.get_pipeline_model_parallel_world_size()
        self.world = dist.get_world_size()
        self._schedule = get_forward_backward_func()
        # packed microbatches of at most this many tokens (train/packing.py); None: padded
        self.max_tokens = packing_budget(max_tokens_per_microbatch, self.config)
        use_routing = self.spec.is_moe or routing_replay != ReplayMode.NONE
        self.routing = RoutingReplay(self.chunks, routing_replay) if use_routing else None
        self._dp_group = mpu.get_data_parallel_group()
        # what every rank trains on, for rank 0 to send each its shard (once: a few numbers)
        layers = self.routing.layers if self.routing else ()
        self.needs = needs_table(RankNeeds(self.dp_rank, self.dp, layers, self.spec.num_layers,
                                           tuple(self.spec.moe_layer_ids),
                                           self.spec.num_experts or 0))  # fmt: skip

    def shard(self, batch: StepBatch | None, parts: list[list[int]]) -> StepBatch:
        """Rank 0's whole batch (None on the other ranks) -> this rank's shard, its replica's
        rows of the step's minibatch split `parts` (collective; one process: the batch)."""
        return distribute(batch, parts, self.needs, device=self.device)

    # ---- helpers -----------------------------------------------------------------------------

    def _set_mode(self, training: bool) -> None:
        """train()/eval() walk every submodule; skip the walk when the chunks are there."""
        for c in self.chunks:
            if c.training != training or c.module.training != training:
                c.train(training)

    @staticmethod
    def _step(sweep, loss):
        """megatron's forward step: one microbatch through one chunk (routing set around it)."""

        def step(it, model):
            mb = next(it)
            if sweep is not None:
                sweep.enter(model, mb)
            set_logits_from(model, mb.logits_from)
            # a packed microbatch: THD through megatron-core's PackedSeqParams
            thd = {"packed_seq_params": mb.packed_seq_params()} if packed(mb) else {}
            try:
                out = model(mb.tokens, mb.position_ids, None, **thd)
            finally:  # the window is this microbatch's only: score() and others see all logits
                set_logits_from(model, 0)
            if sweep is not None:
                out = sweep.leave(model, mb, out)
            return out, partial(loss, mb, lm_head_of(model))

        return step

    def _run(self, mbs, seq_len, micro_batch_size, forward_step, forward_only):
        iters = iter(mbs) if len(self.chunks) == 1 else [iter(mbs) for _ in self.chunks]
        micro_batch_size = mbs[0].tokens.shape[0]  # (a packed microbatch is one flat row)
        return self._schedule(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=self.chunks,
            num_microbatches=len(mbs),
            seq_length=seq_len,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    # ---- old log-probs -----------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(
        self,
        batch: StepBatch,
        micro_batch_size: int = 8,
        *,
        fit_logits: bool = False,
        trained_only: bool = False,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-aligned log-probs of every sample under the current weights, flat over the
        batch's tokens ([T] float32, as its "old_logprobs" field; NaN where there is none: each
        row's entry 0, the prompt before the logits window, a shard's rows on a stage before the
        last), and the forward's routing metrics ({} on a dense model).

        On an MoE model it also records every sample's natural routing into batch.routing (r3:
        while replaying batch.rollout_experts, whose agreement it measures).

        With the training `micro_batch_size` the values are bit for bit those of `train_step`'s
        forward (unchanged weights give ratios of exactly 1). `fit_logits=True` takes more rows
        per microbatch where they fit (`_fitted_micro_batch`): one forward instead of several on
        a small model, values equal to fp32 rounding (matmuls blocked over other row counts).
        `trained_only=True`: the tokens with a loss only (the LM head forms no other logits;
        NaN elsewhere), each bit for bit its value without it."""
        budget = None
        if fit_logits:
            micro_batch_size = self._fitted_micro_batch(batch, micro_batch_size)
            budget = self._fitted_budget()
        mbs, seq_len, _ = self._layout(batch, micro_batch_size, budget=budget)
        sweep = self.routing.record_sweep(batch, mbs, seq_len) if self.routing else None
        rows = self._forward_logprobs(mbs, seq_len, micro_batch_size, sweep, batch, trained_only)
        if self.routing is None or sweep is None:
            return rows, {}
        return rows, self.routing.finish_record(sweep, batch)

    def keep_reference(self, offload: bool = False) -> None:
        """Keep the chunks' current weights (the run's starting ones: call before a resume
        loads a checkpoint) as the reference policy of a KL penalty (model/reference.py)."""
        self.reference = ReferenceWeights(self.chunks, offload=offload)

    def reference_logprobs(self, batch: StepBatch, micro_batch_size: int = 8) -> torch.Tensor:
        """The reference policy's log-probs [T] (as `logprobs`), the batch untouched. The
        forward is the old-log-prob forward's with the reference weights swapped in: the same
        microbatches and the same routing (R3: the rollout's, replayed; otherwise each token's
        natural routing under the reference weights, recorded into a copy of the batch and
        dropped). So at the first update, with the policy still the reference, KL is 0, and
        under R3 the KL compares the two weights along the expert paths the rollout took."""
        if self.reference is None:
            raise UserError("reference_logprobs needs keep_reference (algo.kl_coef > 0)")
        copy = batch.without("old_logprobs", "ref_logprobs", "routing")
        with self.reference.swapped_in(self.chunks):
            lp, _ = self.logprobs(copy, micro_batch_size, fit_logits=True)
        return lp

    @torch.no_grad()
    def replayed_logprobs(
        self, batch: StepBatch, micro_batch_size: int = 8
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs ([T], as `logprobs`) under the current weights with the batch's routing replayed as `train_step`
        would (r2: recorded, r3: rollout; "none": recorded too), and this forward's
        routing/changed_fraction. batch.routing is unchanged."""
        if self.routing is None:
            raise UserError("replayed_logprobs needs an MoE model")
        mbs, seq_len, _ = self._layout(batch, micro_batch_size)
        source = "rollout" if self.routing.mode == ReplayMode.R3 else "recorded"
        sweep = self.routing.train_sweep(batch, mbs, seq_len, source)
        rows = self._forward_logprobs(mbs, seq_len, micro_batch_size, sweep, batch)
        return rows, self.routing.finish_train(sweep)

    def _forward_logprobs(self, mbs, seq_len, micro_batch_size, sweep, batch: StepBatch,
                          trained_only: bool = False):  # fmt: skip
        """Every row's log-probs [T] (a shard's: here, on the last stage; NaN elsewhere, and
        `trained_only` where no token has a loss)."""
        self._set_mode(False)
        vocab = self.spec.vocab_size

        def loss(mb, head, logits):  # logits: hidden states under the chunked head
            lp, _ = token_logprobs(mb, logits, vocab, head=head, trained_only=trained_only)
            if trained_only:
                lp = trained_only_values(mb, lp)
            return torch.zeros((), device=lp.device), {"lp": lp, "mb": mb}

        step = self._step(sweep, loss)
        outputs = self._run(mbs, seq_len, micro_batch_size, step, forward_only=True)
        pieces = [(out["mb"], out["lp"]) for out in outputs]
        return flat_logprobs(pieces, batch, self.world, self.device)

    # ---- one optimizer step ------------------------------------------------------------------

    def train_step(
        self,
        batch: StepBatch,
        loss_cfg: AlgoConfig,
        micro_batch_size: int = 8,
        *,
        on_policy: bool = False,
    ) -> Update:
        """Forward/backward over all microbatches, then one optimizer step: what it did.

        `on_policy=True`: the weights are the ones the batch's old log-probs would be computed
        with (the first update of a rollout batch), so this forward's own log-probs, detached,
        are the old ones (ratios exactly 1) and no separate old-log-prob forward is needed. The
        routing is the natural one (which is what R2 would record and replay); R3 needs the
        rollout's routing aligned by `logprobs` and is refused. The batch's "old_logprobs" is
        then set from this forward."""
        check_step(batch, loss_cfg, on_policy, self.routing.mode if self.routing else None)
        if on_policy:
            batch.fields.pop("old_logprobs", None)  # set from this forward below
        self._set_mode(True)
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Logits (the LM head and the log-softmax, forward and backward) only from the first
        # position with a loss: the prompts before it have none.
        mbs, seq_len, dp = self._layout(batch, micro_batch_size, window=True)
        sweep = self._train_sweep(batch, mbs, seq_len, on_policy)
        own: list = []  # on_policy: (microbatch, its log-probs) as the loss saw them
        # (microbatch index, token log-ratios, mask) of each loss call, for the drift split
        split: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = (
            [] if sweep is not None and sweep.moved is not None else None
        )
        loss = self._loss_fn(batch, loss_cfg, len(mbs) * dp, on_policy, own, split)
        step = self._step(sweep, loss)
        outputs = self._run(mbs, seq_len, micro_batch_size, step, forward_only=False)
        routing = {}
        if self.routing:
            assert sweep is not None  # made above with routing
            if split is not None:
                moved = sweep.moved_positions(batch.lengths.tolist())
                assert moved is not None  # split is made only when the sweep tracks moves
                outputs = [*outputs, *moved_split(split, moved)]
            routing = self.routing.finish_train(sweep)
        if on_policy:
            batch.set("old_logprobs", flat_logprobs(own, batch, self.world, self.device))
        ok, grad_norm, finite = optimizer_step(self.optimizer)
        metrics = reduce_stats(outputs, self.world, self.tp, self.device)
        if "tokens_moved_fraction" in metrics:
            routing[TOKENS_CHANGED] = metrics.pop("tokens_moved_fraction")
        metrics.update(routing)
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        metrics.update(grad_norm=norm, lr=self.optimizer.param_groups[0]["lr"])
        metrics |= padding_stats(mbs)
        return Update(finite=finite, applied=bool(ok), grad_norm=norm, loss=metrics["loss"],
                      stats=metrics)  # fmt: skip

    def _train_sweep(self, batch: StepBatch, mbs, seq_len: int, on_policy: bool):
        """The routing replay of this step: natural routing (nothing compared) on policy, else
        the batch's (R2: recorded, R3: rollout); None on a dense model."""
        if self.routing and on_policy:
            return self.routing.train_sweep(replace(batch, routing=None), mbs, seq_len, None)
        if self.routing:
            return self.routing.train_sweep(batch, mbs, seq_len)
        return None

    def _loss_fn(self, batch: StepBatch, loss_cfg: AlgoConfig, scale: int, on_policy: bool,
                 own: list, split: list | None):  # fmt: skip
        """The loss of one microbatch's logits, scaled for megatron's schedule; on policy it
        keeps its own log-probs in `own`, and the token log-ratios go to `split` when given."""
        count = loss_denominator(loss_mask_tensor(batch), loss_cfg.agg, loss_cfg.loss)
        if batch.sharded and self.dp > 1:  # the whole batch's: every replica's rows
            count = count.to(self.device)
            dist.all_reduce(count, group=self._dp_group)
        denom = float(count)
        vocab = self.spec.vocab_size

        def loss(mb, head, logits):  # logits: hidden states under the chunked head
            lp, ent = token_logprobs(mb, logits, vocab, with_entropy=True, head=head,
                                     trained_only=True)  # fmt: skip
            if on_policy:  # (own: none where no loss, as the head computed none there)
                mb.old_logprobs = lp.detach()
                own.append((mb, trained_only_values(mb, mb.old_logprobs)))
            value, stats = policy_loss(
                lp, mb.old_logprobs, mb.advantages, mb.mask, **loss_cfg.loss_kwargs(),
                rollout_logprobs=mb.rollout_logprobs, kl=kl_penalty(mb, loss_cfg),
                tis_weights=correction_weights_of(mb, loss_cfg),
                loss_scale_denominator=denom,
            )  # fmt: skip
            stats = dict(stats, loss_sum=value.detach(), entropy_sum=(ent.detach() * mb.mask).sum())
            if split is not None:  # the token log-ratios this loss saw, for the drift split
                split.append((mb.index, (lp - mb.old_logprobs).detach(), mb.mask))
            return value * scale, stats

        return loss

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group (the loop's schedule sets it per step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- checkpoint -------------------------------------------------------------------------

    def save(self, directory) -> None:
        """Model + optimizer state as one dist-checkpoint (collective; directory exists, empty)."""
        from megatron_gspo.train import optim_state

        optim_state.save_actor(self.chunks, self.optimizer, directory)

    def load(self, directory) -> None:
        """Load a checkpoint saved by `save` under any layout and either optimizer kind
        (collective)."""
        from megatron_gspo.train import optim_state

        optim_state.load_actor(self.chunks, self.optimizer, directory)

    def check_checkpoint(self, directory) -> None:
        """`load` would find adapters of this actor's base and shape in `directory` (or none,
        as this actor has none): a one-line error otherwise, before anything is loaded."""
        from megatron_gspo.model import lora_ckpt

        lora_ckpt.check(directory, [c.module for c in self.chunks])
