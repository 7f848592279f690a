"""The `lora:` config section: rank, alpha, dropout, targets and how experts are adapted
(model/lora.py builds the adapters). No torch import, so a config loads and is checked without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from megatron_gspo.checks import in_range
from megatron_gspo.errors import UserError


class Target(StrEnum):
    """Modules an adapter can sit on (megatron names; HF: q/k/v_proj, o_proj, gate/up_proj,
    down_proj, experts.gate_up_proj, experts.down_proj)."""

    QKV = "linear_qkv"
    PROJ = "linear_proj"
    FC1 = "linear_fc1"  # dense MLP
    FC2 = "linear_fc2"
    EXPERT_FC1 = "expert_fc1"
    EXPERT_FC2 = "expert_fc2"


class ExpertAdapters(StrEnum):
    """How a MoE layer's experts are adapted.

    per_expert: one adapter per expert (what PEFT does through `target_parameters` on the 3-D
        expert tensors, prime-rl's grouped LoRA with A [E, r, in], and Megatron-Bridge on
        per-expert linears). Trainable parameters per expert linear: r (in + out).
    shared: one adapter per layer and expert projection, shared by all of the layer's experts
        (expert e computes (W_e + s B A) x). E times fewer adapter parameters, gradients and
        optimizer state on the experts. Megatron-Bridge's LoRA on a grouped expert linear is of
        this kind (one adapter on the grouped linear's input), held per expert-parallel rank, so
        its function changes with the EP size; here the adapter is the same on every rank: it is a
        dense parameter (all-reduced over the data-parallel group, which spans the EP ranks), its
        gradient the sum over the layer's experts. A PEFT export repeats it in every expert.
        (SGLang's MoE LoRA also serves a "shared outer" form: gate_up's A and down's B shared,
        the inner factors per expert.)
    """

    PER_EXPERT = "per_expert"
    SHARED = "shared"


@dataclass
class LoraConfig:
    rank: int = 0  # 0: off (full-weight training)
    alpha: float = 32.0  # scale s = alpha / rank
    dropout: float = 0.0  # on the adapter's input only
    targets: list[str] = field(default_factory=lambda: [t.value for t in Target])
    experts: ExpertAdapters = ExpertAdapters.PER_EXPERT  # one adapter per expert, or one for all

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        in_range(self.rank, "lora.rank", 0)
        in_range(self.alpha, "lora.alpha", 0, lo_open=True)
        in_range(self.dropout, "lora.dropout", 0, 1, hi_open=True)
        valid = [t.value for t in Target]
        for t in self.targets:
            if t not in valid:
                raise UserError(f"lora.targets: unknown target {t!r}; choose from {valid}")
        if self.enabled and not self.targets:
            raise UserError("lora.targets is empty; name at least one of " + ", ".join(valid))

    def adapts_experts(self) -> bool:
        return self.enabled and bool({Target.EXPERT_FC1, Target.EXPERT_FC2} & set(self.targets))

    def experts_build(self, grouped: bool | None, te: bool) -> bool | None:
        """The experts' build (`moe_grouped_gemm`) these adapters can sit on: SequentialMLP for
        per-expert adapters and under Transformer Engine (its grouped MLP takes none); the
        grouped experts of model/experts.py take a shared one. `grouped` is the configured
        choice (None: auto, then decided here where it matters); a choice that cannot work
        fails, naming the fix."""
        if not self.adapts_experts() or grouped is False:
            return grouped
        sequential_only = self.experts == ExpertAdapters.PER_EXPERT or te
        if grouped and sequential_only:
            fix = "" if te else "set lora.experts: shared (it runs on grouped experts), or "
            raise UserError(
                "LoRA on experts needs megatron's per-expert MLPs (SequentialMLP) here, not "
                f"grouped experts; {fix}set model.moe_grouped_gemm=false, or remove expert_fc1 "
                "and expert_fc2 from lora.targets"
            )
        return False if sequential_only else grouped

    def check_layout(self, tp: int, etp: int | None) -> None:
        """A shared expert adapter is a dense parameter: the experts must be split like the
        dense layers (expert-TP = TP)."""
        shared = self.experts == ExpertAdapters.SHARED and self.adapts_experts()
        if shared and etp is not None and etp != tp:
            raise UserError(
                "lora.experts: shared needs the experts split like the dense layers (parallel.etp "
                "equal to parallel.tp); unset parallel.etp, or set lora.experts: per_expert"
            )
