"""The tiny RL run's starting checkpoint: a real Qwen3-MoE checkpoint that stops with EOS, is
partly competent on held-out prompts (greedy right on a minority, samples often right), is
deterministic for a seed, and is written completely or not at all."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.data.prompts import encode_prompt, load_prompts
from megatron_gspo.data.task_eval import complete, task_rewards
from megatron_gspo.data.warmstart import INFO_FILE, make_task_model, task_model_spec
from megatron_gspo.errors import UserError
from megatron_gspo.rewards import load_reward

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    import transformers

    path = make_task_model(tmp_path_factory.mktemp("ws") / "arith", task="arith", seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, tokenizer


def _answers(model, tokenizer, rows, **kw) -> list[str]:
    prompts = [encode_prompt(tokenizer, r.prompt) for r in rows]
    outs = complete(model, prompts, tokenizer.eos_token_id, tokenizer.pad_token_id, 8, **kw)
    assert all(o[-1] == tokenizer.eos_token_id and len(o) <= 4 for o in outs)
    return ["".join(tokenizer.decode(o, skip_special_tokens=True).split()) for o in outs]


def test_checkpoint_is_a_tiny_moe(start):
    path, model, tokenizer = start
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    assert config["num_hidden_layers"] >= 2 and config["mlp_only_layers"] == []
    assert tokenizer.decode([tokenizer.eos_token_id]) == "<|endoftext|>"
    info = json.loads((path / INFO_FILE).read_text())
    assert (info["task"], info["seed"]) == ("arith", 0)


def test_batched_greedy_matches_hf_generate(start):
    _, model, tokenizer = start
    rows = load_prompts("builtin:arith", "eval").rows[:12]
    batched = complete(
        model,
        [encode_prompt(tokenizer, r.prompt) for r in rows],
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        8,
    )
    for row, got in zip(rows, batched):
        ids = torch.tensor([encode_prompt(tokenizer, row.prompt)])
        ref = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
        assert ref[0, ids.shape[1] :].tolist() == got


def test_partly_competent_on_held_out_prompts(start):
    _, model, tokenizer = start
    rows = load_prompts("builtin:arith", "eval").rows
    truth = [str(sum(int(d) for d in re.findall(r"\d", r.prompt))) for r in rows]
    greedy = [a == t for a, t in zip(_answers(model, tokenizer, rows), truth)]
    accuracy = sum(greedy) / len(rows)
    scored = task_rewards(model, tokenizer, rows, load_reward("exact"))
    assert scored.flatten().tolist() == [float(g) for g in greedy]
    # greedy is right about where the typical mistake is too: the 21% of these sums below 10
    assert 0.15 <= accuracy <= 0.5, accuracy
    gen = torch.Generator().manual_seed(0)
    samples = [_answers(model, tokenizer, rows, temperature=1.0, generator=gen) for _ in range(8)]
    right = torch.tensor([[s[i] == truth[i] for s in samples] for i in range(len(rows))])
    mixed = (right.any(1) & ~right.all(1)).float().mean().item()
    pass_at_8 = right.any(1).float().mean().item()
    assert mixed >= 0.5, mixed  # most groups of 8 samples hold both right and wrong answers
    assert pass_at_8 >= accuracy + 0.3, (pass_at_8, accuracy)  # room for RL to improve greedy


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_deterministic_for_a_seed_whatever_the_thread_count(tmp_path):
    knobs = dict(hidden=32, batch_size=8, clean_steps=3, sloppy_steps=3)
    a = make_task_model(tmp_path / "a", seed=1, **knobs)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b = make_task_model(tmp_path / "b", seed=1, **knobs)
    finally:
        torch.set_num_threads(threads)
    c = make_task_model(tmp_path / "c", seed=2, **knobs)
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)


def test_calc_tool_model_has_the_chat_tokenizer(tmp_path):
    """The tool task's model: chars tokenizer, chat template, turns ending with <|im_end|>; its
    tuned settings (measured in warmstart.py's docstring) are the task's defaults."""
    import transformers

    _, spec = task_model_spec("calc_tool")
    assert (spec.batch_size, spec.keep_right, spec.moe_ffn) == (32, 0.3, 32)
    knobs = dict(hidden=32, batch_size=8, clean_steps=3, sloppy_steps=3)
    path = make_task_model(tmp_path / "calc", task="calc_tool", seed=0, **knobs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == [5]
    info = json.loads((path / INFO_FILE).read_text())
    assert (info["task"], info["batch_size"], info["moe_ffn"]) == ("calc_tool", 8, 32)
    assert all(info[f"{phase}_final_loss"] > 0 for phase in ("clean", "sloppy"))
    again = make_task_model(tmp_path / "again", task="calc_tool", seed=0, **knobs)
    ta, tb = _tensors(path), _tensors(again)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_bad_requests_leave_nothing_behind(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(UserError, match="exists; remove it or choose another --out"):
        make_task_model(tmp_path / "exists")
    with pytest.raises(UserError, match="unknown warm-start setting"):
        make_task_model(tmp_path / "m", lr=1.0)
    with pytest.raises(UserError, match="unknown task 'nope'"):
        make_task_model(tmp_path / "m", task="nope")
    # fails after the random model is written: the temporary directory goes too
    with pytest.raises(UserError, match="batch_size 5000 exceeds the 806 train prompts"):
        make_task_model(tmp_path / "m", hidden=32, batch_size=5000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_tool_reports_errors_in_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    cmd = [
        sys.executable,
        str(REPO / "tools" / "make_task_model.py"),
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "exists" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_build_stopped_by_a_signal_leaves_nothing_behind(tmp_path, sig):
    """`make-task-model` sent SIGTERM (a job scheduler's stop) or SIGINT mid-build removes its
    temporary directory (SIGTERM used to end the process with runs/.NAME.tmp-XXXX/ left)."""
    out = tmp_path / "runs" / "m"
    cmd = [sys.executable, "-m", "megatron_gspo", "make-task-model", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.parent.glob(".m.tmp-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "no build started"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert list(out.parent.iterdir()) == []
    # SIGTERM: SystemExit(143); SIGINT: the CLI's one line "interrupted" and exit 130
    assert proc.returncode == 128 + sig, stderr
