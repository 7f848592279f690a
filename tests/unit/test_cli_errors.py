"""Bad input to the CLI: a one-line error naming the fix, exit status 2, no partial output."""

import json
import shutil
import signal
from pathlib import Path

import pytest

from megatron_gspo import cli
from tests.helpers import (
    random_sequences,
    read_logprobs,
    run_cli,
    saved_checkpoint,
    stopped_mid_write,
    write_jsonl,
)

pytestmark = pytest.mark.unit


def assert_clean_failure(proc, pattern, parent):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and pattern in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(parent.glob(".*tmp*")), "temporary output left behind"


def main_error(argv: list[str], capsys) -> str:
    """The error line of `megatron-gspo ARGV` run in this process (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_checkpoint(tmp_path):
    proc = run_cli(
        ["convert", "hf-to-megatron", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]
    )
    assert_clean_failure(proc, "does not exist", tmp_path)
    assert not (tmp_path / "o").exists()


def test_truncated_checkpoint(tmp_path, tiny_models):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["moe"], bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = run_cli(["convert", "hf-to-megatron", "--hf", str(bad), "--out", str(tmp_path / "o")])
    assert_clean_failure(proc, "truncated or corrupt", tmp_path)
    assert not (tmp_path / "o").exists()


def test_missing_weight_file(tmp_path, tiny_models):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["moe"], bad)
    (bad / "model.safetensors").unlink()
    proc = run_cli(
        ["score", "--checkpoint", str(bad), "--input", "x", "--output", str(tmp_path / "o")]
    )
    assert_clean_failure(proc, "no model.safetensors", tmp_path)


def test_unknown_architecture(tmp_path, tiny_models):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["moe"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = run_cli(["convert", "hf-to-megatron", "--hf", str(bad), "--out", str(tmp_path / "o")])
    assert_clean_failure(proc, "unsupported architecture", tmp_path)


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--tp", "3"], "does not divide the model's 4 attention heads"),
        (["--ep", "3"], "does not divide the model's 8 experts"),
    ],
)
def test_layout_that_does_not_divide_the_model(tmp_path, tiny_models, flags, pattern):
    out = tmp_path / "o"
    proc = run_cli(
        ["convert", "hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(out), *flags]
    )
    assert_clean_failure(proc, pattern, tmp_path)
    assert not out.exists()


def test_existing_output_is_kept(tmp_path, tiny_models):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli(
        ["convert", "hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(out)]
    )
    assert_clean_failure(proc, "exists; remove it or choose another --out", tmp_path)
    assert (out / "keep.txt").read_text() == "mine"


def test_score_rejects_bad_input_lines(tmp_path, tiny_models):
    inp = write_jsonl(tmp_path / "in.jsonl", random_sequences(100, lengths=(4,)))
    with open(inp, "a") as f:
        f.write('{"input_ids": [1, 999999]}\n')
    out = tmp_path / "out.jsonl"
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
    assert_clean_failure(proc, "in.jsonl:2: token id outside the vocabulary", tmp_path)
    assert not out.exists()


def test_generation_beyond_the_models_context_is_refused_before_the_run(tmp_path, tiny_models):
    """rollout.max_new_tokens=100000000 used to be accepted without a word."""
    run = tmp_path / "run"
    model = tiny_models["moe"]
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    proc = run_cli(["train", "--config", str(config), "--run-dir", str(run),
                    f"model.path={model}", "rollout.max_new_tokens=100000000"])  # fmt: skip
    assert_clean_failure(proc, "rollout.max_new_tokens (100000000) = 100000256 tokens", tmp_path)
    assert f"context of 2048 tokens (max_position_embeddings in {model}/config.json)" in (
        proc.stderr
    )
    assert not run.exists()


def test_sglang_without_its_environment_is_refused_before_the_run(
    tmp_path, tiny_models, monkeypatch
):
    """rollout.backend=sglang with no SGLang environment built (or named): the run directory was
    made, then each server failed on its import; now one line names the fix, nothing made."""
    monkeypatch.setenv("SGLANG_VENV", str(tmp_path / "no-venv"))
    monkeypatch.delenv("SGLANG_PYTHON", raising=False)
    run = tmp_path / "run"
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    proc = run_cli(["train", "--config", str(config), "--run-dir", str(run),
                    f"model.path={tiny_models['moe']}", "rollout.backend=sglang"])  # fmt: skip
    assert_clean_failure(proc, "has no SGLang; build SGLang's environment with `bash "
                         f"scripts/sglang_env.sh` (it goes to {tmp_path / 'no-venv'}", tmp_path)  # fmt: skip
    assert not run.exists()
    # so are the modes SGLang cannot serve on a CPU (they were refused after the directory)
    proc = run_cli(["train", "--config", str(config), "--run-dir", str(run),
                    f"model.path={tiny_models['moe']}", "rollout.backend=sglang",
                    "rollout.quantization=fp8"])  # fmt: skip
    assert_clean_failure(proc, "rollout.quantization=fp8 with SGLang needs a GPU", tmp_path)
    assert not run.exists()


def test_a_model_that_does_not_load_leaves_no_run_directory(tmp_path, tiny_models):
    """The weights are read after the run directory is claimed: a start that fails there leaves
    no directory of its own, and in one that was there (a launch script's logs/) nothing more."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["moe"], bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    run = tmp_path / "run"
    proc = run_cli(["train", "--config", str(config), "--run-dir", str(run), f"model.path={bad}"])
    assert_clean_failure(proc, "model.safetensors is truncated or corrupt", tmp_path)
    assert not run.exists()
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "launch.log").write_text("the launch script's\n")
    proc = run_cli(["train", "--config", str(config), "--run-dir", str(run), f"model.path={bad}"])
    assert_clean_failure(proc, "model.safetensors is truncated or corrupt", tmp_path)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert left == [".lock", "logs", "logs/launch.log"]
    assert (run / "logs" / "launch.log").read_text() == "the launch script's\n"


