"""`megatron-gspo study` over a custom set of arms (SAPO, CISPO) and a two-value sweep of the tiny
study: every (arm, value) runs, the report has the scaling table and figure, and running the same
command again runs nothing and rebuilds the report, as --report-only does; plus the plan's rules
for arms and sweeps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.errors import UserError
from megatron_gspo.study.overrides import parse_sweep
from megatron_gspo.study.plan import algo_table, build_study
from tests.helpers import cli_env

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "tiny_moe_gspo.yaml"
QUICK = [
    "rollout.prompts_per_step=2",
    "train.micro_batch_size=4",
    "train.eval_prompts=4",
    "train.eval_every=1",
    "algo.minibatches=2",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(seed=0), tmp_path_factory.mktemp("task") / "model")


def _study(out: Path, model: Path) -> tuple[int, str]:
    args = ["--config", str(BASE), "--algos", "sapo,cispo", "--seeds", "1", "--steps", "1",
            "--sweep", "rollout.group_size=2,4", "--out", str(out), f"model.path={model}", *QUICK]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "megatron_gspo.study", *args],
                          capture_output=True, text=True, timeout=400, env=cli_env(), cwd=ROOT)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def test_custom_arms_and_a_two_value_sweep_make_the_scaling_report(task_model, tmp_path):
    out = tmp_path / "study"
    rc, text = _study(out, task_model)
    assert rc == 0, text[-3000:]
    assert "4 runs, 0 complete, 4 to run" in text
    for arm in ("sapo", "cispo"):
        for sub in ("0_2", "1_4"):
            assert (out / "runs" / arm / sub / "seed1" / "metrics.jsonl").is_file()
    report = (out / "report.md").read_text()
    assert "| sapo | sapo | token |" in report and "| cispo | cispo | token | 1 | 0.28 |" in report
    scaling = report.split("## Scaling")[1].split("## Mechanism")[0]
    flops = {}
    for arm in ("sapo", "cispo"):
        for value in ("2", "4"):
            row = next(r for r in scaling.splitlines() if r.startswith(f"| {arm} | {value} |"))
            flops[(arm, value)] = float(row.split("|")[5])
    # twice the samples per prompt: twice the trained tokens (prompts and answers of a tiny task)
    assert 1.5 < flops[("sapo", "4")] / flops[("sapo", "2")] < 2.5
    assert "](scaling.png)" in report and (out / "scaling.png").stat().st_size > 5000
    assert "| sapo @ rollout.group_size=4 | 1/1 |" in report

    (out / "report.md").unlink()
    rc, text = _study(out, task_model)  # resumable: nothing to run, the report rebuilt
    assert rc == 0, text[-3000:]
    assert "4 runs, 4 complete, 0 to run" in text
    report = (out / "report.md").read_bytes()
    assert b"## Scaling" in report

    # --report-only alone: the same report, from the sweep the study recorded (its run dirs)
    cmd = [sys.executable, "-m", "megatron_gspo.study", "--out", str(out), "--report-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env(), cwd=ROOT)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stdout + proc.stderr
    assert (out / "report.md").read_bytes() == report


def test_arms_come_from_the_base_configs_family(tmp_path):
    """Any arm with PREFIX_<arm>.yaml beside the base config; its row carries the loss's keys
    and reward.overlong_*; an arm without a config is a one-line error naming what exists."""
    rows = {"gspo": {"loss": "gspo"}, "sapo": {"loss": "sapo", "sapo_tau_neg": 2.0},
            "dapo": {"loss": "grpo", "agg": "token-mean", "clip_high": 0.28}}  # fmt: skip
    for name, algo in rows.items():
        raw = {"algo": algo}
        if name == "dapo":
            raw["reward"] = {"fn": "exact", "overlong_buffer": 4, "overlong_penalty": 0.5}
        (tmp_path / f"lab_moe_{name}.yaml").write_text(yaml.safe_dump(raw))
    table = algo_table(base=tmp_path / "lab_moe_gspo.yaml", arms=["sapo", "dapo"])
    assert table["sapo"] == {"loss": "sapo", "sapo_tau_neg": 2.0}
    assert table["dapo"]["reward.overlong_buffer"] == 4 and table["dapo"]["agg"] == "token-mean"
    study = build_study(BASE, tmp_path / "s", ["sapo", "dapo"], 1, [f"model.path={tmp_path}"],
                        table=table)  # fmt: skip
    dapo = next(r for r in study.runs if r.algo == "dapo")
    assert "reward.overlong_buffer=4" in dapo.overrides and study.algos["dapo"]["overlong"] == 4
    # a key the base config sets and the arm's config leaves out: the arm's default, not the base's
    from_dapo = algo_table(base=tmp_path / "lab_moe_dapo.yaml", arms=["gspo", "dapo"])
    assert from_dapo["gspo"]["agg"] is None and from_dapo["gspo"]["reward.overlong_buffer"] == 0
    assert "agg" not in table["sapo"]  # (the gspo base sets no agg: nothing to undo)
    with pytest.raises(UserError, match="choose arms among .*cispo.*sapo") as e:
        algo_table(base=tmp_path / "lab_moe_gspo.yaml", arms=["sapo", "ppo"])
    assert "\n" not in str(e.value)


def test_the_sweep_plan(tmp_path):
    sweep = parse_sweep("rollout.group_size=2,4")
    study = build_study(BASE, tmp_path, ["gspo", "grpo"], 2, [f"model.path={tmp_path}"],
                        sweep=sweep)  # fmt: skip
    assert len(study.runs) == 8 and study.sweep == sweep
    assert [r.name for r in study.runs[:4]] == [
        "gspo @ rollout.group_size=2/seed1", "grpo @ rollout.group_size=2/seed1",
        "gspo @ rollout.group_size=4/seed1", "grpo @ rollout.group_size=4/seed1"]  # fmt: skip
    first = study.runs[0]
    assert "rollout.group_size=2" in first.overrides and first.run_dir.parent.name == "0_2"
    assert first.train_config == tmp_path / "base_config.yaml"
    steps = build_study(BASE, tmp_path / "t", ["gspo"], 1, [], sweep=parse_sweep("train.steps=1,3"))
    assert [r.steps for r in steps.runs] == [1, 3] and steps.steps == 3
    (tmp_path / "a" / "small").mkdir(parents=True)
    (tmp_path / "b" / "large").mkdir(parents=True)
    values = f"{tmp_path}/a/small,{tmp_path}/b/large"
    models = build_study(BASE, tmp_path / "m", ["gspo"], 1, [],
                         sweep=parse_sweep(f"model.path={values}"))  # fmt: skip
    assert models.made_model is None and models.runs[1].run_dir.parent.name == "1_large"
    with pytest.raises(UserError, match=f"model.path {tmp_path}/b/typo does not exist"):
        build_study(BASE, tmp_path / "m", ["gspo"], 1, [],
                    sweep=parse_sweep(f"model.path={tmp_path}/a/small,{tmp_path}/b/typo"))  # fmt: skip


@pytest.mark.parametrize(
    "text, message",
    [
        ("rollout.group_size", "KEY=v1,v2"),
        ("=1,2", "KEY=v1,v2"),
        ("seed=1,2", "--seeds"),
        ("rollout.group_size=2,2", "twice"),
    ],  # fmt: skip
)
def test_bad_sweeps_are_one_line_errors(text, message):
    with pytest.raises(UserError, match=message):
        parse_sweep(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("algo.loss=gspo,grpo", "--sweep algo.loss=...: algo.loss is set by each arm (its "
                                "config's row); compare its values as arms with --algos (a "
                                "config of the family each), or set it for one arm with "
                                "ARM:algo.loss=value"),
        ("algo.routing_replay=none,r3", "--sweep algo.routing_replay=...: algo.routing_replay "
                                        "is set by each arm"),
    ],
)  # fmt: skip
def test_a_sweep_of_a_key_an_arm_sets_is_refused(tmp_path, text, message):
    """`--algos gspo,grpo --sweep algo.loss=gspo,grpo` would run "grpo @ algo.loss=gspo"."""
    with pytest.raises(UserError) as e:
        build_study(BASE, tmp_path, ["gspo", "grpo"], 1, [], sweep=parse_sweep(text))
    assert str(e.value).startswith(message)
    assert not tmp_path.joinpath("runs").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("optim.lr=1e-4,0.0001", "--sweep optim.lr: 1e-4 and 0.0001 are the same value; list "
                                 "each once"),
        ("rollout.group_size=4,2,+4", "--sweep rollout.group_size: 4 and +4 are the same "
                                       "value; list each once"),
    ],
)  # fmt: skip
def test_sweep_values_that_read_the_same_are_refused(tmp_path, text, message):
    """Duplicates are found by the values the config reads, not by how they are spelled."""
    with pytest.raises(UserError) as e:
        build_study(BASE, tmp_path, ["gspo"], 1, [], sweep=parse_sweep(text))
    assert str(e.value) == message


def test_a_sweep_value_the_config_refuses_fails_before_any_run(tmp_path):
    with pytest.raises(UserError, match="rollout.group_size"):
        build_study(BASE, tmp_path, ["gspo"], 1, [], sweep=parse_sweep("rollout.group_size=2,x"))
