"""README's main command, `bash scripts/quickstart.sh CONFIG`, run as a user runs it, three times.

The script works in the directory it lives in (it makes the config's model at runs/task_model
there), so it runs from a scratch copy: scripts/ and configs/ copied, .venv linked to this
checkout's, PYTHONPATH set to this checkout (so it runs this code). The config is the shipped
GSPO config made quick (2 steps, the tests' small batches), as a user passes another config as
$1. Run again, the script continues the run (README); a second run used to fail on its own
report ("--out ... exists"), and a run already finished started its servers before it said so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import QUICK_TRAIN, StepGate, cli_env

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
# A fault for one run: its `megatron-gspo report` fails before writing anything.
FAIL_REPORT = """import sys
if sys.argv[1:2] == ["report"]:
    sys.exit("error: the report fails (injected)")
"""


def scratch_copy(root: Path, steps: int) -> Path:
    """A copy of the repository the script can run in; the config it gets: configs/quick.yaml."""
    for part in ("scripts", "configs"):
        shutil.copytree(ROOT / part, root / part)
    (root / ".venv").symlink_to((ROOT / ".venv").resolve())
    set_steps(root, steps)
    return root


def set_steps(root: Path, steps: int) -> None:
    """configs/quick.yaml: configs/tiny_moe_gspo.yaml with QUICK_TRAIN and `steps` steps."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny_moe_gspo.yaml").read_text())
    for item in [*QUICK_TRAIN, f"train.steps={steps}"]:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        cfg[section][name] = yaml.safe_load(value)
    (root / "configs" / "quick.yaml").write_text(yaml.safe_dump(cfg))


def quickstart(
    root: Path, fault: Path | None = None, args: tuple[str, ...] = ("configs/quick.yaml",)
) -> tuple[int, str]:
    proc = run_quickstart(root, args, fault)
    return proc.returncode, proc.stdout + proc.stderr


