"""The parallel axes, with no torch import, so a config loads and is checked without it.

`ParallelConfig`, the run config's `parallel` section, names the axes (tp, pp, vpp, ep, etp);
`ParallelDims` is those axes with the launch's world size (dp derived from it) and checks them
against the model before anything is built. model/parallel.py starts the process groups over
them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_gspo.checks import positive
from megatron_gspo.errors import UserError


@dataclass(frozen=True)
class ParallelConfig:
    """The sizes of the parallel axes (the world size is the launch's: dp = world / (tp * pp))."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int | None = None  # virtual pipeline chunks per rank; null: no interleaving
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel; null: the same as tp

    def check(self) -> None:
        for name in ("tp", "pp", "ep", "vpp", "etp"):
            if getattr(self, name) is not None:
                positive(getattr(self, name), f"parallel.{name}")

    def dims(self, world_size: int) -> ParallelDims:
        """These axes in a launch of `world_size` processes."""
        return ParallelDims(**asdict(self), world_size=world_size)


@dataclass(frozen=True)
class ParallelDims(ParallelConfig):
    world_size: int = 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def virtual_stages(self) -> int | None:
        """megatron's virtual pipeline size: the chunks per rank where more than one, else None."""
        return self.chunks if self.chunks > 1 else None

    def validate(self, spec=None, keys: bool = False) -> None:
        """Raise UserError for a layout that cannot work, naming the fix: the command-line
        flags (--tp 2), or with `keys` the config keys (parallel.tp=2) that set it."""
        n = _Names(self, keys)
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise UserError(f"{n.key(name)} must be >= 1")
        if spec is not None:
            self._validate_model(spec, n)
        if self.world_size % (self.tp * self.pp):
            raise UserError(
                f"world size {self.world_size} is not divisible by tp*pp={self.tp * self.pp}; "
                f"change {n.key('tp')}/{n.key('pp')} or the number of processes"
            )
        if self.world_size % (self.expert_tp * self.ep * self.pp):
            raise UserError(
                f"world size {self.world_size} is not divisible by etp*ep*pp="
                f"{self.expert_tp * self.ep * self.pp}; change {n.key('ep')}/{n.key('etp')}"
            )
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise UserError(f"{n.key('vpp')} needs {n.key('pp')} >= 2")

    def _validate_model(self, spec, n: _Names) -> None:
        if spec.num_heads % self.tp or spec.num_kv_heads % self.tp:
            raise UserError(
                f"{n.set('tp')} does not divide the model's {spec.num_heads} attention heads and "
                f"{spec.num_kv_heads} key/value heads; choose a {n.key('tp')} that divides both"
            )
        if spec.ffn_hidden_size % self.tp:
            raise UserError(
                f"{n.set('tp')} does not divide intermediate_size {spec.ffn_hidden_size}"
            )
        if spec.is_moe and spec.num_experts % self.ep:
            raise UserError(
                f"{n.set('ep')} does not divide the model's {spec.num_experts} experts; "
                f"choose a {n.key('ep')} that divides it"
            )
        if not spec.is_moe and self.ep > 1:
            raise UserError(f"{n.set('ep')} needs an MoE model; this {spec.architecture} is dense")
        if spec.is_moe and spec.moe_ffn_hidden_size % self.expert_tp:
            raise UserError(
                f"{n.set('etp', self.expert_tp)} does not divide moe_intermediate_size "
                f"{spec.moe_ffn_hidden_size}"
            )
        stages = self.pp * self.chunks
        if spec.num_layers % stages:
            raise UserError(
                f"{spec.num_layers} layers cannot be split into pp*vpp={stages} equal stages; "
                f"change {n.key('pp')}/{n.key('vpp')}"
            )


@dataclass(frozen=True)
class _Names:
    """How an error names a parallel size: a command-line flag or a config key."""

    dims: ParallelDims
    keys: bool

    def key(self, name: str) -> str:
        return f"parallel.{name}" if self.keys else f"--{name}"

    def set(self, name: str, value: int | None = None) -> str:
        value = getattr(self.dims, name) if value is None else value
        return f"parallel.{name}={value}" if self.keys else f"--{name} {value}"
