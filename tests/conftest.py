"""Shared fixtures: tiny checkpoints made locally, and running the CLI (optionally under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

# What needs servers, several processes or a GPU is slow: `pytest -m "not slow" tests` is the
# inner loop (the unit tier), README's command runs everything.
SLOW_KINDS = ("distributed", "e2e", "contract", "slurm", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


TINY = {
    # Qwen3-MoE with a dense first layer, normalized top-k.
    "moe": TinySpec(dense_layers=[0]),
    # Four layers for PP x VPP, unnormalized top-k (norm_topk_prob=False).
    "moe4": TinySpec(layers=4, dense_layers=[0], norm_topk_prob=False, seed=1),
    # Every layer MoE.
    "moe_all": TinySpec(seed=2),
    "qwen3": TinySpec(arch="qwen3", seed=3),
    "qwen2_tied": TinySpec(arch="qwen2", layers=4, tie_embeddings=True, seed=4),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(spec, root / name) for name, spec in TINY.items()}


def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's default `--dist load`) and `--dist loadgroup`: tests/xdist_groups.py, so
    README's test command builds each costly module fixture once (xdist is imported only when
    it runs tests). Other `--dist` modes are xdist's own."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from tests.xdist_groups import ModuleGroups

    return ModuleGroups(config, log)
