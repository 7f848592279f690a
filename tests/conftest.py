"""Shared fixtures: tiny checkpoints made locally, and running the CLI (optionally under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# Overrides that make a tiny config's training run quick (a few seconds a step) in tests.
QUICK_TRAIN = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.micro_batch_size=4",
    "train.eval_prompts=8",
    "train.eval_every=2",
    "logging.tensorboard=false",
    "logging.console=false",
]


def cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_cli(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `megatron-gspo ARGS`, under torchrun with `nproc` processes when nproc > 1."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_gspo.cli", *args]
    else:
        from megatron_gspo.comm import free_port

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            "-m",
            "megatron_gspo.cli",
            *args,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env())


def hf_token_logprobs(checkpoint: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Independent reference: log p(token_t | prefix) from a transformers forward, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = model(torch.tensor([s])).logits[0].float().log_softmax(-1)
            out.append(logp[:-1].gather(-1, torch.tensor(s[1:]).unsqueeze(-1)).squeeze(-1))
    return out


def random_sequences(vocab: int, lengths=(5, 17, 9, 12, 3), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def write_jsonl(path: Path, seqs) -> Path:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return path


def read_logprobs(path: Path) -> list[list[float | None]]:
    return [json.loads(line)["logprobs"] for line in path.read_text().splitlines()]
