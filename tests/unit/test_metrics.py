"""metrics.jsonl round trips, truncation and resume (including a real kill -9), TensorBoard events
read back with TensorBoard's own reader, and the console progress line."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_gspo.errors import UserError
from megatron_gspo.train.console import ConsoleProgress, format_duration, progress_text
from megatron_gspo.train.metrics import (
    MetricsLogger,
    clean_metrics,
    encode_line,
    read_metrics,
    truncate_metrics,
)

pytestmark = pytest.mark.unit


def step_metrics(step: int) -> dict:
    """A deterministic function of the step, as a resumed run must reproduce."""
    m = {"reward/mean": math.sin(step), "weight_version": step, "lr": 1e-6 * step}
    if step % 2 == 0:
        m["eval/reward"] = step / 10
    return m


def run_steps(run_dir: Path, steps, start_step: int = 0, total: int = 10, **kw) -> None:
    kw = {"tensorboard": False, "console": False, **kw}
    with MetricsLogger(run_dir, total_steps=total, start_step=start_step, **kw) as logger:
        for step in steps:
            logger.log(step, step_metrics(step))


def same(a, b) -> bool:
    """Equality that counts NaN equal to NaN and keeps int/float/bool/str types apart."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_rows_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w), (g, w)
        assert all(same(g[k], w[k]) for k in w), (g, w)


def test_jsonl_round_trip_non_finite_and_types(tmp_path):
    logged = [
        {"reward/mean": 0.25, "loss/policy": math.nan, "grad_norm": math.inf, "kl/old": -math.inf},
        {"reward/mean": np.float32(0.5), "weight_version": np.int64(3), "phase": "eval"},
        {"tokens_per_s": 1234, "ok": True, "entropy": None},
    ]
    with MetricsLogger(tmp_path, total_steps=3, tensorboard=False, console=False) as logger:
        for step, m in enumerate(logged, start=1):
            logger.log(step, m)
    want = [
        {"step": 1, **logged[0]},
        {"step": 2, "reward/mean": 0.5, "weight_version": 3, "phase": "eval"},
        {"step": 3, "tokens_per_s": 1234, "ok": True},  # None -> absent
    ]
    assert_rows_equal(read_metrics(tmp_path), want)
    # The file is strict JSON (no NaN / Infinity tokens): non-finite floats are named strings.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    strict = [json.loads(line, parse_constant=pytest.fail) for line in lines]
    assert strict[0]["loss/policy"] == "NaN" and strict[0]["grad_norm"] == "Infinity"
    assert strict[0]["kl/old"] == "-Infinity"


def test_absent_keys_stay_absent(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, console=False) as logger:
        logger.log(1, {"reward/mean": 0.1, "eval/reward": 0.7})
        logger.log(2, {"reward/mean": 0.2, "routing/changed_fraction": None})
    rows = read_metrics(tmp_path)
    assert rows == [
        {"step": 1, "reward/mean": 0.1, "eval/reward": 0.7},
        {"step": 2, "reward/mean": 0.2},
    ]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/reward")] == [1]
    assert "routing/changed_fraction" not in acc.Tags()["scalars"]


def test_tensorboard_values_read_back(tmp_path):
    rows = [
        {"reward/mean": 0.1 * s, "grad_norm": float(s) ** 0.5, "weight_version": s}
        for s in range(1, 6)
    ]
    rows[2]["grad_norm"] = math.nan
    rows[3]["phase"] = "text is not a scalar"
    with MetricsLogger(tmp_path, total_steps=5, console=False) as logger:
        for step, m in enumerate(rows, start=1):
            logger.log(step, m)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["grad_norm", "reward/mean", "weight_version"]
    for key in ("reward/mean", "grad_norm", "weight_version"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3, 4, 5]
        # TensorBoard stores simple_value as float32.
        want = np.array([r[key] for r in rows], dtype=np.float32)
        np.testing.assert_array_equal(np.array([e.value for e in events], np.float32), want)


def test_truncate_drops_later_steps_and_a_torn_line(tmp_path):
    run_steps(tmp_path, range(1, 6))
    path = tmp_path / "metrics.jsonl"
    full = path.read_text()
    path.write_text(full + '{"step": 6, "reward/me')  # a write cut by a kill
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    truncate_metrics(tmp_path, 3)
    assert path.read_text() == "".join(full.splitlines(keepends=True)[:3])
    truncate_metrics(tmp_path, 10)  # nothing later: unchanged
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_corrupt_middle_line_is_an_error(tmp_path):
    run_steps(tmp_path, range(1, 4))
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(UserError, match=r"metrics.jsonl:2 "):
        read_metrics(tmp_path)


