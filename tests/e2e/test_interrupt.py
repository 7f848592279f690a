"""`megatron-gspo train` stopped by a Ctrl-C (SIGINT): one line naming the newest checkpoint and
exit 130, its rollout servers stopped, and --resume goes on; and a run whose SIGINT is ignored (a
background job of a script) goes on with its servers, where it used to stop them and hang."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.train.checkpointing import latest, resume_hint
from tests.helpers import CTRL_C_IN_WRITER, QUICK_TRAIN, StepGate, cli_env, run_hooked

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(), tmp_path_factory.mktemp("tiny") / "model")


def start(run: Path, model: Path, gate: StepGate, *extra: str, sigint=signal.SIG_DFL):
    """The tiny GSPO run to step 4, checkpointing every step, held inside step 3 by `gate`;
    SIGINT's disposition in the trainer `sigint` (SIG_IGN: as a script's background job)."""
    cmd = [sys.executable, "-m", "megatron_gspo", "train", "--config",
           str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run), "--steps", "4",
           f"model.path={model}", *QUICK_TRAIN, "train.checkpoint_every=1", gate.override, *extra]  # fmt: skip
    log = open(run.parent / f"{run.name}.log", "wb")  # noqa: SIM115 (the child's, until it ends)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))  # fmt: skip


def held(proc: subprocess.Popen, gate: StepGate) -> list[psutil.Process]:
    """Once the run is held inside step 3: its built-in rollout server processes."""
    deadline = time.monotonic() + 300
    while not gate.holding:
        assert proc.poll() is None, "the run ended before it was held"
        assert time.monotonic() < deadline, "the run was never held"
        time.sleep(0.2)
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "megatron_gspo.server" in " ".join(p.cmdline())]  # fmt: skip


def test_a_ctrl_c_ends_the_run_in_one_line_naming_its_checkpoint_and_resume_goes_on(
    model, tmp_path
):
    run = tmp_path / "run"
    gate = StepGate(tmp_path / "gate", run, after=2)
    proc = start(run, model, gate)
    servers = held(proc, gate)
    assert servers
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    out = (tmp_path / "run.log").read_text()
    newest = run / "checkpoints" / "step_2"
    assert latest(run) == newest
    assert out.rstrip().splitlines()[-1] == (
        f"interrupted: {newest} is the run's newest checkpoint: the same command with --resume "
        "goes on from it"
    )
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, "a rollout server outlived its run"

    gate.open()
    resumed = start(tmp_path / "run", model, gate, "--resume")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert latest(run) == run / "checkpoints" / "step_4"


def test_a_run_that_ignores_sigint_goes_on_with_its_servers(model, tmp_path):
    """SIGINT ignored (a script's `train ... &`): the launcher used to stop the servers on it
    all the same, and the run then waited on servers that were gone."""
    run = tmp_path / "run"
    gate = StepGate(tmp_path / "gate", run, after=2)
    proc = start(run, model, gate, sigint=signal.SIG_IGN)
    servers = held(proc, gate)
    assert servers
    proc.send_signal(signal.SIGINT)
    time.sleep(2)  # (a handler that stopped them would have by now)
    assert all(s.is_running() and s.status() != psutil.STATUS_ZOMBIE for s in servers)
    gate.open()
    assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert latest(run) == run / "checkpoints" / "step_4"


def test_a_ctrl_c_inside_a_checkpoints_write_still_names_what_to_go_on_from(model, tmp_path):
    """A Ctrl-C inside torch's checkpoint writer came out as its "RuntimeError: unexpected pos"
    (in a CheckpointException): train's own line, naming the checkpoint to go on from, was
    lost. Here it lands in the first checkpoint's write (run_hooked's hook)."""
    run = tmp_path / "run"
    args = ["train", "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir",
            str(run), "--steps", "2", f"model.path={model}", *QUICK_TRAIN,
            "train.checkpoint_every=1"]  # fmt: skip
    code, err = run_hooked(CTRL_C_IN_WRITER, args, timeout=600)
    assert (code, err) == (130, f"interrupted: {resume_hint(run)}\n"), err[-3000:]
    assert latest(run) is None
    assert list((run / "checkpoints").iterdir()) == []  # (its half-write removed)
