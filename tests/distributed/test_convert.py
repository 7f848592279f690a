"""HF -> Megatron -> HF conversion is bit-exact across layouts, and the result loads in transformers."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_gspo.hf.io import HFReader
from tests.helpers import (
    cli_env,
    hf_token_logprobs,
    random_sequences,
    read_logprobs,
    run_cli,
    write_jsonl,
)

pytestmark = pytest.mark.distributed


def convert(args, nproc) -> str:
    """Run `convert ARGS` on `nproc` ranks; the one line it prints (rank 0's: what it wrote)."""
    proc = run_cli(["convert", *args], nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "wrote" in line]
    assert len(said) == 1, proc.stdout[-3000:]
    return said[0]


def assert_bit_exact(a_dir, b_dir):
    a, b = HFReader(a_dir), HFReader(b_dir)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    "model, to_megatron, to_hf",
    [
        ("moe", (1, []), (4, ["--tp", "2", "--ep", "2"])),
        ("moe4", (4, ["--pp", "2", "--ep", "2"]), (1, [])),
        ("qwen2_tied", (2, ["--tp", "2"]), (4, ["--pp", "2", "--vpp", "2"])),
        ("moe_all", (4, ["--ep", "4"]), (2, ["--tp", "2", "--etp", "1"])),
    ],
)
def test_round_trip_is_bit_exact(tmp_path, tiny_models, model, to_megatron, to_hf):
    src = tiny_models[model]
    meg, back = tmp_path / "megatron", tmp_path / "hf"
    said = convert(
        ["hf-to-megatron", "--hf", str(src), "--out", str(meg), *to_megatron[1]], to_megatron[0]
    )
    assert said == f"wrote {meg} (Megatron checkpoint of {src})"
    said = convert(
        ["megatron-to-hf", "--megatron", str(meg), "--out", str(back), *to_hf[1]], to_hf[0]
    )
    assert said == f"wrote {back} (HF checkpoint of {meg})"
    assert_bit_exact(src, back)
    assert not list(tmp_path.glob(".*tmp*")), "temporary directories left behind"


# A Megatron checkpoint saved the way the trainer saves: a model loaded from HF, then megatron's
# own dist_checkpointing writer (forked writer processes, CRCs set).
MEGATRON_WRITER = """
import sys
from pathlib import Path

from megatron_gspo.model import checkpoint as mckpt
from megatron_gspo.hf import io as hf_io
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import checkpoint_spec, load_policy

if __name__ == "__main__":
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_distributed(ParallelDims())
    chunks = load_policy(src, ParallelDims())
    (out / "model").mkdir(parents=True)
    mckpt.save_model(chunks, out / "model")
    (out / "hf").mkdir()
    hf_io.copy_non_weight_files(src, out / "hf")
    mckpt.write_meta(
        out,
        spec=checkpoint_spec(src)[0],
        padded_vocab=chunks[0].padded_vocab_size,
        dtype=chunks[0].config.params_dtype,
    )
"""


def test_checkpoint_from_megatrons_own_writer_converts_back(tmp_path, tiny_models):
    src, meg, back = tiny_models["moe"], tmp_path / "megatron", tmp_path / "hf"
    script = tmp_path / "write.py"
    script.write_text(MEGATRON_WRITER)
    proc = subprocess.run(
        [sys.executable, str(script), str(src), str(meg)],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert(["megatron-to-hf", "--megatron", str(meg), "--out", str(back), "--ep", "2"], 2)
    assert_bit_exact(src, back)


def test_bf16_round_trip_and_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    src = make_tiny_model(TinySpec(dtype="bfloat16", dense_layers=[0]), tmp_path / "bf16")
    meg, back = tmp_path / "megatron", tmp_path / "hf"
    convert(["hf-to-megatron", "--hf", str(src), "--out", str(meg), "--tp", "2"], 2)
    convert(["megatron-to-hf", "--megatron", str(meg), "--out", str(back)], 1)
    assert_bit_exact(src, back)
    model = AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_the_exported_config_names_the_dtype_of_the_weights(tmp_path):
    """bf16 weights under a config.json that says float32, in both the `dtype` key and the older
    `torch_dtype` (an HF export of an earlier version did so) convert back under a config that
    says bfloat16 in both, the rest of it as it was; transformers loads them in bf16. The export
    used to copy the config as is."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    src = make_tiny_model(TinySpec(dtype="bfloat16", layers=1), tmp_path / "bf16")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(dtype="float32", torch_dtype="float32")
    (src / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    meg, back = tmp_path / "megatron", tmp_path / "hf"
    convert(["hf-to-megatron", "--hf", str(src), "--out", str(meg)], 1)
    convert(["megatron-to-hf", "--megatron", str(meg), "--out", str(back)], 1)
    assert_bit_exact(src, back)
    assert {t.dtype for t in load_file(back / "model.safetensors").values()} == {torch.bfloat16}
    got = json.loads((back / "config.json").read_text())
    assert got == {**cfg, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_bf16_policy_scores_like_hf_in_bf16(tmp_path):
    """A bf16 checkpoint builds a bf16 policy (the trainer's forward with model.dtype=bfloat16);
    its log-probs match an HF transformers forward in bf16 within bf16's rounding: a mean
    |difference| of at most 8 unit roundoffs (u = 2^-8) and no token beyond 64 u, where fp32
    agrees to 1e-4. Two implementations rounding in different orders differ by a few u per
    log-prob (measured: mean 3 u, max 8 u); a wrong weight differs by far more."""
    from transformers import AutoModelForCausalLM

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    src = make_tiny_model(TinySpec(dtype="bfloat16", dense_layers=[0], init_std=0.2),
                          tmp_path / "bf16")  # fmt: skip
    seqs = random_sequences(100, seed=5)
    inp, out = write_jsonl(tmp_path / "in.jsonl", seqs), tmp_path / "out.jsonl"
    proc = run_cli(["score", "--checkpoint", str(src), "--input", str(inp), "--output", str(out),
                    "--tp", "2"], 2)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    diffs = []
    with torch.no_grad():
        for s, got in zip(seqs, read_logprobs(out), strict=True):
            logp = hf(torch.tensor([s])).logits[0].float().log_softmax(-1)
            want = logp[:-1].gather(-1, torch.tensor(s[1:]).unsqueeze(-1)).squeeze(-1)
            diffs.append((torch.tensor(got[1:]) - want).abs())
    d, u = torch.cat(diffs), 2.0**-8
    assert d.mean() <= 8 * u and d.max() <= 64 * u, (d.mean(), d.max())


def test_score_from_megatron_checkpoint_matches_hf(tmp_path, tiny_models):
    meg = tmp_path / "megatron"
    convert(["hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(meg)], 1)
    seqs = random_sequences(100, seed=3)
    inp, out = write_jsonl(tmp_path / "in.jsonl", seqs), tmp_path / "out.jsonl"
    proc = run_cli(
        [
            "score",
            "--checkpoint",
            str(meg),
            "--input",
            str(inp),
            "--output",
            str(out),
            "--tp",
            "2",
            "--ep",
            "2",
        ],
        4,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = hf_token_logprobs(tiny_models["moe"], seqs)
    for got, want in zip(read_logprobs(out), ref):
        assert (torch.tensor(got[1:]) - want).abs().max() < 1e-4
