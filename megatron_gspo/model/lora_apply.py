"""Put LoRA adapters (model/lora.py) on a built model's targeted linears and freeze the rest.

Called once the base weights are loaded and before the actor wraps the chunks in megatron's DDP:
DDP buckets, and the optimizer holds, only parameters with requires_grad, so the frozen base
keeps no gradient buffer and no optimizer state; the adapters are all there is to train and to
all-reduce. Pipeline stages and experts need nothing of their own: an adapter lives in the same
chunk and expert as its base weight (global layer and expert indices name it); one shared by a
layer's experts (`lora.experts: shared`) lives on the MoE layer, a dense parameter.
"""

from __future__ import annotations

from megatron_gspo.errors import UserError
from megatron_gspo.model.lora import (
    Kind,
    LoraAdapter,
    Rows,
    Site,
    attach,
    attach_grouped,
    attach_shared,
)
from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig, Target


def apply_lora(chunks, cfg: LoraConfig, seed: int = 0) -> list[LoraAdapter]:
    """Freeze every parameter of `chunks` and attach adapters on cfg.targets; returns them
    (none when LoRA is off: then nothing is frozen)."""
    if not cfg.enabled:
        return []
    _check_fits(chunks, cfg)
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    out: list[LoraAdapter] = []
    for chunk in chunks:
        spec = chunk.model_spec
        for layer in chunk.decoder.layers:
            out += _layer(layer, layer.layer_number - 1, spec, cfg, seed)
    return out


def _check_fits(chunks, cfg: LoraConfig) -> None:
    """lora.targets name a linear these layers have, and lora.rank is at most the hidden size
    (every adapted linear has min(in, out) <= it, so a larger rank adds nothing but memory):
    one-line errors, before anything is frozen or allocated."""
    hidden = chunks[0].model_spec.hidden_size
    if cfg.rank > hidden:
        raise UserError(
            f"lora.rank {cfg.rank} is above the model's hidden size {hidden}, the most an "
            f"adapter's rank can use; set lora.rank <= {hidden}"
        )
    present = {Target.QKV.value, Target.PROJ.value}  # every layer's attention
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            moe = getattr(layer.mlp, "experts", None) is not None
            present |= {t.value for t in _MLP_TARGETS[moe]}
    if not present & set(cfg.targets):
        raise UserError(
            f"lora.targets {', '.join(cfg.targets)} match no linear of this model's layers "
            f"(here: {', '.join(t.value for t in Target if t.value in present)}); name at "
            "least one of those"
        )


_MLP_TARGETS = {False: (Target.FC1, Target.FC2), True: (Target.EXPERT_FC1, Target.EXPERT_FC2)}


def _layer(layer, lid: int, spec, cfg: LoraConfig, seed: int) -> list[LoraAdapter]:
    targets = set(cfg.targets)
    h, d = spec.hidden_size, spec.head_dim
    nq, nkv = spec.num_heads, spec.num_kv_heads
    attn, mlp = layer.self_attention, layer.mlp
    sites = []
    if Target.QKV in targets:
        parts = ((0, nq * d), (1, nkv * d), (2, nkv * d))
        sites.append((attn, "linear_qkv", Site(f"layers.{lid}.linear_qkv", Kind.COLUMN,
                                               Rows.QKV, parts, h, nkv)))  # fmt: skip
    if Target.PROJ in targets:
        sites.append(
            (
                attn,
                "linear_proj",
                Site(f"layers.{lid}.linear_proj", Kind.ROW, Rows.ONE, ((0, h),), nq * d),
            )
        )
    experts = getattr(mlp, "experts", None)
    if experts is None:
        f = spec.ffn_hidden_size
        if Target.FC1 in targets:
            sites.append((mlp, "linear_fc1", Site(f"layers.{lid}.linear_fc1", Kind.COLUMN,
                                                  Rows.GLU, ((0, f), (1, f)), h)))  # fmt: skip
        if Target.FC2 in targets:
            sites.append(
                (
                    mlp,
                    "linear_fc2",
                    Site(f"layers.{lid}.linear_fc2", Kind.ROW, Rows.ONE, ((0, h),), f),
                )
            )
    out = [attach(parent, child, site, cfg, seed) for parent, child, site in sites]
    if experts is not None and targets & {Target.EXPERT_FC1, Target.EXPERT_FC2}:
        out += _expert_adapters(mlp, experts, lid, spec, cfg, seed)
    return out