def run_quickstart(
    root: Path, args: tuple[str, ...], fault: Path | None = None
) -> subprocess.CompletedProcess:
    env = cli_env()
    path = [str(p) for p in (fault, ROOT) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(["bash", "scripts/quickstart.sh", *args], cwd=root,
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip


def steps_logged(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows]


def test_quickstart_run_again_continues_the_run_and_writes_its_report_again(tmp_path):
    root = scratch_copy(tmp_path / "repo", steps=2)
    run, report = root / "runs" / "quick", root / "runs" / "quick" / "report.png"
    rc, out = quickstart(root)
    assert rc == 0, out[-3000:]
    assert (root / "runs" / "task_model").is_dir()  # made by the script, where it said
    assert steps_logged(run) == [0, 1, 2] and "wrote runs/quick/report.png" in out
    first = report.read_bytes()

    # The user raises train.steps (an override after the config, as the line of a finished run
    # says) and runs it again: step 3 is trained; its report fails here (an injected fault), and
    # the old report stays as it was, nothing half-written beside it.
    more = ("configs/quick.yaml", "train.steps=3")
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAIL_REPORT)
    rc, out = quickstart(root, fault, more)
    assert rc != 0 and "the report fails (injected)" in out, out[-3000:]
    assert steps_logged(run) == [0, 1, 2, 3]
    assert report.read_bytes() == first and sorted(p.name for p in run.glob("report*")) == [
        "report.png"
    ]

    # Once more: the run is finished (it says so, before it starts a server: the server's log,
    # which each start appends to, is as it was), and the report is written again, with step 3.
    before, server_log = report.stat(), (run / "logs" / "server-0.log").read_bytes()
    rc, out = quickstart(root, args=more)
    assert rc == 0, out[-3000:]
    assert "runs/quick is at step 3 of 3 (train.steps): nothing to train" in out
    assert (run / "logs" / "server-0.log").read_bytes() == server_log
    assert steps_logged(run) == [0, 1, 2, 3]
    after = report.stat()
    assert (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)
    assert report.read_bytes() != first and report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "greedy eval reward: step 0 " in out and " -> step 3 " in out
    assert sorted(p.name for p in run.glob("report*")) == ["report.png"]


def test_a_ctrl_c_in_the_quickstart_says_to_run_the_quickstart_again(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the script and its processes) in a first run: train's
    line says "the same command with --resume", and the quickstart, which passes --resume itself
    on a later run, said nothing more (it refuses a --resume of its own). Now it says to run it
    again, exit 130; run again, it goes on from the checkpoint, whose later line needs no
    word of the quickstart's (`train --resume`'s line says the same command goes on)."""
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    root = scratch_copy(tmp_path / "repo", steps=4)
    run, model = root / "runs" / "quick", make_tiny_model(TinySpec(), tmp_path / "model")
    gate = StepGate(tmp_path / "gate", run, after=2)
    args = ("configs/quick.yaml", f"model.path={model}", "train.checkpoint_every=1", gate.override)
    env = cli_env() | {"PYTHONPATH": str(ROOT)}
    with open(tmp_path / "out.log", "wb") as log:
        proc = subprocess.Popen(["bash", "scripts/quickstart.sh", *args], cwd=root, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while not gate.holding:
            assert proc.poll() is None and time.monotonic() < deadline, "never held"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # (the terminal's Ctrl-C: the whole foreground group)
        assert proc.wait(timeout=120) == 130
    out = (tmp_path / "out.log").read_text()
    assert out.rstrip().splitlines()[-2:] == [
        "interrupted: runs/quick/checkpoints/step_2 is the run's newest checkpoint: the same "
        "command with --resume goes on from it",
        "(the quickstart passes --resume itself: run it again, with the same arguments, to go on)",
    ], out[-3000:]
    gate.open()
    rc, out = quickstart(root, args=args)
    assert rc == 0, out[-3000:]
    assert steps_logged(run) == [0, 1, 2, 3, 4] and "the quickstart passes" not in out


NO_MODEL = "train:\n  steps: 3\n"
JSONL_DATA = "model:\n  path: runs/mine\ndata:\n  train: myplug/guess.jsonl\n  eval: e.jsonl\n"
TEMPLATE = "configs/tiny_moe_gspo.yaml"


@pytest.mark.parametrize(
    "args, message",
    [
        (["configs/nope.yaml"], "config configs/nope.yaml not found; pass one of configs/*.yaml "
                                "(ls configs/), e.g. configs/tiny_moe_grpo.yaml"),
        (["configs/tiny_moe_gspo.yml"], "config configs/tiny_moe_gspo.yml not found (did you mean "
                                        "configs/tiny_moe_gspo.yaml?); pass one of configs/*.yaml "
                                        "(ls configs/), e.g. configs/tiny_moe_grpo.yaml"),
        (["configs/no_model.yaml"], "model.path is required: the HF checkpoint directory to "
                                    "start from"),
        (["configs/jsonl.yaml"], "model.path runs/mine does not exist, and the quickstart makes "
                                 "the starting model of a built-in task only (data.train is "
                                 "myplug/guess.jsonl): point model.path at an HF checkpoint "
                                 "(megatron-gspo make-task-model makes one for "
                                 "data.train=builtin:TASK)"),
        ([TEMPLATE, "train.steps"], "'train.steps' is not an override; usage: bash "
                                    "scripts/quickstart.sh [CONFIG.yaml] [key.sub=value ...]"),
        ([TEMPLATE, "train.stepz=3"], "unknown config key 'train.stepz'; did you mean "
                                      "'train.steps'?"),
    ],
)  # fmt: skip
def test_quickstart_refuses_bad_input_in_one_line_making_nothing(tmp_path, args, message):
    """A missing config (or a .yml typo) or one without a model: section was a Python traceback,
    exit 1; a config of JSONL data whose model is missing ran make-task-model with the file as
    its task ("unknown task 'myplug/guess.jsonl'"). Now each is one line, exit 2, nothing
    made."""
    root = scratch_copy(tmp_path / "repo", steps=2)
    (root / "configs" / "no_model.yaml").write_text(NO_MODEL)
    (root / "configs" / "jsonl.yaml").write_text(JSONL_DATA)
    proc = run_quickstart(root, tuple(args))
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {message}\n", "")
    assert not (root / "runs").exists()


@pytest.mark.parametrize("config", [TEMPLATE, "configs/drift_moe_gspo.yaml"])
def test_a_model_path_given_on_the_command_line_is_never_made(tmp_path, config):
    """`quickstart.sh CONFIG model.path=/nonexist` used to make a fresh task model there (even
    outside the repository: "wrote /nonexist") and train on it: a typo trained a tiny model
    under the name of the real one. A model.path given on the command line must exist (as for
    `study`); only the config's own (runs/task_model) is made. One line, exit 2, nothing made."""
    from megatron_gspo.data.task_model import make_task_model_flags

    root = scratch_copy(tmp_path / "repo", steps=2)
    task = yaml.safe_load((root / config).read_text())["data"]["train"].removeprefix("builtin:")
    for path in (tmp_path / "elsewhere" / "model", "runs/typo_model"):
        proc = run_quickstart(root, (config, f"model.path={path}"))
        fix = f"megatron-gspo make-task-model {make_task_model_flags(task)} --out {path}"
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, (
            f"error: model.path {path} does not exist: point model.path at an HF or Megatron "
            f"checkpoint, or make {task}'s starting model there: {fix}\n"), "")  # fmt: skip
    assert not (tmp_path / "elsewhere").exists() and not (root / "runs").exists()
