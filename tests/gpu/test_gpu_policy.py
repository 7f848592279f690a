"""GPU tier (run on a machine with CUDA): the same policy on NCCL + Transformer Engine when
installed. Skipped where there is no GPU; CI machines have none."""

import pytest
import torch

from tests.helpers import hf_token_logprobs, random_sequences, read_logprobs, run_cli, write_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_score_on_gpu_matches_hf(tmp_path, tiny_models):
    seqs = random_sequences(100)
    inp, out = write_jsonl(tmp_path / "in.jsonl", seqs), tmp_path / "out.jsonl"
    proc = run_cli(
        [
            "score",
            "--checkpoint",
            str(tiny_models["moe"]),
            "--input",
            str(inp),
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got, want in zip(read_logprobs(out), hf_token_logprobs(tiny_models["moe"], seqs)):
        # TF32 / TE kernels: looser than the CPU tier's 1e-4.
        assert (torch.tensor(got[1:]) - want).abs().max() < 2e-3


def test_cpu_compat_is_never_imported_on_gpu(tmp_path, tiny_models):
    import subprocess
    import sys

    code = (
        "import sys; from megatron_gspo.model.parallel import *; "
        "init_distributed(ParallelDims()); "
        "assert 'megatron_gspo.model.cpu_compat' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
