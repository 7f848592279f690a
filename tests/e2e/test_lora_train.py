"""A LoRA GSPO run end to end (configs/tiny_moe_gspo_lora.yaml, the built-in server): every
sync is verified against the trainer's merged weights, the servers' sampling log-probs are the
trainer's (fp32), and a run killed after a checkpoint resumes to the same numbers as one that
was not."""

import pytest

from tests.e2e.test_train import error_lines, files, metrics, task_model, train  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e]

CONFIG = "tiny_moe_gspo_lora.yaml"


def test_lora_run_serves_the_merged_policy_and_resumes_exactly(task_model, tmp_path):  # noqa: F811
    ref = tmp_path / "ref"
    rc, out = train(CONFIG, ref, task_model, "train.checkpoint_every=1", steps=3)
    assert rc == 0, out[-3000:]
    rows = metrics(ref)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["mismatch/logprob_abs_diff"] < 1e-5, r  # rollout log-probs = trainer's
    assert (ref / "checkpoints" / "step_3" / "model" / "lora.json").is_file()

    run = tmp_path / "resumed"
    rc, out = train(CONFIG, run, task_model, "train.checkpoint_every=1", steps=2)
    assert rc == 0, out[-3000:]
    rc, out = train(CONFIG, run, task_model, "train.checkpoint_every=1", "--resume", steps=3)
    assert rc == 0, out[-3000:]
    for g, w in zip(metrics(run), rows):
        for key in ("reward/mean", "loss/policy", "grad_norm", "eval/reward"):
            assert g.get(key) == w.get(key), (g["step"], key, g.get(key), w.get(key))


def test_resuming_lora_as_full_weights_or_other_adapters_is_refused(task_model, tmp_path):  # noqa: F811
    """The adapters' rank, targets and expert mode set their tensors: a resume that changes
    them is one line before anything is loaded or written (it was megatron's shape-mismatch
    traceback, after the run's config had been replaced)."""
    run = tmp_path / "run"
    rc, out = train(CONFIG, run, task_model, steps=1)
    assert rc == 0, out[-3000:]
    before = files(run)
    rc, out = train(CONFIG, run, task_model, "--resume", "--allow-config-change", "lora.rank=0",
                    steps=2)  # fmt: skip
    assert rc != 0 and "holds LoRA adapters; set lora.rank" in out, out[-2000:]
    rc, out = train(CONFIG, run, task_model, "--resume", "--allow-config-change", "lora.rank=8",
                    "lora.experts=shared", steps=2)  # fmt: skip
    ckpt = run / "checkpoints" / "step_1" / "model"
    assert rc == 2 and error_lines(out)[-1] == (
        f"error: {ckpt}'s adapters have lora.rank=16 (not 8), lora.experts=per_expert (not "
        "shared), which set their shapes; resume with those (the run's config), or start "
        "another run with --run-dir NEW_DIR"
    ), out[-3000:]
    assert files(run) == before


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("lora.targets=[linear_fc1, linear_fc2]", "lora.targets linear_fc1, linear_fc2 match no "
         "linear of this model's layers (here: linear_qkv, linear_proj, expert_fc1, expert_fc2); "
         "name at least one of those"),
        ("lora.rank=1000000000000", "lora.rank 1000000000000 is above the model's hidden size "
         "64, the most an adapter's rank can use; set lora.rank <= 64"),
    ],
)  # fmt: skip
def test_adapters_the_model_cannot_take_are_one_line_errors(task_model, tmp_path, override,  # noqa: F811
                                                            error):  # fmt: skip
    """Targets only a dense MLP has, on a model of MoE layers (an IndexError after a whole
    rollout), and a rank past what any adapted linear can use (a 1.5 PB allocation)."""
    rc, out = train(CONFIG, tmp_path / "run", task_model, override, steps=1)
    assert rc == 2 and error_lines(out) == [f"error: {error}"], out[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", ["tiny_moe_grpo_r2.yaml", "tiny_moe_grpo_r3.yaml"])
def test_lora_with_routing_replay(config, task_model, tmp_path):  # noqa: F811
    """GRPO with R2 / R3 replays routing through a frozen router as with full weights."""
    run = tmp_path / "run"
    rc, out = train(config, run, task_model, "lora.rank=8", "lora.alpha=16", steps=2)
    assert rc == 0, out[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["mismatch/logprob_abs_diff"] < 1e-5, r
        assert "routing/changed_fraction" in r, sorted(r)
    if config.endswith("r3.yaml"):
        assert all("routing/rollout_train_agreement" in r for r in rows[1:])
