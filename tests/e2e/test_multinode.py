"""Two nodes simulated on one machine: two torchrun agents (`--nnodes 2`, c10d rendezvous on
loopback) train the tiny config to the same metrics as one agent with the same layout, and a rank
killed mid-run stops both nodes with a clear message, leaving a checkpoint that --resume loads
(through launch/torchrun.sh, the script Slurm runs once per node). That run is colocated with the
tensor weight sync: each node's server gets its weights from a trainer rank of its own node (the
other node's through a relay), and every sync is verified on every server (sync.verify_every=1:
the servers' probe log-probs against the trainer's, and their weight_version)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.rollout.launcher import free_port
from tests.helpers import QUICK_TRAIN, cli_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_moe_gspo.yaml"
# Experts split over the two nodes: the step needs both.
QUICK = ["parallel.ep=2", *QUICK_TRAIN]
# Wall-clock metrics differ between any two runs; everything else must be equal, except the
# rollout-vs-trainer log-prob gap: the rollout server's log-probs depend (in the last bits) on
# which requests it happened to batch together.
TIMING = ("time/", "tokens_per_s", "sync/gb_per_s")
NEAR = {"mismatch/logprob_abs_diff": 1e-6}


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    return make_task_model(tmp_path_factory.mktemp("task") / "model", seed=0)


def _env(**extra: str) -> dict:
    env = cli_env()
    for k in ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "LAUNCH_ID", "MASTER_ADDR", "MASTER_PORT",
              "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):  # fmt: skip
        env.pop(k, None)
    return env | extra


def _train_args(run_dir: Path, model: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", str(CONFIG), "--run-dir", str(run_dir), "--steps", str(steps),
            f"model.path={model}", *QUICK, *extra]  # fmt: skip


def torchrun_agents(run_dir: Path, model: Path, *, nnodes: int, nproc: int, steps: int = 2):
    """`nnodes` torchrun agents of `nproc` ranks each, meeting at a c10d rendezvous on loopback."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_dir.mkdir(parents=True)
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "--rdzv-id", f"sim-{run_dir.name}", "--max-restarts", "0",
               "-m", "megatron_gspo", "train", *_train_args(run_dir, model, steps)]  # fmt: skip
        log = open(run_dir.parent / f"{run_dir.name}.agent{node}.log", "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                      cwd=ROOT, start_new_session=True))  # fmt: skip
    return procs


def launch_nodes(run_dir: Path, model: Path, *extra: str, steps: int, launch_id: str | None,
                 nproc: int = 1, **env_extra: str):  # fmt: skip
    """Two copies of launch/torchrun.sh, one per simulated node (launch_id None: the script's
    default, a Slurm job's when env_extra sets SLURM_JOB_ID)."""
    endpoint = f"127.0.0.1:{free_port()}"
    slurm = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT")
    tag = launch_id or "-".join(env_extra.get(k, "") for k in slurm)
    ids = {"LAUNCH_ID": launch_id} if launch_id else {}
    procs = []
    for node in range(2):
        env = _env(NNODES="2", NODE_RANK=str(node), RDZV_ENDPOINT=endpoint,
                   NPROC_PER_NODE=str(nproc), PYTHON=sys.executable,
                   MEGATRON_GSPO_API_KEY=f"key-{tag}", **ids, **env_extra)  # fmt: skip
        cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"),
               *_train_args(run_dir, model, steps, *extra)]  # fmt: skip
        log = open(run_dir.parent / f"{run_dir.name}.{tag}.node{node}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        proc.log_path = Path(log.name)
        procs.append(proc)
    return procs


def finish(procs, timeout: float = 900) -> list[tuple[int, str]]:
    """Wait for every process: (exit code, its output) each."""
    out = []
    try:
        for p in procs:
            p.wait(timeout)
            text = p.log_path.read_text(errors="replace") if hasattr(p, "log_path") else ""
            out.append((p.returncode, text))
    finally:
        for p in procs:  # a failed assertion above must not leave a run behind
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _agent_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:]
                     for p in sorted(run_dir.parent.glob(f"{run_dir.name}.agent*.log")))  # fmt: skip


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING) and k not in NEAR}


def assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [without_timing(r) for r in got] == [without_timing(r) for r in want]
    for g, w in zip(got, want):
        for key, tol in NEAR.items():
            assert (key in g) == (key in w)
            if key in g:
                assert abs(g[key] - w[key]) <= tol, (g["step"], key, g[key], w[key])


def test_two_simulated_nodes_give_the_metrics_of_one_node(task_model, tmp_path):
    one = tmp_path / "one_node"
    [(rc, _)] = finish(torchrun_agents(one, task_model, nnodes=1, nproc=2))
    assert rc == 0, _agent_logs(one)
    two = tmp_path / "two_nodes"
    results = finish(torchrun_agents(two, task_model, nnodes=2, nproc=1))
    assert [rc for rc, _ in results] == [0, 0], _agent_logs(two)

    got, want = metrics(two), metrics(one)
    assert [r["step"] for r in got] == [0, 1, 2]
    assert "reward/mean" in got[1] and "loss/policy" in got[1] and "grad_norm" in got[1]
    assert_same_metrics(got, want)
    assert any(r.get("grad_norm", 0) > 0 for r in got)  # the policy moved: nothing trivial compared


def _worker_pids(launcher: subprocess.Popen) -> list[int]:
    """The trainer ranks under one launch script (not the torchrun agent, not the servers)."""
    pids = []
    agent = ("torch.distributed.run", "torchrun_agent.py")
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "megatron_gspo" in cmd and " train " in cmd and not any(a in cmd for a in agent):
            pids.append(child.pid)
    return pids


def _all_pids(procs) -> set[int]:
    pids = set()
    for p in procs:
        try:
            pids |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        except psutil.Error:
            pass
    return pids


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} {p.status()} ppid={p.ppid()} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"{pid} (gone)"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Colocated on both nodes, weights by shared memory through a per-node relay, in a few buckets,
# every sync verified on every server (a mismatch fails the run).
RELAYED = ["train.checkpoint_every=1", "sync.method=tensor", "sync.bucket_mb=0.5",
           "sync.verify_every=1"]  # fmt: skip


def test_killed_rank_stops_every_node_and_the_last_checkpoint_resumes(task_model, tmp_path):
    run = tmp_path / "run"
    steps = 3
    procs = launch_nodes(run, task_model, *RELAYED, steps=steps, launch_id="a")
    try:
        deadline = time.monotonic() + 600
        while not (run / "checkpoints" / "step_1" / "trainer_state.json").is_file():
            assert all(p.poll() is None for p in procs), finish(procs)
            assert time.monotonic() < deadline, "no checkpoint after 600 s"
            time.sleep(0.2)
        started = _all_pids(procs)
        victims = _worker_pids(procs[1])
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
    except BaseException:
        finish(procs, timeout=5)
        raise
    results = finish(procs, timeout=300)

    codes = [rc for rc, _ in results]
    assert all(rc != 0 for rc in codes), (codes, results[1][1][-3000:])
    killed_node = results[1][1]
    assert "error: training stopped on node 1: torchrun exited with code" in killed_node
    assert "last complete checkpoint: " in killed_node and "--resume" in killed_node
    assert "error: another node failed: node 1:" in results[0][1] or (
        "error: training stopped on node 0" in results[0][1]
    )
    # A process still exiting (a core dump, a large address space torn down) is not left behind.
    deadline = time.monotonic() + 15
    while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind after the failure: {[_describe(p) for p in left]}"
    assert (run / "launch" / "a" / "abort").is_file()

    last = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert last >= 1 and f"checkpoints/step_{last};" in killed_node

    resumed = launch_nodes(run, task_model, *RELAYED, "--resume", steps=steps, launch_id="b")
    results = finish(resumed)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    rows = metrics(run)
    assert rows[-1]["step"] == steps and rows[-1]["weight_version"] == steps
    assert (run / "checkpoints" / f"step_{steps}" / "trainer_state.json").is_file()
    # Each node's server got its weights from a rank of its own node: the stage sender's node
    # directly, the other through its relay; every sync up to the last was verified on both.
    plan = [line for _, text in results for line in text.splitlines() if "weight sync: " in line]
    assert plan and "relayed by rank 1 to node" in plan[0], plan
    urls = [(run / "launch" / "b" / "urls" / f"node{n}.txt").read_text().split() for n in (0, 1)]
    assert all(url in plan[0] for node_urls in urls for url in node_urls), (plan, urls)


