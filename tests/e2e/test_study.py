"""`megatron-gspo study` end to end on a tiny setting (2 algorithms x 1 seed x 3 steps): killed
mid-study with kill -9, continued by the same command (the finished run skipped, the interrupted
one resumed from its checkpoint), report.md with both algorithms, the figures; plus the plan's
rules (algorithm table from the configs, overrides, bad input) and collapse detection."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_gspo.errors import UserError
from megatron_gspo.study.analysis import collapse_events
from megatron_gspo.study.figures import CAPTIONS
from megatron_gspo.study.plan import algo_table, build_study
from megatron_gspo.study.record import check_manifest
from tests.helpers import StepGate, cli_env

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "tiny_moe_gspo.yaml"
QUICK = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.micro_batch_size=4",
    "train.eval_prompts=8",
    "train.eval_every=1",
    "train.checkpoint_every=2",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    """A random tiny MoE: the study's mechanics do not need a competent model (and making the
    task model would take most of this file's time budget)."""
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(seed=0), tmp_path_factory.mktemp("task") / "model")


def study_cmd(out: Path, model: Path, *extra: str) -> list[str]:
    args = ["--config", str(BASE), "--algos", "gspo,grpo", "--seeds", "1", "--steps", "3"]
    return [sys.executable, "-m", "megatron_gspo.study", *args, "--out", str(out),
            f"model.path={model}", *QUICK, *extra]  # fmt: skip