def test_resume_after_torn_line_equals_uninterrupted_run(tmp_path):
    run_steps(tmp_path / "ref", range(1, 11))
    run_steps(tmp_path / "a", range(1, 8))
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "rew')
    run_steps(tmp_path / "a", range(6, 11), start_step=5)  # checkpoint at step 5
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (
        tmp_path / "ref" / "metrics.jsonl"
    ).read_bytes()


@pytest.mark.parametrize(
    ("resumed_at", "said"),
    [
        (3, "; step 4 is trained again from step 3, its line written anew"),
        (4, "; its metrics are lost: the run resumes after step 4, so step 4 is not trained again"),
    ],
)
def test_a_cut_line_is_named_with_its_step_and_whether_that_step_is_trained_again(
    tmp_path, capsys, resumed_at, said
):
    """The line of a step cut mid-line (a kill, a disk that filled up) used to be dropped
    silently: a resume from that step's checkpoint left a hole in the record, unsaid."""
    run_steps(tmp_path, range(1, 4))
    path = tmp_path / "metrics.jsonl"
    complete = path.read_text()
    line = encode_line(clean_metrics(4, step_metrics(4)))
    path.write_text(complete + line[: len(line) // 2])
    run_steps(tmp_path, range(resumed_at + 1, 6), start_step=resumed_at)
    out = capsys.readouterr().out
    head = f"{path}: the line of step 4 was cut short (its write was interrupted) and is dropped"
    assert out == head + said + "\n"
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == ([1, 2, 3, 4, 5] if resumed_at == 3 else [1, 2, 3, 5])
    assert path.read_text().startswith(complete)


def test_a_cut_line_whose_step_does_not_show_is_said_and_a_whole_one_kept(tmp_path, capsys):
    run_steps(tmp_path, range(1, 3))
    path = tmp_path / "metrics.jsonl"
    complete = path.read_text()
    path.write_text(complete + '{"step": 3')  # (the 3 could be the start of 30)
    assert truncate_metrics(tmp_path, 2) == (
        f"{path}: its last line was cut short (its step unreadable) and is dropped"
    )
    assert path.read_text() == complete
    # a write cut after its JSON, before its newline: a whole row, kept (and given its newline)
    path.write_text(complete + encode_line(clean_metrics(3, step_metrics(3))).rstrip("\n"))
    assert truncate_metrics(tmp_path, 3) is None
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert capsys.readouterr().out == ""
    assert path.read_text().endswith("}\n")


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.unit.test_metrics import step_metrics
    from megatron_gspo.train.metrics import MetricsLogger

    logger = MetricsLogger(Path(sys.argv[1]), total_steps=10**6, tensorboard=True, console=False)
    step = 0
    while True:
        step += 1
        logger.log(step, step_metrics(step))
        time.sleep(0.002)
    """
)


def test_kill_9_then_resume_equals_uninterrupted_run(tmp_path):
    run_dir = tmp_path / "killed"
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir)], cwd=root, env=env)
    try:
        deadline = time.monotonic() + 30
        path = run_dir / "metrics.jsonl"
        while not (path.is_file() and path.read_text().count("\n") >= 25):
            assert child.poll() is None and time.monotonic() < deadline, "child did not log"
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 25
    ckpt, total = 20, len(steps) + 5
    time.sleep(1 - time.time() % 1)  # a new second: TensorBoard orders event files by name
    run_steps(run_dir, range(ckpt + 1, total + 1), start_step=ckpt, total=total, tensorboard=True)
    run_steps(tmp_path / "ref", range(1, total + 1), total=total)
    assert path.read_bytes() == (tmp_path / "ref" / "metrics.jsonl").read_bytes()
    # TensorBoard drops the killed run's steps after the checkpoint (SessionLog.START on resume).
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("weight_version")] == list(range(1, total + 1))
    assert [e.value for e in acc.Scalars("weight_version")] == list(range(1, total + 1))


def test_tensorboard_resume_replaces_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5, console=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": float(step)})
    time.sleep(1 - time.time() % 1)  # a new second: TensorBoard orders event files by name
    with MetricsLogger(tmp_path, total_steps=5, start_step=3, console=False) as logger:
        for step in (4, 5):
            logger.log(step, {"x": 100.0 * step})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 400.0),
        (5, 500.0),
    ]


def test_progress_text_and_durations():
    assert format_duration(45.4) == "45s"
    assert format_duration(80) == "1m20s"
    assert format_duration(2 * 3600 + 3 * 60 + 10) == "2h03m"
    assert progress_text(12, 40, 0.4123, 0.5, 2.5) == (
        "step 12/40 | reward 0.41 | eval 0.50 | 2.5 s/step | ETA 1m10s"  # 28 steps x 2.5 s
    )
    assert progress_text(1, 40, None, None, None) == "step 1/40"


def test_console_progress_rate_excludes_start_up():
    ticks = iter([-5.0, 0.0, 10.0, 12.0, 14.5])  # init, the end of step 0 (eval), steps 1, 2, 3
    progress = ConsoleProgress(total_steps=40, clock=lambda: next(ticks))
    texts = [progress.text({"step": s, **step_metrics(s)}) for s in (0, 1, 2, 3)]
    assert texts == [
        "step 0/40 | reward 0.00 | eval 0.00",  # no training step yet: no rate
        f"step 1/40 | reward {math.sin(1):.2f} | eval 0.00 | 10.0 s/step | ETA 6m30s",  # 39 x 10
        f"step 2/40 | reward {math.sin(2):.2f} | eval 0.20 | 2.0 s/step | ETA 1m16s",  # 38 x 2
        f"step 3/40 | reward {math.sin(3):.2f} | eval 0.20 | 2.2 s/step | ETA 1m23s",  # 37 x 2.25
    ]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_console_lines(tmp_path, monkeypatch, tty):
    err = FakeTTY() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    run_steps(tmp_path, range(1, 4), total=3, console=True)
    out = err.getvalue()
    if tty:
        assert out.count("\r") == 3 and out.endswith("\n") and out.count("\n") == 1
        frames = out.rstrip("\n").split("\r")[1:]
    else:
        assert "\r" not in out
        frames = out.splitlines()
    assert [f.split(" | ")[0] for f in frames] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "eval 0.20" in frames[2] and frames[2].strip().endswith("ETA 0s")


def _eval_shown(err: io.StringIO) -> dict[int, str | None]:
    """Each progress line's step and its eval part (None: none shown)."""
    shown = {}
    for line in err.getvalue().splitlines():
        parts = line.split(" | ")
        step = int(parts[0].removeprefix("step ").split("/")[0])
        shown[step] = next((p for p in parts if p.startswith("eval ")), None)
    return shown


def test_a_resumed_runs_progress_line_shows_the_last_eval_from_before(tmp_path, monkeypatch):
    """An uninterrupted run shows the newest eval on every line; a resumed run showed none until
    its own next eval. Now it shows the last one metrics.jsonl kept up to its checkpoint (step
    4's, not step 6's: the killed run's steps after the checkpoint are dropped)."""
    whole, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", whole)
    run_steps(tmp_path / "whole", range(1, 8), total=7, console=True)
    run_steps(tmp_path / "cut", range(1, 7), total=7)  # killed after step 6, checkpoint at 4
    monkeypatch.setattr(sys, "stderr", err)
    run_steps(tmp_path / "cut", range(5, 8), start_step=4, total=7, console=True)
    assert _eval_shown(err) == {5: "eval 0.40", 6: "eval 0.60", 7: "eval 0.60"}
    assert _eval_shown(err) == {k: v for k, v in _eval_shown(whole).items() if k >= 5}


def test_a_resumed_run_with_no_eval_kept_shows_none(tmp_path, monkeypatch):
    """No eval up to the checkpoint (step 1 has none), or no metrics.jsonl at all: no eval shown
    until the run's own."""
    run_steps(tmp_path / "a", [1], total=3)
    run_steps(tmp_path / "b", [1, 2], total=3)  # (step 2's eval 0.20, its file then lost)
    (tmp_path / "b" / "metrics.jsonl").unlink()
    for run, start in ((tmp_path / "a", 1), (tmp_path / "b", 2)):
        monkeypatch.setattr(sys, "stderr", err := io.StringIO())
        run_steps(run, [3], start_step=start, total=3, console=True)
        assert _eval_shown(err) == {3: None}


def test_step_order(tmp_path):
    kw = {"total_steps": 5, "tensorboard": False, "console": False}
    with MetricsLogger(tmp_path, **kw) as logger:
        logger.log(0, {"eval/reward": 0.5})  # a fresh run may log step 0
        logger.log(1, {"a": 1.0})
        logger.log(3, {"a": 3.0})
        with pytest.raises(ValueError, match="step 2 logged after step 3"):
            logger.log(2, {"a": 2.0})
    with MetricsLogger(tmp_path, start_step=1, **kw) as logger:
        with pytest.raises(ValueError, match="steps must increase"):
            logger.log(1, {"a": 1.0})  # the checkpoint's step is already in the file
        logger.log(2, {"a": 2.0})
    assert read_metrics(tmp_path) == [
        {"step": 0, "eval/reward": 0.5},
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 2.0},
    ]


def test_bad_calls(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5, tensorboard=False, console=False) as logger:
        logger.log(2, {"a": 1.0})
        with pytest.raises(ValueError, match="steps must increase"):
            logger.log(2, {"a": 1.0})
        with pytest.raises(ValueError, match="would read back as a float"):
            logger.log(3, {"note": "NaN"})
        with pytest.raises(TypeError, match="'a'"):
            logger.log(3, {"a": [1, 2]})
    assert [r["step"] for r in read_metrics(tmp_path)] == [2]
    with pytest.raises(UserError, match="raise train.steps"):
        MetricsLogger(tmp_path, total_steps=5, start_step=6)


def test_wandb_missing_is_a_user_error_and_touches_nothing(tmp_path, monkeypatch):
    run_steps(tmp_path, range(1, 4))
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError, match=r"pip install megatron-gspo\[wandb\]"):
        MetricsLogger(tmp_path, total_steps=5, wandb={"project": "p", "mode": "offline"})
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_train_with_wandb_missing_makes_no_run_directory(
    tmp_path, tiny_models, monkeypatch, capsys
):
    """`train logging.wandb=...` without wandb was refused only when the logger opened, after
    the run directory was made with config.yaml and logs/ in it: now before anything is made."""
    from megatron_gspo import cli

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (find_spec: None)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe_gspo.yaml"
    run = tmp_path / "run"
    argv = ["train", "--config", str(config), "--run-dir", str(run),
            f"model.path={tiny_models['moe']}", "logging.wandb={project: x}"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1:] == [
        "error: logging.wandb is set but wandb is not installed: pip install megatron-gspo[wandb]"
    ], err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_read_metrics_names_a_missing_file(tmp_path):
    with pytest.raises(UserError, match=str(tmp_path / "nope")):
        read_metrics(tmp_path / "nope")