def _expert_adapters(mlp, experts, lid: int, spec, cfg: LoraConfig, seed: int) -> list:
    """Per-expert adapters (SequentialMLP), or one per projection shared by the experts
    (SequentialMLP or this project's grouped experts)."""
    local = getattr(experts, "local_experts", None)
    if local is None:  # grouped experts: ours take a shared adapter, TE's none (else: the fix)
        cfg.experts_build(True, te=not isinstance(getattr(experts, "lora", None), dict))
        return _shared_expert_adapters(mlp, experts, None, lid, spec, cfg, seed)
    if cfg.experts == ExpertAdapters.SHARED:
        return _shared_expert_adapters(mlp, experts, list(local), lid, spec, cfg, seed)
    sites = _expert_sites(list(local), lid, spec, set(cfg.targets))
    return [attach(parent, child, site, cfg, seed) for parent, child, site in sites]


_LINEAR = {Target.EXPERT_FC1: "linear_fc1", Target.EXPERT_FC2: "linear_fc2"}


def _expert_site(name: str, fc: Target, spec, shared_by: int = 0) -> Site:
    h, f = spec.hidden_size, spec.moe_ffn_hidden_size
    if fc is Target.EXPERT_FC1:
        return Site(f"{name}.linear_fc1", Kind.EXPERT_COLUMN, Rows.GLU, ((0, f), (0, f)), h,
                    shared_by=shared_by)  # fmt: skip
    return Site(f"{name}.linear_fc2", Kind.EXPERT_ROW, Rows.ONE, ((0, h),), f, shared_by=shared_by)


def _expert_sites(local: list, lid: int, spec, targets: set) -> list:
    """One site per local expert and target, named by the expert's global index."""
    from megatron.core import parallel_state as mpu

    first = mpu.get_expert_model_parallel_rank() * len(local)
    sites = []
    for i, expert in enumerate(local):
        for fc in (Target.EXPERT_FC1, Target.EXPERT_FC2):
            if fc in targets:
                site = _expert_site(f"layers.{lid}.experts.{first + i}", fc, spec)
                sites.append((expert, _LINEAR[fc], site))
    return sites


def _shared_expert_adapters(mlp, experts, local: list | None, lid: int, spec, cfg: LoraConfig,
                            seed: int) -> list:  # fmt: skip
    """One adapter per expert projection, registered on the MoE layer (`experts_fc1_lora`):
    added to every local expert's linear (`local`, SequentialMLP), or called by grouped experts
    on all of their tokens (`local` None). lora.experts: shared."""
    from megatron.core import parallel_state as mpu

    cfg.check_layout(
        mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    )
    out = []
    for fc in (Target.EXPERT_FC1, Target.EXPERT_FC2):
        if fc not in cfg.targets:
            continue
        site = _expert_site(f"layers.{lid}.experts", fc, spec, spec.num_experts)
        short = _LINEAR[fc].removeprefix("linear_")  # fc1 / fc2
        if local is None:
            out.append(attach_grouped(experts, mlp, short, site, cfg, seed))
        else:
            bases = [getattr(expert, _LINEAR[fc]) for expert in local]
            out.append(attach_shared(mlp, f"experts_{short}_lora", bases, site, cfg, seed))
    return out


def adapters(chunks) -> list[LoraAdapter]:
    """Every adapter of this rank's chunks (DDP-wrapped or not), in module order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, LoraAdapter)]