def test_train_refuses_steps_past_train_steps_before_anything(tmp_path, tiny_models, capsys):
    """`train --steps 50` on a config of train.steps 40 trained to step 40 and stopped there
    without a word (--steps only stops a run earlier: the schedule is train.steps')."""
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    run = tmp_path / "run"
    argv = ["train", "--config", str(config), "--run-dir", str(run), "--steps", "50",
            f"model.path={tiny_models['moe']}"]  # fmt: skip
    assert main_error(argv, capsys) == (
        "error: --steps 50 is past train.steps 40; set train.steps=50 to train longer (--steps "
        "only stops a run before train.steps)"
    )
    assert not run.exists()
    assert "--steps 9 is past train.steps 8;" in main_error([*argv[:-2], "9", "train.steps=8"],
                                                            capsys)  # fmt: skip
    assert not run.exists()


def test_score_names_the_export_for_a_run_checkpoint_or_run_directory(tmp_path, capsys):
    """`score --checkpoint RUN/checkpoints/step_N` said "no config.json in ...; point at an HF
    checkpoint directory"; a run's checkpoint is exported to HF first (convert megatron-to-hf)."""
    run = tmp_path / "run"
    ckpt = saved_checkpoint(run, 2)  # (its files as a save leaves them: export.py goes by them)
    tail = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    export = f"megatron-gspo convert megatron-to-hf --megatron {ckpt} --out NEW_DIR"
    assert main_error(["score", "--checkpoint", str(ckpt), *tail], capsys) == (
        f"error: {ckpt} is a training run's checkpoint, not an HF or Megatron checkpoint; "
        f"export it to HF first: {export}, then pass --checkpoint NEW_DIR"
    )
    assert main_error(["score", "--checkpoint", str(run), *tail], capsys) == (
        f"error: {run} is a training run's directory, not an HF or Megatron checkpoint; export "
        f"one of its checkpoints to HF first, e.g. the newest: {export}, then pass "
        "--checkpoint NEW_DIR"
    )
    assert not (tmp_path / "out.jsonl").exists()


def test_serve_says_a_model_path_that_is_not_there_does_not_exist(tmp_path, capsys):
    """It said "no config.json in /abs/path/nothere; point at an HF checkpoint directory"."""
    missing = tmp_path / "nothere"
    assert main_error(["serve", "--model", str(missing), "--port", "0"], capsys) == (
        f"error: --model {missing} does not exist; point it at an HF checkpoint"
    )


