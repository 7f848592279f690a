"""A launch again into the same run: a launch id an earlier launch used (a relaunch, a Slurm
requeue), a --resume the trainer would refuse, a run directory the script cannot make or write,
the closing advice of a failure whose first rank refused its input, and the Slurm batch script's
paths and its job ids (with a stand-in `scontrol` and `srun` on PATH)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import dump_config, load_config
from megatron_gspo.errors import UserError
from megatron_gspo.train import run_dir as rd
from tests.helpers import saved_checkpoint, servers_killed_python

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny_moe_gspo.yaml"
SBATCH = ROOT / "launch/slurm/train.sbatch"
# what the environment of the test run could add to a launch's (a Slurm job's, a simulation's)
LAUNCH_ENV = ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "LAUNCH_ID", "ROLLOUT_NODES",
              "NPROC_PER_NODE", "GPUS_PER_NODE", "SERVERS_PER_NODE", "MEGATRON_GSPO_HOME")  # fmt: skip


def clean_env(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCH_ENV and not k.startswith("SLURM_")}  # fmt: skip
    return {**base, **env}


def launch(tmp_path: Path, run: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """launch/torchrun.sh on the tiny config (its model a directory here) into `run`, its
    servers killed as they start (the OOM killer's way): a launch that goes on to start them
    stops there, exit 1, before torchrun."""
    env = clean_env(PYTHON=str(servers_killed_python(tmp_path)), GPUS_PER_NODE="0", **env)
    (tmp_path / "model").mkdir(exist_ok=True)
    return subprocess.run(
        ["bash", str(ROOT / "launch/torchrun.sh"), "--config", str(CONFIG), "--run-dir", str(run),
         f"model.path={tmp_path / 'model'}", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def servers_killed(run: Path, node: int = 0) -> str:
    log = run / "logs" / "servers" / f"node{node}" / "serve_node.log"
    return f"error: rollout servers on node {node} stopped: Killed (see {log})"


# ---- a launch id is one launch's --------------------------------------------------------------

EARLIER = {
    "started/node0": "host pid 1 2026-01-01 00:00:00\n",
    "urls/node0.txt": "http://127.0.0.1:30000\n",
    "done": "0\n",
    "abort": "node 0: rollout servers on node 0 stopped: Killed\n",
}


@pytest.mark.parametrize("left", list(EARLIER))
def test_a_launch_id_an_earlier_launch_used_is_refused_before_anything_starts(tmp_path, left):
    """A relaunch under the launch id of an earlier one read that launch's files as its own:
    its urls/ ("rollout servers ready" with ports long closed, then "nothing answers at ..."),
    its abort ("another node failed" at once, on a node alone), its done (a serving node left
    at once). Now what only an earlier launch can have left refuses it, in one line naming
    LAUNCH_ID, exit 2, nothing started or made."""
    run = tmp_path / "run"
    state = run / "launch" / "x"
    (state / left).parent.mkdir(parents=True)
    (state / left).write_text(EARLIER[left])
    r = launch(tmp_path, run, LAUNCH_ID="x")
    assert (r.returncode, r.stderr) == (2, (
        f"error: LAUNCH_ID=x was an earlier launch's ({state} holds its {left}); give this launch "
        "a LAUNCH_ID of its own, the same on every node, or remove that directory once no launch "
        "uses it\n"))  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == ["launch"]  # (no logs/: nothing started)


def test_files_another_node_left_first_are_this_launchs(tmp_path):
    """Node 1 may start, and publish its URLs, before node 0 starts: node 0 goes on (to its
    servers, here killed) and marks the launch as its own."""
    run = tmp_path / "run"
    state = run / "launch" / "x"
    (state / "urls").mkdir(parents=True)
    (state / "started").mkdir()
    (state / "started" / "node1").write_text("host pid 1\n")
    (state / "urls" / "node1.txt").write_text("http://127.0.0.1:30001\n")
    r = launch(tmp_path, run, LAUNCH_ID="x", NNODES="2", NODE_RANK="0",
               RDZV_ENDPOINT="127.0.0.1:29555", MEGATRON_GSPO_API_KEY="k")  # fmt: skip
    assert r.returncode == 1 and r.stderr.splitlines()[0] == servers_killed(run), r.stderr
    assert (state / "started" / "node0").is_file()


def test_a_slurm_requeue_is_a_launch_of_its_own(tmp_path):
    """A requeued job runs again under its job id, the default LAUNCH_ID: the requeue read the
    first attempt's files (here its abort: "another node failed" on the job's only node).
    SLURM_RESTART_COUNT, which Slurm sets on a requeue, now makes each attempt's id."""
    run = tmp_path / "run"
    first = launch(tmp_path, run, SLURM_JOB_ID="77")
    requeued = launch(tmp_path, run, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1")
    for r in (first, requeued):
        assert r.returncode == 1 and r.stderr.splitlines()[0] == servers_killed(run), r.stderr
    assert sorted(p.name for p in (run / "launch").iterdir()) == ["77-0", "77-1"]
    assert (run / "launch" / "77-1" / "abort").read_text().startswith("node 0: rollout servers")


# ---- refusals before anything starts ---------------------------------------------------------


def test_a_resume_with_another_layout_is_refused_before_the_servers_start(tmp_path):
    """The trial's `--resume ... parallel.ep=2` on a run trained with parallel.pp=2 started the
    servers and torchrun, whose trainer then refused (exit 2), and the script advised the same
    command again. plan.py now refuses first, in the trainer's line (train/run_dir.py `prepare`
    on the same directory), nothing started; --allow-config-change goes on."""
    run, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    trained = [f"model.path={model}", "parallel.pp=2"]
    run.mkdir()
    dump_config(load_config(str(CONFIG), trained), run / "config.yaml")
    saved_checkpoint(run, 2)
    resumed = [f"model.path={model}", "parallel.ep=2"]
    with pytest.raises(UserError) as trainer:
        rd.prepare(run, True, load_config(str(CONFIG), resumed), False)
    refused = str(trainer.value)
    assert "parallel.pp: 2 -> 1" in refused and "--allow-config-change" in refused
    before = sorted(p.name for p in run.iterdir())
    r = launch(tmp_path, run, "--resume", "parallel.ep=2", NPROC_PER_NODE="2")
    assert (r.returncode, r.stderr) == (2, f"error: {refused}\n")
    assert sorted(p.name for p in run.iterdir()) == before  # (no launch/, no logs/)
    r = launch(tmp_path, run, "--resume", "--allow-config-change", "parallel.ep=2",
               NPROC_PER_NODE="2")  # fmt: skip
    assert r.returncode == 1 and r.stderr.splitlines()[0] == servers_killed(run), r.stderr


def _trainer_refusal(run_dir: Path) -> str:
    """`train`'s own line for a --run-dir it cannot make."""
    with pytest.raises(UserError) as e:
        rd.RunDirLock(run_dir).acquire()
    return f"error: {e.value}\n"


def test_a_run_dir_the_launch_cannot_make_is_trains_one_line(tmp_path):
    """mkdir's raw 'cannot create directory' line, exit 1, before; now `train`'s line, exit 2
    (a path under a regular file: refused to root too, unlike permission bits)."""
    (tmp_path / "file").write_text("")
    run = tmp_path / "file" / "run"
    r = launch(tmp_path, run)
    assert (r.returncode, r.stderr) == (2, _trainer_refusal(run))
    assert r.stderr.endswith("(Not a directory); pass --run-dir NEW_DIR\n")


def test_a_run_dir_the_launch_cannot_write_in_is_named_in_one_line(tmp_path):
    """A run directory that is there but where the launch cannot make its directories (here
    its launch/ is a file: refused to root too)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "launch").write_text("")
    r = launch(tmp_path, run, LAUNCH_ID="x")
    assert (r.returncode, r.stderr) == (2, (
        f"error: cannot write {run}/launch/x/urls (Not a directory); make it writable (chmod -R "
        f"u+w {run}) and run the command again, or pass --run-dir NEW_DIR\n"))  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == ["launch"]


# ---- torchrun's exit code: a refusal or a crash ----------------------------------------------


@pytest.mark.parametrize("rank_exit, agent_exit", [(2, 2), (1, 1)])
def test_the_agent_exits_2_when_its_rank_refused_its_input(tmp_path, rank_exit, agent_exit):
    """torchrun exits 1 however a rank ended, so the script could not tell a refusal (train's
    exit 2, the same command refused again) from a crash (--resume goes on)."""
    script = tmp_path / "rank.py"
    script.write_text(f"import sys\nprint('error: no', file=sys.stderr)\nsys.exit({rank_exit})\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/torchrun_agent.py"), "--standalone",
         "--nproc-per-node", "1", "--max-restarts", "0", str(script)],
        capture_output=True, text=True, timeout=120, env=clean_env(OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert r.returncode == agent_exit, r.stderr
    assert f"exitcode  : {rank_exit}" in r.stderr and "Traceback" not in r.stderr


# ---- the Slurm batch script ------------------------------------------------------------------


def fake_slurm(directory: Path, scontrol: bool = True) -> Path:
    """A bin/ with `srun`, which writes what it was asked to run (its arguments, directory and
    LAUNCH_ID) to SRUN_RECORD and exits 0, and `scontrol show hostnames` of one node."""
    bin_ = directory / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump({'args': sys.argv[1:], 'cwd': os.getcwd(), 'launch_id': os.environ['LAUNCH_ID']},"
        " open(os.environ['SRUN_RECORD'], 'w'))\n"
    )
    if scontrol:
        (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo node1\n')
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    return bin_


def sbatch(directory: Path, path: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The batch script as sbatch runs it: in the job's working directory `directory`."""
    full = clean_env(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node1", PATH=path, **env)
    return subprocess.run([shutil.which("bash") or "/bin/bash", str(SBATCH), *args], cwd=directory,
                          capture_output=True, text=True, env=full, timeout=60)  # fmt: skip


@pytest.mark.parametrize("restarts, launch_id", [(None, "77-0"), ("3", "77-3")])
def test_sbatch_paths_are_the_job_directorys_and_each_attempt_its_own_launch(
    tmp_path, restarts, launch_id
):
    """`cd EXP; MEGATRON_GSPO_HOME=/repo sbatch train.sbatch --config my.yaml --run-dir myrun`
    looked for /repo/my.yaml (config not found) and ran in /repo/myrun; the job id was the
    launch id of every attempt of a requeued job."""
    exp = tmp_path / "exp"
    exp.mkdir()
    record = tmp_path / "srun.json"
    path = f"{fake_slurm(tmp_path)}:{os.environ['PATH']}"
    extra = {"SLURM_RESTART_COUNT": restarts} if restarts else {}
    r = sbatch(exp, path, "--config", "my.yaml", "--run-dir=myrun", "--steps", "2", "a.b=c",
               MEGATRON_GSPO_HOME=str(ROOT), SRUN_RECORD=str(record), **extra)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ran = json.loads(record.read_text())
    launcher = ran["args"].index("bash") + 1
    assert ran["args"][launcher:] == [
        str(ROOT / "launch/torchrun.sh"), "--config", f"{exp}/my.yaml", f"--run-dir={exp}/myrun",
        "--steps", "2", "a.b=c",
    ]  # fmt: skip
    assert (ran["cwd"], ran["launch_id"]) == (str(exp), launch_id)
    assert f"job 77 finished; run dir {exp}/myrun" in r.stdout
    r = sbatch(exp, path, "--config", "my.yaml", MEGATRON_GSPO_HOME=str(ROOT),
               SRUN_RECORD=str(record))  # fmt: skip
    assert json.loads(record.read_text())["args"][-2:] == ["--run-dir", f"{exp}/runs/my-77"]


def test_sbatch_without_scontrol_says_so_in_one_line(tmp_path):
    """It ended in bash's `NODES[0]: unbound variable`."""
    r = sbatch(tmp_path, str(fake_slurm(tmp_path, scontrol=False)), "--config", "x.yaml",
               MEGATRON_GSPO_HOME=str(ROOT))  # fmt: skip
    assert (r.returncode, r.stderr) == (2, (
        "error: scontrol not found on PATH; this script lists the job's nodes with it: run it "
        "with sbatch where Slurm's commands are installed\n"))  # fmt: skip


def test_sbatch_is_executable_as_the_docs_run_it():
    """docs/deployment.md runs `launch/slurm/train.sbatch --help`: the file was mode 644."""
    r = subprocess.run([str(SBATCH), "--help"], capture_output=True, text=True, timeout=30,
                       env=clean_env())  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("usage: sbatch"), r.stderr
    staged = subprocess.run(["git", "ls-files", "-s", str(SBATCH)], cwd=ROOT,
                            capture_output=True, text=True)  # fmt: skip
    assert not staged.stdout or staged.stdout.startswith("100755 "), staged.stdout  # (git's mode)
