"""This project's LoRA adapters <-> PEFT's names and layouts (HF Qwen3 / Qwen3-MoE modules).

Attention and dense MLP adapters are PEFT's `target_modules` (q/k/v/o_proj, gate/up/down_proj:
nn.Linear, lora_A [r, in], lora_B [out, r]). Experts are 3-D parameters in transformers 5
(`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]), which PEFT adapts per expert
through `target_parameters`: lora_A.weight [r*E, in] stacks the experts' A (expert-major) and
lora_B.weight [out, r*E] holds B_e in columns j*E + e (PEFT reshapes it to [out, r, E]). With both
expert targets PEFT nests its wrappers: down_proj's outermost (`experts.lora_*`), gate_up_proj's
inside it (`experts.base_layer.lora_*`).

PEFT (0.21) rewrites target_modules ending in gate_proj/up_proj/down_proj into expert targets
for Qwen3-MoE (a conversion for adapters trained with transformers 4), which drops the adapters
of a Qwen3-MoE's dense MLP layers (`mlp_only_layers`); a model whose layers are all MoE is
unaffected. `peft_tensors` gives the names PEFT's own save uses (no adapter name).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.model.lora import Kind, LoraAdapter
from megatron_gspo.model.lora_apply import adapters
from megatron_gspo.model.lora_config import LoraConfig, Target

PREFIX = "base_model.model.model.layers"
_MODULES = {
    Target.QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    Target.PROJ: ("self_attn.o_proj",),
    Target.FC1: ("mlp.gate_proj", "mlp.up_proj"),
    Target.FC2: ("mlp.down_proj",),
}


def peft_config(cfg: LoraConfig, dense: bool = True) -> dict:
    """PEFT LoraConfig keyword arguments for the same adapters. `dense=False` (every layer MoE)
    leaves out the dense MLP's names, which PEFT would otherwise turn into expert targets."""
    targets = set(cfg.targets) - (set() if dense else {Target.FC1, Target.FC2})
    modules = [m.rpartition(".")[2] for t, ms in _MODULES.items() if t in targets for m in ms]
    params = [p for t, p in ((Target.EXPERT_FC1, "experts.gate_up_proj"),
                             (Target.EXPERT_FC2, "experts.down_proj")) if t in targets]  # fmt: skip
    return dict(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                target_modules=modules, target_parameters=params or None)  # fmt: skip


def _full(adapter: LoraAdapter, p: torch.Tensor, dim: int) -> torch.Tensor:
    """The parameter (or gradient) gathered over the adapter's TP group along `dim`."""
    if adapter.tp == 1:
        return p.detach().clone()
    parts = [torch.empty_like(p) for _ in range(adapter.tp)]
    dist.all_gather(parts, p.detach().contiguous(), group=adapter.group)
    return torch.cat(parts, dim=dim)


def _factors(adapter: LoraAdapter, grads: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(A_full [blocks*r, in], [B_full per part]) of one adapter, values or gradients."""

    def value(p):
        if not grads:
            return p
        g = getattr(p, "main_grad", None)
        return g if g is not None else (p.grad if p.grad is not None else torch.zeros_like(p))

    row = adapter.site.kind in (Kind.ROW, Kind.EXPERT_ROW)
    a = _full(adapter, value(adapter.A), 1) if row else value(adapter.A).detach().clone()
    bs = [value(b).detach().clone() if row else _full(adapter, value(b), 0) for b in adapter.B]
    return a.float().cpu(), [b.float().cpu() for b in bs]


def _writer(adapter: LoraAdapter) -> bool:
    from megatron.core import parallel_state as mpu

    expert = (
        adapter.site.kind in (Kind.EXPERT_COLUMN, Kind.EXPERT_ROW) and not adapter.site.shared_by
    )
    dp = mpu.get_expert_data_parallel_rank() if expert else mpu.get_data_parallel_rank()
    return adapter.group.rank() == 0 and dp == 0


def local_factors(chunks, grads: bool = False) -> dict[str, tuple]:
    """{site name: (A_full, [B_full])} of this rank's adapters (collective over TP). An adapter
    shared by a layer's experts is given under each expert's name (as PEFT holds it)."""
    out = {}
    for adapter in adapters(chunks):
        a, bs = _factors(adapter, grads)
        if _writer(adapter):
            out.update({name: (a, bs) for name in _expert_names(adapter.site)})
    return out


def _expert_names(site) -> list[str]:
    """`layers.L.experts.linear_fc1` shared by E experts -> `layers.L.experts.{e}.linear_fc1`."""
    if not site.shared_by:
        return [site.name]
    head, _, fc = site.name.rpartition(".")
    return [f"{head}.{e}.{fc}" for e in range(site.shared_by)]


def all_factors(chunks, grads: bool = False) -> dict[str, tuple]:
    """Every rank's factors on every rank (adapters are small; collective over the world)."""
    mine = local_factors(chunks, grads)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for p in parts for k, v in p.items()}


def peft_tensors(factors: dict[str, tuple], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """PEFT state-dict entries (its saved names) from `all_factors`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, tuple]] = {}
    r = cfg.rank
    for name, (a, bs) in factors.items():
        parts = name.split(".")
        lid = int(parts[1])
        if parts[2] == "experts":
            experts.setdefault((lid, parts[4]), {})[int(parts[3])] = (a, bs)
            continue
        for i, module in enumerate(_MODULES[Target(parts[2])]):
            key = f"{PREFIX}.{lid}.{module}"
            out[f"{key}.lora_A.weight"] = a[i * r : (i + 1) * r].contiguous()  # block i
            out[f"{key}.lora_B.weight"] = bs[i]
    both = {Target.EXPERT_FC1.value, Target.EXPERT_FC2.value} <= set(cfg.targets)
    for (lid, fc), per in experts.items():
        n = len(per)
        a = torch.cat([per[e][0] for e in range(n)], dim=0)  # [r*E, in], expert-major
        b = torch.stack([torch.cat(per[e][1], dim=0) for e in range(n)], dim=-1)  # [out, r, E]
        inner = both and fc == "linear_fc1"
        key = f"{PREFIX}.{lid}.mlp.experts" + (".base_layer" if inner else "")
        out[f"{key}.lora_A.weight"] = a.contiguous()
        out[f"{key}.lora_B.weight"] = b.reshape(b.shape[0], -1).contiguous()
    return out