def test_disaggregated_node_serves_while_the_other_trains(task_model, tmp_path):
    """Node 1 only serves; node 0 trains with PP 2 and broadcasts each stage's weights to it."""
    run = tmp_path / "run"
    procs = launch_nodes(run, task_model, "parallel.ep=1", "parallel.pp=2",
                         "rollout.placement=disaggregated", "sync.method=distributed",
                         steps=2, launch_id="d", nproc=2, ROLLOUT_NODES="1")  # fmt: skip
    results = finish(procs)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-2000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["weight_version"] == 2
    assert (run / "logs" / "servers" / "node1" / "server-0.log").is_file()
    assert not list((run / "logs" / "servers" / "node0").glob("server-*.log"))
    assert list((run / "logs" / "ranks" / "node0").rglob("stderr.log"))
    assert not list((run / "logs" / "ranks" / "node1").rglob("stderr.log"))
    assert "this one serves" in results[1][1] and "training finished" in results[1][1]


def _router_python() -> str | None:
    for python in (os.environ.get("SGLANG_PYTHON"),
                   str(Path.home() / ".cache/megatron-gspo/sglang-venv/bin/python")):  # fmt: skip
        if python and Path(python).exists():
            r = subprocess.run([python, "-c", "import sglang_router"], capture_output=True)
            if r.returncode == 0:
                return python
    return None


def test_router_in_front_of_two_servers_stops_by_pid(tiny_models, tmp_path):
    """launch/serve_node.py: two servers on this node, then sglang-router in front of them."""
    python = _router_python()
    if python is None:
        pytest.skip("no python with sglang-router (set SGLANG_PYTHON; pip install sglang-router)")
    import urllib.request

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text())
    node = ["--config", str(cfg), f"model.path={tiny_models['moe']}"]
    urls_file, router_file = tmp_path / "urls.txt", tmp_path / "router.txt"
    env = _env(SGLANG_PYTHON=python)
    serve = ROOT / "launch" / "serve_node.py"
    servers = subprocess.Popen(
        [sys.executable, str(serve), "servers", *node, "--servers-per-node", "2",
         "--log-dir", str(tmp_path / "logs"), "--urls-file", str(urls_file)],
        env=env, start_new_session=True,
    )  # fmt: skip
    router = None
    try:
        _wait_file(urls_file, servers)
        urls = urls_file.read_text().split()
        assert len(urls) == 2
        router = subprocess.Popen(
            [sys.executable, str(serve), "router", "--worker-urls", *urls,
             "--port", str(free_port()), "--log-dir", str(tmp_path / "logs"),
             "--urls-file", str(router_file)],
            env=env, start_new_session=True,
        )  # fmt: skip
        _wait_file(router_file, router)
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        req = urllib.request.Request(router_file.read_text().strip() + "/generate", body.encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["output_ids"]) == 4
        children = _all_pids([servers, router])
        assert len(children) >= 3  # two servers and the router
    finally:
        for p in (router, servers):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    assert router.returncode == 0 and servers.returncode == 0
    time.sleep(0.5)
    assert not [pid for pid in children if _alive(pid)]


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None, f"exited with {proc.returncode} before writing {path}"
        assert time.monotonic() < deadline, f"{path} not written after {timeout} s"
        time.sleep(0.2)