def run_study(out: Path, model: Path, *extra: str) -> tuple[int, str]:
    proc = subprocess.run(study_cmd(out, model, *extra), capture_output=True, text=True,
                          timeout=300, env=cli_env(), cwd=ROOT)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def test_study_killed_then_resumed_then_skipped(task_model, tmp_path):
    out = tmp_path / "study"
    second = out / "runs" / "grpo" / "seed1"
    gate = StepGate(tmp_path / "gate", second, after=2)  # holds grpo/seed1 inside step 3
    gated = [f"grpo:{gate.override}"]
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(study_cmd(out, task_model, *gated), stdout=log,
                            stderr=subprocess.STDOUT, env=cli_env(), cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while not gate.holding:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "timed out waiting for the second run's step 3"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the study and its train run, no clean-up
    proc.wait(timeout=60)
    gate.open()
    first = out / "runs" / "gspo" / "seed1" / "metrics.jsonl"
    done_before = first.read_bytes()

    rc, text = run_study(out, task_model, *gated)
    assert rc == 0, text[-3000:]
    assert "2 runs, 1 complete, 1 to run" in text
    assert "grpo/seed1: resume from step 2" in text
    assert first.read_bytes() == done_before  # the finished run was not run again
    steps = [
        json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3]

    report = (out / "report.md").read_text()
    summary = report.split("## Summary")[1].split("## Findings")[0]
    assert "| gspo | 1/1 |" in summary and "| grpo | 1/1 |" in summary
    assert "| gspo | gspo | sequence |" in report and "| grpo | grpo | token |" in report
    assert "## Findings" in report and "## Collapse events" in report
    for name in CAPTIONS:
        assert (out / name).stat().st_size > 5000, name
        assert f"]({name})" in report

    rc, text = run_study(out, task_model, *gated)
    assert rc == 0, text[-3000:]
    assert "2 runs, 2 complete, 0 to run" in text
    assert first.read_bytes() == done_before
    check_report_only(out)


def report_only(out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_gspo", "study", *flags, "--out", str(out),
           "--report-only"]  # fmt: skip
    env = cli_env() | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def check_report_only(out: Path) -> None:
    """--report-only rewrites the report of the study DIR/study.json records, whatever study
    flags it is given: it used to plan the study from them, so a command without the study's
    --steps was refused ("delete that run directory to redo it"), and one without its --algos
    recorded the default arms' runs in study.json and reported them, never run."""
    report, record = (out / "report.md").read_bytes(), (out / "study.json").read_bytes()
    quiet = [(), ("--config", str(BASE)), ("--config", str(BASE), "--steps", "3")]
    for flags in quiet:  # the study's own flags, or none: no note
        proc = report_only(out, *flags)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stdout + proc.stderr
        assert proc.stdout == f"wrote {out / 'report.md'}\n"
        assert (out / "report.md").read_bytes() == report
        assert (out / "study.json").read_bytes() == record
    proc = report_only(out, "--config", str(BASE), "--algos", "gspo", "--steps", "5", "x.y=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"note: --report-only reports the study recorded in {out / 'study.json'}; ignoring "
        "what differs from it: --algos, --steps, the overrides"
    ]
    assert (out / "report.md").read_bytes() == report
    assert (out / "study.json").read_bytes() == record


def test_a_run_without_a_checkpoint_is_left_to_the_trainer_not_deleted(tmp_path, capsys):
    """A run directory holding no step_N used to be deleted whole before its run started
    again: a checkpoint set aside in checkpoints/unverified/, the disk sync's weights with it.
    The trainer's start moves what an attempt left aside instead (train/run_dir.py)."""
    from megatron_gspo.study.plan import RunSpec, Study
    from megatron_gspo.study.runner import execute
    from megatron_gspo.train import checkpointing
    from tests.helpers import saved_checkpoint

    run_dir = tmp_path / "study" / "runs" / "gspo" / "seed1"
    checkpointing.set_aside(run_dir, [saved_checkpoint(run_dir, 2)])
    kept = run_dir / "checkpoints" / "unverified" / "step_2"
    files = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    run = RunSpec("gspo", 1, run_dir, ())
    study = Study(BASE, tmp_path / "study", {"gspo": {}}, [1], 3, 1, runs=[run])
    assert execute(study) == [run]  # (no base_config.yaml in the study: the train fails)
    assert "gspo/seed1: start" in capsys.readouterr().out
    assert {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("damage", [None, "truncated", "state file lost"])
def test_a_run_whose_last_checkpoint_does_not_verify_is_resumed_not_skipped(
    tmp_path, capsys, damage
):
    """A run was taken as complete from its newest step_N's name: a last checkpoint damaged since
    (a truncated file, its state file lost) had the run skipped for good. It is complete only when
    that checkpoint verifies; else it goes to the trainer's --resume, which sets it aside."""
    from megatron_gspo.study.plan import RunSpec, Study
    from megatron_gspo.study.runner import execute, log_path
    from tests.helpers import saved_checkpoint

    run_dir = tmp_path / "study" / "runs" / "gspo" / "seed1"
    ckpt = saved_checkpoint(run_dir, 3)
    if damage == "truncated":
        shard = ckpt / "model" / "shard.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "state file lost":
        (ckpt / "trainer_state.json").unlink()
    run = RunSpec("gspo", 1, run_dir, ())
    study = Study(BASE, tmp_path / "study", {"gspo": {}}, [1], 3, 1, runs=[run])
    failed = execute(study)  # (no base_config.yaml in the study: a train fails)
    out = capsys.readouterr().out
    if damage is None:
        assert (failed, out) == ([], "study: 1 runs, 1 complete, 0 to run\n")
        return
    assert failed == [run] and "study: 1 runs, 0 complete, 1 to run" in out
    why = {"truncated": "model/shard.distcp is 100 bytes, the manifest says 4096",
           "state file lost": "trainer_state.json is missing"}[damage]  # fmt: skip
    assert (f"gspo/seed1: resume: its newest checkpoint, step_3, does not verify ({why}); "
            "--resume moves it to checkpoints/unverified/") in out  # fmt: skip
    command = log_path(study, run).read_text().splitlines()[1]
    assert " train --config " in command and " --resume" in command, command


def test_algo_table_reads_the_configs(tmp_path):
    table = algo_table()
    for name, row in table.items():
        algo = yaml.safe_load((ROOT / "configs" / f"tiny_moe_{name}.yaml").read_text())["algo"]
        assert row == {k: algo[k] for k in row}
        assert {"loss", "clip_low", "clip_high", "routing_replay"} <= set(row)
    assert [table[a]["routing_replay"] for a in ("grpo", "grpo_r2", "grpo_r3")] == [
        "none", "r2", "r3",
    ]  # fmt: skip
    study = build_study(BASE, tmp_path, ["gspo", "grpo_r2"], 2,
                        ["gspo:algo.clip_high=0.5", "optim.lr=0.002"], steps=3)  # fmt: skip
    assert study.seeds == [1, 2] and study.steps == 3
    assert [r.name for r in study.runs] == ["gspo/seed1", "grpo_r2/seed1", "gspo/seed2",
                                            "grpo_r2/seed2"]  # fmt: skip
    assert study.algos["gspo"]["clip_high"] == 0.5
    assert study.algos["grpo_r2"]["clip_high"] == table["grpo_r2"]["clip_high"]
    assert study.algos["grpo_r2"]["routing_replay"] == "r2"
    assert all(r.overrides[-1].startswith(("seed=", "model.path=")) for r in study.runs)
    assert all("optim.lr=0.002" in r.overrides for r in study.runs)


def test_algo_table_reads_the_base_configs_family(tmp_path):
    """A base config PREFIX_<algo>.yaml with every sibling beside it: the table is theirs; a
    family with a member missing falls back to the tiny configs."""
    for name, clip in (("gspo", 0.01), ("grpo", 0.3), ("grpo_r2", 0.31), ("grpo_r3", 0.32)):
        algo = {"loss": "gspo" if name == "gspo" else "grpo", "clip_low": clip, "clip_high": clip}
        algo["routing_replay"] = {"grpo_r2": "r2", "grpo_r3": "r3"}.get(name, "none")
        (tmp_path / f"deep_{name}.yaml").write_text(yaml.safe_dump({"algo": algo}))
    table = algo_table(base=tmp_path / "deep_grpo_r3.yaml")
    assert [table[a]["clip_low"] for a in ("gspo", "grpo", "grpo_r2", "grpo_r3")] == [
        0.01, 0.3, 0.31, 0.32,
    ]  # fmt: skip
    assert table["grpo_r2"]["routing_replay"] == "r2"
    (tmp_path / "deep_grpo.yaml").unlink()
    assert algo_table(base=tmp_path / "deep_gspo.yaml") == algo_table()


def test_the_drift_study_reads_its_family_and_makes_its_model_with_the_preset(
    tmp_path, monkeypatch
):
    """configs/drift_moe_gspo.yaml: the drift configs' algo rows, and, with the config's own
    model.path (runs/drift_model) missing, DIR/model made by make-task-model with the drift
    preset (the shape sortlong is tuned for)."""
    from megatron_gspo.data.warmstart import PRESETS
    from megatron_gspo.study.plan import task_of
    from megatron_gspo.study.runner import preset_for

    base = ROOT / "configs" / "drift_moe_gspo.yaml"
    table = algo_table(base=base)
    for name, row in table.items():
        algo = yaml.safe_load((ROOT / "configs" / f"drift_moe_{name}.yaml").read_text())["algo"]
        assert row == {k: algo[k] for k in row}
    monkeypatch.chdir(tmp_path)  # (runs/drift_model, relative, is missing here)
    study = build_study(base, tmp_path / "study", list(table), 1, [], table=table)
    made = (tmp_path / "study" / "model").resolve()
    assert study.made_model == made
    assert all(r.overrides[-1] == f"model.path={made}" for r in study.runs)
    task = task_of(base, study.common)
    assert task == "sortlong" and PRESETS["drift"]["task"] == task
    assert preset_for(task) == ["--preset", "drift"] and preset_for("arith") == []


def test_a_missing_model_path_given_on_the_command_line_is_one_line_error(tmp_path):
    """The study makes a model only where the base config's own model.path is missing: one given
    on the command line that does not exist (a typo of a real path) is not replaced by a tiny
    task model; it is one line naming the path and the command that makes one, nothing made."""
    missing = tmp_path / "no_model"
    cmd = [sys.executable, "-m", "megatron_gspo", "study", "--config", str(BASE), "--algos",
           "gspo", "--seeds", "1", "--steps", "1", "--out", str(tmp_path / "S"),
           f"model.path={missing}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: model.path {missing} does not exist: point model.path at an HF or Megatron "
        f"checkpoint, or make arith's starting model there: megatron-gspo make-task-model "
        f"--task arith --out {missing}"
    ]
    assert "starting model" not in proc.stdout and not (tmp_path / "S").exists()
    with pytest.raises(UserError, match=f"model.path {missing} does not exist"):
        build_study(BASE, tmp_path / "S", ["gspo", "grpo"], 1, [f"grpo:model.path={missing}"])


def test_a_file_as_model_path_is_refused_before_any_run(tmp_path):
    """model.path=README.md in a study: the plan refuses it as a file (the runs would each fail
    on it), nothing made."""
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    with pytest.raises(UserError, match=f"model.path {readme} is a file, not a model directory"):
        build_study(BASE, tmp_path / "S", ["gspo"], 1, [f"model.path={readme}"])
    assert not (tmp_path / "S").exists()


@pytest.mark.parametrize("made", [None, "unrecorded", "recorded", "old record"])
def test_report_only_without_a_study_is_one_line_and_writes_nothing(tmp_path, made):
    """--report-only where no study ran (no DIR; a DIR without study.json; a study recorded,
    none of whose runs has logged a step) or whose record predates the study's own entry: one
    line naming the fix, exit 2, and nothing made or changed (no report.md, figures, study.json)."""
    out = tmp_path / "nostudy"
    if made is not None:
        (out / "runs" / "gspo" / "seed1").mkdir(parents=True)  # started, killed before a step
        (out / "runs" / "gspo" / "seed1" / "metrics.jsonl").write_text("")
    if made in ("recorded", "old record"):
        check_manifest(build_study(BASE, out, ["gspo", "grpo", "grpo_r2", "grpo_r3"], 1, []))
    if made == "old record":
        record = json.loads((out / "study.json").read_text())
        (out / "study.json").write_text(json.dumps({k: record[k] for k in ("config", "runs")}))
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    proc = report_only(out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = {
        None: f"no study in {out}: run it without --report-only",
        "unrecorded": f"no study in {out} (no study.json): run it without --report-only",
        "recorded": f"no study in {out} (none of its 4 run(s) has logged a step): run it "
        "without --report-only",
        "old record": f"{out / 'study.json'} predates the record --report-only reads; run the "
        "study once without --report-only to record it (its finished runs are skipped)",
    }[made]
    assert proc.stderr.strip().splitlines() == [f"error: {error}"]
    assert proc.stdout == ""
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_a_study_runs_only_from_a_config(tmp_path):
    """--config is optional for --report-only alone: a study to run without it is one line."""
    cmd = [sys.executable, "-m", "megatron_gspo", "study", "--out", str(tmp_path / "s")]
    env = cli_env() | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: --config is missing: name the base config the study runs from"
    ]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("broken", ["base", "arm"])
def test_a_config_that_is_not_yaml_is_one_line_naming_where(tmp_path, broken):
    """A base config or an arm's config of its family that YAML cannot parse used to end the
    study with a yaml ParserError traceback (the arm's read before the base was checked)."""
    for name in ("gspo", "grpo"):
        text = (ROOT / "configs" / f"tiny_moe_{name}.yaml").read_text()
        (tmp_path / f"lab_{name}.yaml").write_text(text)
    bad = tmp_path / ("lab_gspo.yaml" if broken == "base" else "lab_grpo.yaml")
    bad.write_text(bad.read_text() + "algo:\n  clip_low: [0.1\n")
    lines = len(bad.read_text().splitlines())
    base = str(tmp_path / "lab_gspo.yaml")
    cmd = [sys.executable, "-m", "megatron_gspo", "study", "--config", base, "--algos",
           "gspo,grpo", "--out", str(tmp_path / "S")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {bad}, line {lines + 1}, column 1: not valid YAML: expected ',' or ']', but got "
        f"'<stream end>' (while parsing a flow sequence that starts at line {lines}, column 13); "
        "close the list with ] (quote an item that holds , [ ] or :)"
    ]
    assert not (tmp_path / "S").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.loss=grpo"], "override 'algo.loss=grpo': algo.loss is set by each arm (its "
                             "config's row); set it for one arm with ARM:algo.loss=value, or "
                             "choose the arms with --algos"),
        (["algo.clip_high=0.5"], "override 'algo.clip_high=0.5': algo.clip_high is set by each "
                                 "arm"),
        (["algo={loss: grpo}"], "override 'algo={loss: grpo}': algo.clip_high is set by each "
                                "arm"),
    ],
)  # fmt: skip
def test_an_override_of_a_key_an_arm_sets_is_refused(tmp_path, overrides, message):
    """A "gspo" arm that runs GRPO because an override for every run set its loss: refused, the
    per-arm spelling named; a key no arm sets (algo.tis here) and ARM:key=value still run."""
    with pytest.raises(UserError) as e:
        build_study(BASE, tmp_path, ["gspo", "grpo"], 1, overrides)
    assert str(e.value).startswith(message)
    study = build_study(BASE, tmp_path, ["gspo", "grpo"], 1,
                        ["algo.tis_reduce=mean", "grpo:algo.clip_high=0.5"])  # fmt: skip
    assert study.algos["gspo"]["loss"] == "gspo" and study.algos["grpo"]["clip_high"] == 0.5


