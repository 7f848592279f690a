"""`megatron-gspo score` under every parallel layout (gloo, 1-4 processes) against an HF forward.

Judged: log-probs equal transformers' within 1e-4 (fp32), with and without dense layers, and the
same within 1e-5 across TP1, TP2, EP2, PP2, TP2xEP2, PP2xEP2 and PP2xVPP2.
"""

import pytest
import torch

from tests.helpers import hf_token_logprobs, random_sequences, read_logprobs, run_cli, write_jsonl

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (processes, flags)
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "dp2": (2, []),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
    "pp2xep2": (4, ["--pp", "2", "--ep", "2"]),
}


def score(tmp_path, checkpoint, seqs, nproc, flags, tag):
    inp = write_jsonl(tmp_path / f"in-{tag}.jsonl", seqs)
    out = tmp_path / f"out-{tag}.jsonl"
    args = [
        "score",
        "--checkpoint",
        str(checkpoint),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--micro-batch-size",
        "2",
        *flags,
    ]
    proc = run_cli(args, nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one line says what was written (rank 0's: the others print nothing)
    said = f"wrote {out} ({len(seqs)} sequences with their per-token log-probs)"
    assert [line for line in proc.stdout.splitlines() if "wrote" in line] == [said]
    result = read_logprobs(out)
    assert all(r[0] is None and len(r) == len(s) for r, s in zip(result, seqs))
    return [torch.tensor(r[1:]) for r in result]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def moe_reference(tiny_models, tmp_path_factory):
    seqs = random_sequences(100)
    tp1 = score(tmp_path_factory.mktemp("tp1"), tiny_models["moe"], seqs, 1, [], "tp1")
    return seqs, hf_token_logprobs(tiny_models["moe"], seqs), tp1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_with_dense_layer_matches_hf_under_layout(tmp_path, tiny_models, moe_reference, layout):
    seqs, ref, tp1 = moe_reference
    nproc, flags = LAYOUTS[layout]
    got = (
        tp1 if layout == "tp1" else score(tmp_path, tiny_models["moe"], seqs, nproc, flags, layout)
    )
    assert max_diff(got, ref) < 1e-4
    # Layouts agree with each other more tightly than with HF.
    assert max_diff(got, tp1) < 1e-5


@pytest.mark.parametrize(
    "model, nproc, flags",
    [
        ("moe_all", 1, []),
        ("qwen3", 2, ["--tp", "2"]),
        ("moe4", 4, ["--pp", "2", "--vpp", "2"]),
        ("qwen2_tied", 4, ["--pp", "2", "--vpp", "2"]),
        ("qwen2_tied", 2, ["--tp", "2"]),
    ],
)
def test_other_architectures_match_hf(tmp_path, tiny_models, model, nproc, flags):
    seqs = random_sequences(100, seed=7)
    got = score(tmp_path, tiny_models[model], seqs, nproc, flags, model)
    assert max_diff(got, hf_token_logprobs(tiny_models[model], seqs)) < 1e-4
