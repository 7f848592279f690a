"""Generation through sglang-router: `megatron-gspo train` with `rollout.router_url`.

Two built-in servers (started here, as a launch script would), real sglang-router 0.3.2 from the
SGLang venv in front of them, and a 2-step tiny GSPO run: every generation request goes through
the router (its request log counts them), every weight sync reaches both servers directly (each
ends at the run's last weight_version). Real-SGLang tier: collected by `pytest -m contract`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.comm import free_port
from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup
from tests.contract.sglang_venv import sglang_python
from tests.helpers import QUICK_TRAIN, cli_env

pytestmark = [pytest.mark.contract, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# As the launch scripts do (launch/torchrun.sh makes one): servers, router and trainer share a
# key; the tensor sync's shared-memory payloads are loaded only for a client holding it.
KEY = "router-test-key"


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    out = tmp_path_factory.mktemp("task") / "model"
    return make_task_model(out, seed=0, clean_steps=30, sloppy_steps=10)


def _start_router(python: Path, urls: list[str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    """The router as the launch scripts start it: launch/serve_node.py router."""
    urls_file = log_dir / "router.txt"
    cmd = [sys.executable, str(ROOT / "launch" / "serve_node.py"), "router", "--worker-urls",
           *urls, "--port", str(free_port()), "--policy", "round_robin",
           "--log-dir", str(log_dir), "--urls-file", str(urls_file)]  # fmt: skip
    env = cli_env() | {"SGLANG_PYTHON": str(python), "MEGATRON_GSPO_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while not urls_file.is_file():
        assert proc.poll() is None, f"serve_node router exited with {proc.returncode}"
        assert time.monotonic() < deadline, "sglang-router was not ready after 180 s"
        time.sleep(0.5)
    return proc, urls_file.read_text().split()[0]


def _routed_generate_ids(log_dir: Path) -> set[str]:
    """Request ids of the /generate requests the router's own log recorded."""
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    ids = set()
    for f in log_dir.iterdir():
        for line in ansi.sub("", f.read_text(errors="replace")).splitlines():
            if "uri=/generate" in line and (m := re.search(r'request_id="([^"]+)"', line)):
                ids.add(m.group(1))
    return ids


def _weight_version(url: str) -> str:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["weight_version"]


@pytest.mark.parametrize("router", ["sglang-router"])
def test_train_generates_through_sglang_router(router, task_model, tmp_path):
    python = sglang_python()
    r = subprocess.run([str(python), "-c", "import sglang_router"], capture_output=True)
    if r.returncode != 0:
        pytest.fail("the SGLang venv has no sglang-router; run `bash scripts/sglang_env.sh`")
    cfg = ServerConfig(
        model_path=str(task_model), threads=1, api_key=KEY, env={"OMP_NUM_THREADS": "1"}
    )
    router_logs = tmp_path / "router"
    router_logs.mkdir()
    run_dir = tmp_path / "run"
    with ServerGroup([cfg, cfg], tmp_path / "servers") as servers:
        urls = servers.urls
        proc, router_url = _start_router(python, urls, router_logs)
        try:
            cmd = [sys.executable, "-m", "megatron_gspo", "train",
                   "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"),
                   "--run-dir", str(run_dir), "--steps", str(STEPS), f"model.path={task_model}",
                   *QUICK_TRAIN, "rollout.urls=[" + ",".join(f'"{u}"' for u in urls) + "]",
                   f"rollout.router_url={router_url}"]  # fmt: skip
            log = tmp_path / "train.log"
            with open(log, "wb") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    env=cli_env() | {"MEGATRON_GSPO_API_KEY": KEY},
                                    cwd=ROOT, timeout=900).returncode  # fmt: skip
            assert rc == 0, log.read_text()[-3000:]
            versions = [_weight_version(u) for u in urls]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(STEPS + 1))
    assert versions == [str(STEPS)] * 2  # the syncs went to both servers, not to the router
    # One request per sample: prompts x group size per step, plus greedy evals at steps 0 and 2.
    expected = STEPS * 4 * 4 + 2 * 8
    routed = _routed_generate_ids(router_logs)
    assert len(routed) >= expected, (len(routed), sorted(p.name for p in router_logs.iterdir()))
