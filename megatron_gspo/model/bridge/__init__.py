"""HF <-> Megatron weight mapping, one module per architecture.

This package is the only place the mapping lives; checkpoint conversion and weight sync both use
it. A bridge answers, for every Megatron parameter of a model chunk: which HF tensors make it
(global layer and expert indices), how they fuse (QKV with GQA grouping, gate/up), and along which
dimension tensor parallelism splits it (`Layout`).
"""

from megatron_gspo.model.bridge.base import Bridge, Layout, ParamMap
from megatron_gspo.model.bridge.qwen import QWEN2, QWEN3, QWEN3_MOE

BRIDGES: dict[str, Bridge] = {b.arch: b for b in (QWEN3_MOE, QWEN3, QWEN2)}


def get_bridge(arch: str) -> Bridge:
    return BRIDGES[arch]


__all__ = ["BRIDGES", "Bridge", "Layout", "ParamMap", "get_bridge"]