def test_a_config_json_path_that_is_not_there_is_said_not_to_exist(tmp_path):
    from megatron_gspo.errors import UserError
    from megatron_gspo.hf.config import load_hf_config

    with pytest.raises(UserError, match=f"^{tmp_path / 'gone'} does not exist; point at an HF"):
        load_hf_config(tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=f"^no config.json in {tmp_path / 'empty'}; point at"):
        load_hf_config(tmp_path / "empty")


def _without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of the model directory `src` without its tokenizer files (a Megatron checkpoint's
    are under hf/)."""
    shutil.copytree(src, dst)
    for f in dst.rglob("*"):
        if f.name.startswith(("tokenizer", "special_tokens_map")):
            f.unlink()
    return dst


NO_TOKENIZER = (
    "{key} {path} has no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model"
    "{where}): copy the tokenizer files from the model it came from"
)


def test_train_refuses_a_model_without_its_tokenizer_before_the_run(
    tmp_path, tiny_models, moe_megatron
):
    """transformers builds an empty tokenizer from a directory without one: the run started its
    servers, then said "prompt '...' encodes to no tokens; check the prompt and template". Now
    one line names the fix, before anything starts, for an HF model and a Megatron one (whose
    `convert` took the tokenizer-less directory: it needs none)."""
    from megatron_gspo.hf.tokenizer_files import MEGATRON_META
    from megatron_gspo.model.checkpoint import META

    assert MEGATRON_META == META
    hf = _without_tokenizer(tiny_models["moe"], tmp_path / "hf_copy")
    meg = _without_tokenizer(moe_megatron, tmp_path / "meg_copy")
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    run = tmp_path / "run"
    for path, where in [(hf, ""), (meg, f" in {meg / 'hf'}")]:
        proc = run_cli(["train", "--config", str(config), "--run-dir", str(run),
                        f"model.path={path}"])  # fmt: skip
        line = NO_TOKENIZER.format(key="model.path", path=path, where=where)
        assert_clean_failure(proc, line, tmp_path)
        assert "rollout server" not in proc.stdout + proc.stderr
        assert not run.exists()


def test_serve_refuses_a_model_without_its_tokenizer(tmp_path, tiny_models):
    """`serve` loaded the model and served without a word; a text request then got a 400."""
    model = _without_tokenizer(tiny_models["moe"], tmp_path / "copy")
    proc = run_cli(["serve", "--model", str(model), "--port", "0"], timeout=120)
    line = NO_TOKENIZER.format(key="--model", path=model, where="")
    assert_clean_failure(proc, line, tmp_path)
    assert proc.stdout == ""


def _with_config(src: Path, dst: Path, config: str = "config.json", **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / config).read_text())
    cfg.update(changes)
    (dst / config).write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"vocab_size": 10}, "model.embed_tokens.weight is (128, 64), the config implies (10, 64)"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings is true, but the weights have"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, not 'yes'"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "q_proj.weight is (64, 64)"),
    ],
)
def test_hf_to_megatron_refuses_a_config_that_disagrees_with_the_weights(
    tmp_path, tiny_models, changes, pattern
):
    """vocab_size 10 over 128 embedding rows, or tie_word_embeddings beside a trained lm_head,
    used to convert with exit 0 and the rows or the lm_head lost; 3 heads over 4 heads' weights
    was a ValueError traceback."""
    bad = _with_config(tiny_models["moe"], tmp_path / "bad", **changes)
    out = tmp_path / "o"
    proc = run_cli(["convert", "hf-to-megatron", "--hf", str(bad), "--out", str(out)])
    assert_clean_failure(proc, pattern, tmp_path)
    assert not out.exists()


@pytest.fixture(scope="module")
def moe_megatron(tmp_path_factory, tiny_models) -> Path:
    out = tmp_path_factory.mktemp("meg") / "moe"
    proc = run_cli(
        ["convert", "hf-to-megatron", "--hf", str(tiny_models["moe"]), "--out", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"hidden_size": 128}, "model.embed_tokens.weight is (128, 64), the config implies (128, 128)"),
        ({"vocab_size": 10}, "the embedding has trained rows past config.json's vocab_size 10"),
        ({"tie_word_embeddings": True}, "but the dist-checkpoint holds its own output layer"),
        ({"moe_intermediate_size": 16}, "gate_proj.weight is (32, 64), the config implies (16, 64)"),
    ],
)  # fmt: skip
def test_megatron_to_hf_refuses_a_config_that_disagrees_with_the_weights(
    tmp_path, moe_megatron, changes, pattern
):
    """hidden_size 128 over 64-wide weights used to convert with exit 0 into a checkpoint
    nothing could load."""
    bad = _with_config(moe_megatron, tmp_path / "bad", "hf/config.json", **changes)
    out = tmp_path / "o"
    proc = run_cli(["convert", "megatron-to-hf", "--megatron", str(bad), "--out", str(out)])
    assert_clean_failure(proc, pattern, tmp_path)
    assert "checkpoint and config disagree" in proc.stderr or "true or false" in proc.stderr
    assert not out.exists()


def _unwritable_outputs(tmp_path: Path, name: str) -> list[tuple[str, str]]:
    """(path, the start of its error line) for outputs that cannot be created: below a file,
    and in /proc (which takes no new entries, even from root)."""
    (tmp_path / "file").write_text("mine")
    below = tmp_path / "file" / name
    return [
        (str(below), f"cannot create output path {below}: {tmp_path / 'file'} is a file, not a directory; choose another"),
        (f"/proc/{name}", f"cannot create output path /proc/{name}: /proc takes no new files ("),
    ]  # fmt: skip


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_convert_refuses_an_output_it_cannot_create(
    tmp_path, tiny_models, moe_megatron, direction, capsys
):
    """--out below a file or in /proc used to fail with a FileExistsError, NotADirectoryError
    or PermissionError traceback."""
    src = ["--hf", str(tiny_models["moe"])]
    if direction == "megatron-to-hf":
        src = ["--megatron", str(moe_megatron)]
    for out, start in _unwritable_outputs(tmp_path, "x"):
        line = main_error(["convert", direction, *src, "--out", out], capsys)
        assert line.startswith(f"error: {start}") and line.endswith(" another --out"), line
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    assert (tmp_path / "file").read_text() == "mine"


def test_score_refuses_an_output_it_cannot_create_before_loading(tmp_path, tiny_models, capsys):
    """Used to fail only after loading the model and scoring every line, with a traceback."""
    inp = write_jsonl(tmp_path / "in.jsonl", [[3, 4]])
    ckpt = ["score", "--checkpoint", str(tiny_models["moe"]), "--input", str(inp)]
    for out, start in _unwritable_outputs(tmp_path, "x.jsonl"):
        line = main_error([*ckpt, "--output", out], capsys)
        assert line.startswith(f"error: {start}") and line.endswith(" another --output"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "in.jsonl"]


def test_make_task_model_refuses_an_output_it_cannot_create(tmp_path, capsys):
    """--out below a file used to be a bare "[Errno 17] File exists" line, and in /proc a
    PermissionError traceback."""
    for out, start in _unwritable_outputs(tmp_path, "m"):
        line = main_error(["make-task-model", "--out", out], capsys)
        assert line.startswith(f"error: {start}") and line.endswith(" another --out"), line
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    assert (tmp_path / "file").read_text() == "mine"


def _writing(command: str, tiny_models, moe_megatron, tmp_path: Path) -> list[str]:
    """The arguments of `command` but its output flag."""
    if command == "make-tiny-model":
        return ["make-tiny-model"]
    if command == "score":
        inp = write_jsonl(tmp_path / "in.jsonl", random_sequences(100))
        return ["score", "--checkpoint", str(tiny_models["moe"]), "--input", str(inp)]
    src = ["--hf", str(tiny_models["moe"])]
    if command == "megatron-to-hf":
        src = ["--megatron", str(moe_megatron)]
    return ["convert", command, *src]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize(
    "command", ["make-tiny-model", "hf-to-megatron", "megatron-to-hf", "score"]
)
def test_a_command_stopped_by_a_signal_mid_write_leaves_nothing_behind(
    tmp_path, tiny_models, moe_megatron, command, sig
):
    """SIGTERM (a job scheduler's stop) used to end these commands with their temporary output
    (.OUT.tmp-XXXX) left beside --out, and score's SIGINT too. Now it is removed; the files the
    user had there are as they were."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine")
    out = work / ("out.jsonl" if command == "score" else "out")
    flag = "--output" if command == "score" else "--out"
    args = _writing(command, tiny_models, moe_megatron, tmp_path)
    rc, err = stopped_mid_write([*args, flag, str(out)], out, sig)
    assert [p.name for p in work.iterdir()] == ["mine.txt"]
    assert (work / "mine.txt").read_text() == "mine"
    # SIGTERM: SystemExit(143); SIGINT: the CLI's one line "interrupted" and exit 130
    assert rc == 128 + sig, err[-2000:]


