"""The RL loop with real SGLang as its rollout backend, started by the trainer from the
documented keys alone (README, docs/deployment.md): `rollout.backend=sglang`, with
`rollout.sglang_python=...` or without it, after `bash scripts/sglang_env.sh` (its environment is
where the trainer looks). The launcher gives SGLang the cpu device, the checkpoint's dtype
and a KV cache sized to the run; a 16-bit server passes weight verification at its dtype's
tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.contract.sglang_venv import sglang_python
from tests.helpers import cli_env

pytestmark = [pytest.mark.contract]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    out = tmp_path_factory.mktemp("sglang_task") / "model"
    return make_task_model(out, seed=0, clean_steps=30, sloppy_steps=10)


def train(
    config: str,
    run_dir: Path,
    model: Path,
    *extra: str,
    steps: int = 5,
    backend="sglang",
    entry: list[str] | None = None,
    name_python: bool = True,
):
    servers = []  # the built-in server, the configs' default
    if backend == "sglang":  # (asks for the venv only here: the built-in runs need none)
        python = sglang_python()  # (a test failure naming the fix where it is not built)
        servers = ["rollout.backend=sglang"]
        servers += [f"rollout.sglang_python={python}"] if name_python else []
    cmd = [sys.executable, *(entry or ["-m", "megatron_gspo"]), "train", "--config",
           str(ROOT / "configs" / config), "--run-dir", str(run_dir), "--steps", str(steps),
           f"model.path={model}", *servers, *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    header = next(
        line for line in (run_dir / "logs" / "server-0.log").read_text().splitlines()
        if " start #0: " in line
    )  # fmt: skip
    return rows, header


@pytest.mark.real_sglang
def test_sglang_trains_gspo_from_the_documented_keys(task_model, tmp_path):
    """README's two steps, `bash scripts/sglang_env.sh` then `rollout.backend=sglang` and no
    python named: the servers used to start on the trainer's python (no SGLang) and fail."""
    rows, header = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model, name_python=False)
    assert f"{sglang_python()} -m sglang.launch_server" in header
    flags = ("--device cpu", "--dtype float32", "--cuda-graph-backend-decode disabled",
             "--sleep-on-idle", "--disable-overlap-schedule")  # fmt: skip
    for flag in flags:
        assert flag in header, header
    # 8 prompts x 8 samples x (prompt + 8 new tokens) x 1.5, at least 4096
    assert "--max-total-tokens 4096" in header and "--max-running-requests 64" in header
    assert "--api-key ***" in header  # a random key, kept out of the log
    log = (tmp_path / "run" / "logs" / "server-0.log").read_text()
    assert "'api_key': '***'" in log  # SGLang's own server_args line, its value left out
    assert "deprecated" not in log.split("server_args=")[0]  # (no deprecated flag of ours)
    for r in rows[1:]:
        assert r["mismatch/logprob_abs_diff"] < 1e-3  # an fp32 server: the trainer's numbers
        assert r["rollout/stale_samples"] == 0


