"""A LoRA GSPO run end to end (configs/tiny_moe_gspo_lora.yaml, the built-in server): every
sync is verified against the trainer's merged weights, the servers' sampling log-probs are the
trainer's (fp32), and a run killed after a checkpoint resumes to the same numbers as one that
was not."""

import pytest

from tests.e2e.test_train import metrics, task_model, train  # noqa: F401 (a fixture)

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


def test_resuming_lora_on_another_base_is_refused(task_model, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    rc, out = train(CONFIG, run, task_model, steps=1)
    assert rc == 0, out[-3000:]
    rc, out = train(CONFIG, run, task_model, "--resume", "--allow-config-change", "lora.rank=0",
                    steps=2)  # fmt: skip
    assert rc != 0 and "holds LoRA adapters; set lora.rank" in out, out[-2000:]


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