def test_unknown_algorithm_is_a_user_error():
    from megatron_gspo.study.plan import parse_algos

    with pytest.raises(UserError, match="choose a comma-separated list of gspo, grpo"):
        parse_algos("gspo,dapo", algo_table())


def test_an_arm_without_a_config_is_told_the_arms_not_the_other_configs(tmp_path):
    """The arms a study offers are the configs that differ from their family only in an arm's
    row: configs/tiny_moe_gspo_lora.yaml (LoRA) and tiny_moe_calc_tool_*.yaml (another task) are
    configs of their own. (The error used to offer calc_tool_gspo, gspo_lora, ... as arms.)"""
    for base in ("tiny_moe_gspo", "tiny_moe_calc_tool_gspo", "drift_moe_gspo"):
        with pytest.raises(UserError) as e:
            algo_table(base=ROOT / "configs" / f"{base}.yaml", arms=["bogus"])
        assert str(e.value).endswith("choose arms among cispo, grpo, grpo_r2, grpo_r3, gspo, sapo")
    # a family of its own beside the base: its arms join; a sibling that sets LoRA does not
    arms = {"gspo": {"algo": {"loss": "gspo"}},
            "dapo": {"algo": {"loss": "grpo", "agg": "token-mean"},
                     "reward": {"fn": "exact", "overlong_buffer": 4}},
            "gspo_lora": {"algo": {"loss": "gspo"}, "lora": {"rank": 4}}}  # fmt: skip
    for name, raw in arms.items():
        (tmp_path / f"lab_{name}.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError) as e:
        algo_table(base=tmp_path / "lab_gspo.yaml", arms=["bogus"])
    assert str(e.value).endswith("among cispo, dapo, grpo, grpo_r2, grpo_r3, gspo, sapo")
    assert algo_table(base=tmp_path / "lab_gspo.yaml", arms=["dapo"])["dapo"]["agg"] == "token-mean"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["grpo:algo.clip_low=0.1"], "not in --algos"),
        (["seed=3"], "use --seeds"),
        (["algo.clip_hihg=0.3"], "did you mean 'algo.clip_high'"),
    ],
)
def test_bad_override_is_a_user_error(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        build_study(BASE, tmp_path, ["gspo"], 1, overrides)


def test_changed_settings_are_refused_for_a_started_run(tmp_path):
    check_manifest(build_study(BASE, tmp_path, ["gspo"], 1, []))
    assert (tmp_path / "base_config.yaml").read_bytes() == BASE.read_bytes()  # what runs read
    (tmp_path / "runs" / "gspo" / "seed1").mkdir(parents=True)
    changed = build_study(BASE, tmp_path, ["gspo"], 1, ["optim.lr=0.5"])
    with pytest.raises(UserError, match="optim.lr=0.5"):
        check_manifest(changed)
    check_manifest(build_study(BASE, tmp_path, ["gspo", "grpo"], 1, []))  # adding is fine


def test_collapse_events():
    rows = [
        {"step": 0, "eval/reward": 0.5},
        {"step": 1, "loss/policy": 0.1, "grad_norm": 1.0},
        {"step": 2, "eval/reward": 0.8},
        {"step": 3, "eval/reward": 0.55},  # 0.25 below the best: a fall
        {"step": 4, "eval/reward": 0.5},  # still down: the same fall
        {"step": 5, "eval/reward": 0.7, "loss/policy": math.nan},  # back within; NaN loss
        {"step": 6, "grad_norm": math.inf},  # the same non-finite stretch
        {"step": 7, "grad_norm": 1.0, "eval/reward": 0.59},  # a second fall (0.21 below)
    ]
    got = [(e.step, e.kind) for e in collapse_events(rows, margin=0.2)]
    assert got == [(3, "eval drop"), (5, "non-finite"), (7, "eval drop")]
    assert collapse_events(rows, margin=0.3) == [e for e in collapse_events(rows, 0.2)
                                                 if e.kind == "non-finite"]  # fmt: skip