def _group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid` (a server and its children)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@pytest.mark.real_sglang
def test_an_idle_sglang_server_leaves_the_cpu_to_the_trainer(task_model, tmp_path):
    """The launcher's SGLang on a CPU host (rollout/server_config.size_sglang) sleeps while it
    has nothing to do, that is while the trainer trains: SGLang's default scheduler polls
    without pause and takes a whole core (1.0 CPU-s/s here) from the trainer beside it."""
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup
    from megatron_gspo.rollout.server_config import size_sglang

    cfg = load_config(ROOT / "configs" / "tiny_moe_gspo.yaml", [f"model.path={task_model}"])
    server = ServerConfig(model_path=str(task_model), kind="sglang", python=str(sglang_python()))
    size_sglang(server, cfg, task_model, longest_prompt=16, gpu=False)
    with ServerGroup([server], tmp_path / "logs") as group:  # (its monitor polls /health too)
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "n": 8}}
        req = urllib.request.Request(group.urls[0] + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        assert len(json.loads(urllib.request.urlopen(req, timeout=120).read())) == 8
        time.sleep(2)  # served, and idle again
        before = _group_cpu_seconds(group.servers[0].pid)
        time.sleep(5)
        idle = (_group_cpu_seconds(group.servers[0].pid) - before) / 5
    assert idle < 0.3, f"an idle SGLang server took {idle:.2f} CPU-s/s"


@pytest.mark.real_sglang
def test_sglang_bf16_trains_grpo_r3_with_every_sync_verified(task_model, tmp_path):
    rows, header = train("tiny_moe_grpo_r3.yaml", tmp_path / "run", task_model,
                         "rollout.dtype=bfloat16", "sync.verify_every=1")  # fmt: skip
    assert "--dtype bfloat16" in header and "--enable-return-routed-experts" in header
    for r in rows[1:]:
        assert 1e-4 < r["mismatch/logprob_abs_diff"] < 0.5  # bf16 against the fp32 trainer
        assert 0.5 < r["routing/rollout_train_agreement"] <= 1.0


@pytest.mark.real_sglang
def test_sglang_generates_two_steps_ahead_with_partial_rollouts(task_model, tmp_path):
    """rollout.max_staleness=2 with rollout.partial: the syncs hold SGLang's generations in
    flight (its /abort_request returns their tokens so far) and they go on after it. Whether a
    generation is still running at a sync depends on the machine's timing, so this checks what
    holds either way: no sample is older than 2 versions, none is dropped, the run finishes."""
    rows, _ = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model,
                    "rollout.max_staleness=2", "rollout.partial=true")  # fmt: skip
    for r in rows[1:]:
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"], r
        assert r["rollout/staleness_max"] <= min(r["step"] - 1, 2), r
        assert r.get("rollout/stale_groups_dropped", 0.0) == 0.0, r
        assert r["rollout/samples"] == 64 and 0 <= r["rollout/partial_fraction"] <= 1, r


# The injected fault: the one rollout server is killed -9 at a chosen point of step 2, found
# as this trainer's child process (its pid, nothing else, comes from outside the code).
KILL = """
import os, signal, sys
import psutil
import megatron_gspo.rollout.client as client
import megatron_gspo.train.share as share
import megatron_gspo.weight_sync.transports.tensor as transport
from megatron_gspo.cli import main

where, state = sys.argv.pop(1), {"step": 0, "done": False}

def kill_server():
    state["done"] = True
    for child in psutil.Process().children():
        cmd = " ".join(child.cmdline())
        if "sglang.launch_server" in cmd or "megatron_gspo.server" in cmd:
            print(f"killing server pid {child.pid} at {where}", flush=True)
            os.kill(child.pid, signal.SIGKILL)

real_collect = share.SharedRollouts.collect
def collect(self, prompt_index, step, version=None):
    state["step"] = step
    return real_collect(self, prompt_index, step, version)
share.SharedRollouts.collect = collect

real_post = client.RolloutClient._post_generate
async def post(self, *args, **kwargs):
    if where == "rollouts" and state["step"] == 2 and not state["done"]:
        kill_server()  # the batch's first request: every request of it meets a dead server
    return await real_post(self, *args, **kwargs)
client.RolloutClient._post_generate = post

real_send = transport.TensorTransport.send
def send(self, bucket, ctx):
    if where == "sync" and ctx.version == "2" and bucket.index == 1 and not state["done"]:
        kill_server()  # mid-sync: one bucket in, the others to come
    return real_send(self, bucket, ctx)
transport.TensorTransport.send = send

import megatron_gspo.weight_sync.verify as verify
real_probe = verify.server_logprobs
def probe(servers, i, seqs):
    if where == "verify" and state["step"] == 2 and not state["done"]:
        kill_server()  # synced, then dead before its probe answers
    return real_probe(servers, i, seqs)
verify.server_logprobs = probe
main()
"""


# (the death after the sync, before the probe, is the weight sync's own path whatever the
# server: the built-in server alone covers it, and the contract tier stays shorter)
@pytest.mark.parametrize(
    "where,backend",
    [(w, b) for w in ("rollouts", "sync", "verify") for b in ("builtin", "sglang")
     if (w, b) != ("verify", "sglang")],
)  # fmt: skip
def test_the_only_server_killed_mid_run_is_restarted_and_the_run_goes_on(
    task_model, tmp_path, backend, where
):
    """Killed -9 at step 2's rollouts: the requests wait for the supervisor's restart and the
    batch is whole. Killed during step 2's sync, or after it before its verification probe
    answers (every sync is verified): the sync fails for it alone, the restarted server is
    caught up before step 3's rollouts. Either way the run finishes, each batch
    has its 64 samples, none from other weights."""
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    run_dir = tmp_path / "run"
    rows, _ = train("tiny_moe_gspo.yaml", run_dir, task_model, "sync.bucket_mb=0.05",
                    "sync.verify_every=1", steps=4, backend=backend,
                    entry=[str(script), where])  # fmt: skip
    log = (run_dir / "logs" / "server-0.log").read_text()
    assert " start #1: " in log and " start #2: " not in log  # restarted once
    for r in rows[1:]:
        assert r["rollout/samples"] == 64 and r["rollout/stale_samples"] == 0, r
    # the restarted server comes up on the restore point (here the base model); step 2's
    # batch, had the restart happened in it, is generated again once it is caught up
    regenerated = [r["rollout/regenerated_samples"] for r in rows[1:]]
    assert regenerated == ([0, 64, 0, 0] if where == "rollouts" else [0, 0, 0, 0]), regenerated
    if where in ("sync", "verify"):
        assert [r["sync/failed_servers"] for r in rows[1:]] == [0, 1, 0, 0]
        assert [r["sync/caught_up_servers"] for r in rows[1:]] == [0, 0, 1, 0]
    else:
        assert all(r["sync/failed_servers"] == 0 for r in rows[1:])