@pytest.mark.parametrize("tensorboard", [True, False])
def test_a_run_directory_deleted_while_training_is_one_line(tmp_path, monkeypatch, tensorboard):
    """rm -rf RUN_DIR mid-run: the next step's log is a UserError naming the directory (not
    TensorBoard's FileNotFoundError, nor its writer thread's own traceback; not, without
    TensorBoard, lines going on into the deleted metrics.jsonl), and closing says nothing."""
    import shutil
    import threading

    thread_errors: list = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, total_steps=5, tensorboard=tensorboard, console=False)
    logger.log(1, step_metrics(1))
    shutil.rmtree(run_dir)
    with pytest.raises(UserError) as e:
        logger.log(2, step_metrics(2))
    assert str(e.value) == (
        f"the run directory {run_dir} disappeared while training (its checkpoints with it); "
        "start the run again"
    )
    logger.close()
    assert thread_errors == [] and not run_dir.exists()


def test_a_sink_that_cannot_write_names_the_run_directory(tmp_path, monkeypatch):
    """Only tensorboard/ gone (the run directory still there): the one line says which file and
    the run directory; TensorBoard's thread prints nothing of its own."""
    import shutil
    import threading

    thread_errors: list = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    logger = MetricsLogger(tmp_path, total_steps=5, tensorboard=True, console=False)
    logger.log(1, step_metrics(1))
    shutil.rmtree(tmp_path / "tensorboard")
    with pytest.raises(UserError) as e:
        logger.log(2, step_metrics(2))
    msg = str(e.value)
    assert msg.startswith(f"cannot write the metrics in {tmp_path}: [Errno 2] No such file")
    assert str(tmp_path / "tensorboard") in msg and "\n" not in msg
    logger.close()
    assert thread_errors == []
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # jsonl went first
