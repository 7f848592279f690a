"""`megatron-gspo train` stopped by a Ctrl-C (SIGINT): one line naming the newest checkpoint and
exit 130, its rollout servers stopped, and --resume goes on; by a SIGTERM alike (exit 143; a
command that had --resume is told that the same command goes on); and a run whose SIGINT is
ignored (a background job of a script) goes on with its servers, where it used to stop them and
hang."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.train.checkpointing import latest, resume_hint
from tests.helpers import (
    CTRL_C_IN_WRITER,
    QUICK_TRAIN,
    StepGate,
    cli_env,
    run_hooked,
    torchrun,
)

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(), tmp_path_factory.mktemp("tiny") / "model")


def start(run: Path, model: Path, gate: StepGate, *extra: str, sigint=signal.SIG_DFL, nproc=1):
    """The tiny GSPO run to step 4, checkpointing every step, held inside step 3 by `gate`;
    SIGINT's disposition in the trainer `sigint` (SIG_IGN: as a script's background job);
    under torchrun with `nproc` ranks when nproc > 1."""
    target = ["-m", "megatron_gspo", "train", "--config",
              str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run), "--steps", "4",
              f"model.path={model}", *QUICK_TRAIN, "train.checkpoint_every=1", gate.override,
              *extra]  # fmt: skip
    cmd = [sys.executable, *target] if nproc == 1 else torchrun(nproc, *target)
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


def test_a_sigterm_ends_the_run_as_a_ctrl_c_does(model, tmp_path):
    """SIGTERM (a Slurm preemption, `docker stop`) used to end the run by its default action:
    exit -15, not a word of what was kept. Now it stops the run as SIGINT does: the same line,
    its servers and every other process it started stopped, exit 143 (128 + SIGTERM). The
    command had --resume (as the quickstart's has on its later runs), so the line says that
    the same command goes on: it said "the same command with --resume"."""
    run = tmp_path / "run"
    gate = StepGate(tmp_path / "gate", run, after=2)
    proc = start(run, model, gate, "--resume")
    servers = held(proc, gate)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert servers and set(servers) <= set(children)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "run.log").read_text()
    out = (tmp_path / "run.log").read_text()
    assert out.rstrip().splitlines()[-1] == (
        f"interrupted: {run / 'checkpoints' / 'step_2'} is the run's newest checkpoint: the same "
        "command goes on from it"
    )
    assert latest(run) == run / "checkpoints" / "step_2"
    assert "Traceback" not in out and "SystemExit" not in out
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"{alive} outlived the run"


def test_a_sigterm_under_torchrun_is_said_once_by_rank_0(model, tmp_path):
    """torchrun passes a SIGTERM on to each rank: each stops (exit 143 where it used to be
    -15, no line), and only rank 0 says what to go on from. (torchrun's own SignalException
    traceback and exit status are torch's.)"""
    run = tmp_path / "run"
    gate = StepGate(tmp_path / "gate", run, after=2)
    proc = start(run, model, gate, nproc=2)
    servers = held(proc, gate)
    ranks = [p for p in psutil.Process(proc.pid).children() if "megatron_gspo" in p.cmdline()]
    assert servers and len(ranks) == 2
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=180)
    out = (tmp_path / "run.log").read_text()
    line = f"interrupted: {resume_hint(run)}"
    assert [s for s in out.splitlines() if "interrupted" in s] == [line], out[-3000:]
    assert "SystemExit" not in out and "[rank1]" not in out, out[-3000:]
    gone, alive = psutil.wait_procs(servers + ranks, timeout=30)
    assert not alive, f"{alive} outlived the run"


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_ctrl_c_inside_a_checkpoints_write_still_names_what_to_go_on_from(model, tmp_path, sig):
    """A Ctrl-C inside torch's checkpoint writer came out as its "RuntimeError: unexpected pos"
    (in a CheckpointException): train's own line, naming the checkpoint to go on from, was
    lost. Here it lands in the first checkpoint's write (run_hooked's hook). A SIGTERM there
    (the write's own handler makes it SystemExit(143)) ended the run with no line at all."""
    run = tmp_path / "run"
    args = ["train", "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir",
            str(run), "--steps", "2", f"model.path={model}", *QUICK_TRAIN,
            "train.checkpoint_every=1"]  # fmt: skip
    hook = CTRL_C_IN_WRITER.replace("signal.SIGINT", f"signal.{sig.name}")
    code, err = run_hooked(hook, args, timeout=600)
    assert (code, err) == (128 + sig, f"interrupted: {resume_hint(run)}\n"), err[-3000:]
    assert latest(run) is None
    assert list((run / "checkpoints").iterdir()) == []  # (its half-write removed)