def test_score_makes_a_missing_output_directory(tmp_path, tiny_models):
    """As convert does for --out (used to be a FileNotFoundError after all the scoring)."""
    inp = write_jsonl(tmp_path / "in.jsonl", [[3, 4]])
    out = tmp_path / "new" / "dir" / "out.jsonl"
    ckpt = str(tiny_models["moe"])
    proc = run_cli(["score", "--checkpoint", ckpt, "--input", str(inp), "--output", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [len(lp) for lp in read_logprobs(out)] == [2]


@pytest.mark.parametrize(
    "content, message",
    [
        (b'\xff\xfe{"input_ids":[3]}\n', "in.jsonl:1: not UTF-8 text; save the file as UTF-8"),
        (b'{"input_ids":[3]}\n{"input_ids":[true,4]}\n', 'in.jsonl:2: "input_ids" holds true or false; token ids are ints'),
        (json.dumps({"input_ids": [3] * 3000}).encode(), "in.jsonl:1: 3000 tokens exceed the model's context of 2048 tokens (max_position_embeddings); shorten or remove the line"),
    ],
)  # fmt: skip
def test_score_refuses_bad_input(tmp_path, tiny_models, content, message, capsys):
    """Non-UTF-8 bytes were a UnicodeDecodeError traceback; true was scored as token 1, and a
    sequence past the model's context was scored without a word."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(content)
    out = tmp_path / "out.jsonl"
    argv = ["score", "--checkpoint", str(tiny_models["moe"]), "--input", str(inp)]
    assert main_error([*argv, "--output", str(out)], capsys) == f"error: {tmp_path}/{message}"
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, not 0"),
        (["--micro-batch-size", "-1"], "--micro-batch-size must be >= 1, not -1"),
        (["--input", "DIR"], "input DIR is a directory; point --input at a JSONL file"),
    ],
)
def test_score_refuses_bad_flags(tmp_path, tiny_models, flags, message, capsys):
    """--micro-batch-size 0 was a ValueError traceback, -1 a StopIteration; a directory as
    --input was said not to exist."""
    inp = write_jsonl(tmp_path / "in.jsonl", [[3, 4]])
    flags = [str(tmp_path) if f == "DIR" else f for f in flags]
    argv = ["score", "--checkpoint", str(tiny_models["moe"]), "--input", str(inp)]
    line = main_error([*argv, "--output", str(tmp_path / "o.jsonl"), *flags], capsys)
    assert line == "error: " + message.replace("DIR", str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--topk", "99"], "config.json: num_experts_per_tok must be an integer in [1, 8], not 99; set by --topk"),
        (["--layers", "0"], "config.json: num_hidden_layers must be an integer in [1, 2147483647], not 0; set by --layers"),
        (["--hidden", "-1"], "config.json: hidden_size must be an integer in [1, 2147483647], not -1; set by --hidden"),
        (["--heads", "3"], "config.json: num_attention_heads (3) must be a multiple of num_key_value_heads (2); set by --heads"),
        (["--experts", "0"], "--experts must be >= 1 for a qwen3_moe model, not 0; use --arch qwen3 for a dense one"),
        (["--moe-ffn", "0"], "--moe-ffn must be >= 1 for a qwen3_moe model, not 0; use --arch qwen3 for a dense one"),
        (["--dense-layers", "7"], "--dense-layers 7 is not a layer of a 2-layer model; use layer ids in [0, 2)"),
        (["--arch", "qwen3", "--experts", "4"], "--experts 4 sets the experts of an MoE model, and --arch qwen3 is dense; drop --experts, or use --arch qwen3_moe"),
        (["--arch", "qwen2", "--topk", "1"], "--topk 1 sets the experts of an MoE model, and --arch qwen2 is dense; drop --topk, or use --arch qwen3_moe"),
        (["--arch", "qwen3", "--dense-layers", "0"], "--dense-layers 0 sets the experts of an MoE model, and --arch qwen3 is dense; drop --dense-layers, or use --arch qwen3_moe"),
        (["--arch", "qwen3", "--no-norm-topk-prob"], "--no-norm-topk-prob sets the experts of an MoE model, and --arch qwen3 is dense; drop --no-norm-topk-prob, or use --arch qwen3_moe"),
        # an MoE flag given at its default value is refused too
        (["--arch", "qwen3", "--experts", "8"], "--experts 8 sets the experts of an MoE model, and --arch qwen3 is dense; drop --experts, or use --arch qwen3_moe"),
        (["--arch", "qwen2", "--topk", "2"], "--topk 2 sets the experts of an MoE model, and --arch qwen2 is dense; drop --topk, or use --arch qwen3_moe"),
        (["--arch", "qwen3", "--moe-ffn", "32"], "--moe-ffn 32 sets the experts of an MoE model, and --arch qwen3 is dense; drop --moe-ffn, or use --arch qwen3_moe"),
        (["--arch", "qwen3", "--dense-layers", ""], "--dense-layers sets the experts of an MoE model, and --arch qwen3 is dense; drop --dense-layers, or use --arch qwen3_moe"),
    ],
)  # fmt: skip
def test_make_tiny_model_refuses_a_model_the_tools_would_refuse(tmp_path, flags, message, capsys):
    """Each of these used to write a checkpoint with exit 0 (that convert then refused, or that
    was not the model asked for: a dense --arch ignored the MoE flags, silently so when one was
    given at its default value, while another value was refused), or fail with a RuntimeError
    traceback (--hidden -1)."""
    argv = ["make-tiny-model", "--out", str(tmp_path / "m"), *flags]
    assert main_error(argv, capsys) == f"error: {message}"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["make-tiny-model", "make-task-model"])
def test_a_negative_seed_is_refused_as_trains_seed_is(tmp_path, command, capsys):
    """--seed -1 used to write a model (exit 0) while `train seed=-1` was refused: now both say
    the same range in one line, and nothing is written."""
    from megatron_gspo.config import load_config
    from megatron_gspo.errors import UserError

    with pytest.raises(UserError) as train:
        load_config(None, ["model.path=/m", "seed=-1"])
    line = main_error([command, "--out", str(tmp_path / "m"), "--seed", "-1"], capsys)
    assert line == f"error: --{train.value}"
    assert line == "error: --seed must be an integer in [0, 9223372036854775807], not -1"
    assert not list(tmp_path.iterdir())


def _written(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_make_tiny_model_applies_the_moe_defaults_where_not_given(tmp_path, capsys):
    """The MoE flags default to None (so a dense --arch can tell one given): not given, the
    model is TinySpec()'s, byte for byte, as when each is given at its default value; a dense
    --arch without them is TinySpec(arch=...)'s."""
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    moe = ["--experts", "8", "--topk", "2", "--moe-ffn", "32", "--dense-layers", ""]
    for name, flags in (("plain", []), ("given", moe), ("dense", ["--arch", "qwen3"])):
        cli.main(["make-tiny-model", "--out", str(tmp_path / name), *flags])
    make_tiny_model(TinySpec(), tmp_path / "spec")
    make_tiny_model(TinySpec(arch="qwen3"), tmp_path / "spec_dense")
    spec = _written(tmp_path / "spec")
    assert _written(tmp_path / "plain") == spec == _written(tmp_path / "given")
    assert _written(tmp_path / "dense") == _written(tmp_path / "spec_dense") != spec


def test_make_tiny_model_says_what_it_wrote_in_its_one_line(tmp_path):
    """transformers' "Writing model shards: 100%|####| 1/1" progress bar came before it."""
    proc = run_cli(["make-tiny-model", "--out", str(tmp_path / "m")])
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", f"wrote {tmp_path / 'm'}\n")


def test_make_tiny_model_refuses_bad_layer_ids(tmp_path, capsys):
    """--dense-layers x was a ValueError traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(["make-tiny-model", "--out", str(tmp_path / "m"), "--dense-layers", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "megatron-gspo make-tiny-model: error: argument --dense-layers: "
        "'x' is not a comma-separated list of layer ids, e.g. 0,3"
    )
    assert not list(tmp_path.iterdir())
