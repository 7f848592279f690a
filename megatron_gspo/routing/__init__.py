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

Each part is imported from its module (align.py, modes.py, replay.py, storage.py, ...): this file
imports nothing, so the run config, which imports routing/modes.py, loads no torch.
"""
