"""A training run's checkpoint exported to HF (`convert megatron-to-hf --megatron
RUN/checkpoints/step_N`), checked against independent computations: the round trip back to
Megatron holds the checkpoint's own tensors (both read by torch's DCP loader, not ours), and a
transformers forward of the export gives the log-probs the Megatron model gives on them. A
Megatron checkpoint as a run's model.path, where the trainer starts the servers, is refused
before anything is written (the servers load HF weights)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.e2e.test_train import error_lines, task_model, train  # noqa: F401 (a fixture)
from tests.helpers import (
    hf_token_logprobs,
    random_sequences,
    read_logprobs,
    run_cli,
    write_jsonl,
)

pytestmark = [pytest.mark.e2e]

CONFIG = "tiny_moe_gspo.yaml"


def dcp_model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a dist-checkpoint (not the optimizer's), by torch's own loader."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(directory)).read_metadata()
    state = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")
    }
    with warnings.catch_warnings():  # ("assuming the intent is to load in a single process")
        warnings.simplefilter("ignore", UserWarning)
        load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return state


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def trained_run(task_model, tmp_path_factory) -> Path:  # noqa: F811
    run = tmp_path_factory.mktemp("export") / "run"
    rc, out = train(CONFIG, run, task_model, steps=2)
    assert rc == 0, out[-3000:]
    return run


def test_a_run_checkpoint_exports_to_hf_with_its_trained_weights(trained_run, task_model, tmp_path):  # noqa: F811
    """It used to say "no config.json in .../step_2; point at an HF checkpoint directory"."""
    ckpt, hf, back = trained_run / "checkpoints" / "step_2", tmp_path / "hf", tmp_path / "back"
    proc = run_cli(["convert", "megatron-to-hf", "--megatron", str(ckpt), "--out", str(hf)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {hf} (HF checkpoint of {ckpt})"
    # the run's model: its config and tokenizer; the weights are the trained ones, not the base's
    assert (hf / "config.json").read_bytes() == (task_model / "config.json").read_bytes()
    assert (hf / "tokenizer.json").read_bytes() == (task_model / "tokenizer.json").read_bytes()
    base, exported = safetensors_of(task_model), safetensors_of(hf)
    assert set(exported) == set(base)
    assert any(not torch.equal(exported[k], base[k]) for k in base)

    # round trip: back to Megatron, the tensors are the run checkpoint's model tensors exactly
    proc = run_cli(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(back)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = dcp_model_tensors(ckpt / "model"), dcp_model_tensors(back / "model")
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(got[key].to(t.dtype), t), key

    # the HF model (transformers) scores as the Megatron model does on those tensors
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    seqs = random_sequences(vocab)
    scored = tmp_path / "scored.jsonl"
    # (the run's checkpoint itself is not scored: its line names the export above; it said
    # "no config.json in ...; point at an HF checkpoint directory")
    proc = run_cli(["score", "--checkpoint", str(ckpt), "--input", str(write_jsonl(
        tmp_path / "in.jsonl", seqs)), "--output", str(scored)])  # fmt: skip
    assert proc.returncode == 2 and not scored.exists(), proc.stderr[-3000:]
    assert f"export it to HF first: megatron-gspo convert megatron-to-hf --megatron {ckpt} " in (
        proc.stderr
    )
    args = ["score", "--checkpoint", str(back), "--input", str(write_jsonl(tmp_path / "in.jsonl",
            seqs)), "--output", str(scored)]  # fmt: skip
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mine, ref in zip(read_logprobs(scored), hf_token_logprobs(hf, seqs)):
        assert mine[0] is None
        torch.testing.assert_close(torch.tensor(mine[1:]), ref, atol=2e-5, rtol=1e-5)


def test_a_bf16_run_exports_its_bf16_weights_under_a_config_that_says_so(task_model, tmp_path):  # noqa: F811
    """model.dtype=bfloat16 from a float32 model: the export holds the weights as trained, in
    bfloat16, and its config.json says bfloat16 (the rest of it is the base's). It used to keep
    the base's "float32", so transformers upcast the weights on load without a word."""
    from transformers import AutoModelForCausalLM

    run, hf = tmp_path / "run", tmp_path / "hf"
    bf16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16", "sync.verify_every=0",
            "train.checkpoint_every=1")  # fmt: skip
    rc, out = train(CONFIG, run, task_model, *bf16, steps=1)
    assert rc == 0, out[-3000:]
    ckpt = run / "checkpoints" / "step_1"
    proc = run_cli(["convert", "megatron-to-hf", "--megatron", str(ckpt), "--out", str(hf)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    base_cfg, cfg = (json.loads((d / "config.json").read_text()) for d in (task_model, hf))
    assert base_cfg["dtype"] == "float32"
    exported = safetensors_of(hf)  # (safetensors' own loader)
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert cfg["dtype"] == "bfloat16"
    assert {k: v for k, v in cfg.items() if k != "dtype"} == {
        k: v for k, v in base_cfg.items() if k != "dtype"
    }
    # the trained tensors themselves, not a cast of them
    want = dcp_model_tensors(ckpt / "model")["embedding.word_embeddings.weight"]
    got = exported["model.embed_tokens.weight"]
    assert want.dtype == torch.bfloat16 and torch.equal(got, want[: got.shape[0]])

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.get_input_embeddings().weight.detach(), got)


def test_a_run_checkpoint_that_cannot_be_exported_is_one_line(trained_run, tmp_path):
    """Each is one line naming the fix, exit 2, nothing written: a run directory given for its
    checkpoint, a damaged checkpoint (it verifies against its manifest first), a base model
    moved away, a checkpoint copied out of its run."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("logs", "*.lock", ".lock"))
    ckpt, out = run / "checkpoints" / "step_2", tmp_path / "out"

    def refused(src: Path) -> str:
        proc = run_cli(["convert", "megatron-to-hf", "--megatron", str(src), "--out", str(out)])
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert not out.exists()
        (line,) = error_lines(proc.stderr)
        return line

    assert refused(run) == (
        f"error: {run} is a run directory, not a checkpoint; pass one of its checkpoints, e.g. "
        f"the newest: --megatron {ckpt}"
    )
    alone = tmp_path / "alone"
    shutil.copytree(ckpt, alone)
    assert refused(alone) == (
        f"error: {alone} is a training run's checkpoint outside its run, whose config.yaml names "
        "the model it was trained from (model.path); export it where its run left it: "
        "--megatron RUN_DIR/checkpoints/step_N"
    )
    config = (run / "config.yaml").read_text()
    moved, cfg = tmp_path / "moved_base", yaml.safe_load(config)
    cfg["model"]["path"] = str(moved)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert refused(ckpt) == (
        f"error: {ckpt}'s model comes from the model its run started from, {moved} (model.path "
        f"in {run / 'config.yaml'}), which is not there: run the command in the directory the "
        "run was started from, or put that model back at that path"
    )
    (run / "config.yaml").write_text(config)
    shard = next((ckpt / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert refused(ckpt) == (
        f"error: checkpoint {ckpt} does not verify (model/{shard.name} does not match its "
        "checksum); re-copy it, or export another of its run's checkpoints"
    )


def test_a_megatron_model_path_is_refused_before_the_run_is_written(task_model, tmp_path):  # noqa: F811
    """The servers the trainer starts load HF weights: a Megatron checkpoint's hf/ has none. It
    used to pass the checks, write config.yaml and logs/, then fail on the server's start."""
    mcore = tmp_path / "mcore"
    proc = run_cli(["convert", "hf-to-megatron", "--hf", str(task_model), "--out", str(mcore)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc, out = train(CONFIG, tmp_path / "run", mcore, steps=1)
    assert rc == 2, out[-3000:]
    assert error_lines(out) == [
        f"error: model.path {mcore} is a Megatron checkpoint, and the rollout servers the trainer "
        f"starts load HF weights: convert it first (megatron-gspo convert megatron-to-hf "
        f"--megatron {mcore} --out HF_DIR), then pass model.path=HF_DIR"
    ]
    assert not (tmp_path / "run").exists()
