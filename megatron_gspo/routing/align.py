"""R3: the routed experts a rollout server returned, aligned with a training sample.

A server sends int32 [prompt + output - 1, layers, k]: row t is the routing of token t when the
server fed it (the last token is never fed, so it has no row). `layers` is every decoder layer
with zero rows for dense ones (SGLang, the built-in server) or the MoE layers only; both are
accepted. Row t is the training sample's token t, since a sample's tokens are prompt + output;
right padding and the last token have no ids and route naturally (taps.py). A shard of the RL
loop's batch holds its stage's MoE layers only (`given_layers`, train/shard.py).
"""

from __future__ import annotations

import numpy as np

from megatron_gspo.errors import UserError
from megatron_gspo.routing.storage import index_dtype


def align_rollout_experts(
    experts,
    n_tokens: int,
    num_layers: int,
    moe_layer_ids: list[int],
    layers: tuple[int, ...],
    topk: int,
    num_experts: int,
    sample: int,
    given_layers: tuple[int, ...] | None = None,
) -> np.ndarray:
    """One sample's server routing as [r, len(layers), k] small ints, r = min(rows, n_tokens),
    keeping only `layers` (global MoE layer ids, e.g. this pipeline stage's). UserError on
    anything that does not fit the sample or the model."""
    where = f"sample {sample}"
    if experts is None:
        raise UserError(
            f"{where} has no routed experts; routing_replay r3 needs them: generate with "
            "return_routed_experts=True on a server started with --enable-return-routed-experts"
        )
    a = np.asarray(experts)
    if a.ndim != 3 or a.shape[2] != topk:
        raise UserError(
            f"{where}: routed experts of shape {tuple(a.shape)}; expected [tokens, layers, {topk}] "
            "(is the rollout server serving the same model?)"
        )
    rows, n_layers, _ = a.shape
    if (
        given_layers is not None
        and n_layers == len(given_layers)
        and set(layers) <= set(given_layers)
    ):
        cols = [given_layers.index(layer) for layer in layers]
    elif n_layers == num_layers:
        cols = list(layers)
    elif n_layers == len(moe_layer_ids):
        cols = [moe_layer_ids.index(layer) for layer in layers]
    else:
        raise UserError(
            f"{where}: routed experts for {n_layers} layers; the model has {num_layers} decoder "
            f"layers, {len(moe_layer_ids)} of them MoE (is the rollout server serving it?)"
        )
    if rows not in (n_tokens - 1, n_tokens):
        raise UserError(
            f"{where}: routed experts cover {rows} tokens but the sample has {n_tokens} "
            f"(expected {n_tokens - 1}); request them with routed_experts_start_len=0 and "
            "keep the rollout's tokens as prompt + output"
        )
    picked = a[: min(rows, n_tokens)][:, cols]
    _check_ids(picked, num_experts, layers, where)
    return picked.astype(index_dtype(num_experts))


def _check_ids(ids: np.ndarray, num_experts: int, layers: tuple[int, ...], where: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise UserError(
            f"{where}: expert id {int(ids.max() if ids.max() >= num_experts else ids.min())} "
            f"outside [0, {num_experts}); is the rollout server serving the same model?"
        )
    if ids.shape[-1] > 1 and ids.size:
        s = np.sort(ids, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            t, col = np.argwhere((s[..., 1:] == s[..., :-1]).any(-1))[0]
            raise UserError(
                f"{where}: token {t} repeats an expert in its top-k at layer {layers[col]}, which "
                "the trainer's model has as MoE; is the rollout server serving the same model?"
            )
