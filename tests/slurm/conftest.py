"""The opt-in Slurm tier: a real slurmctld + slurmd on loopback (scripts/slurm_local.sh, Debian's
Slurm packages) running launch/slurm/train.sbatch. Opt in with MEGATRON_GSPO_SLURM_TESTS=1:

    apt-get install slurmctld slurmd slurm-client
    MEGATRON_GSPO_SLURM_TESTS=1 .venv/bin/python -m pytest -m slurm tests/slurm
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPT_IN = "MEGATRON_GSPO_SLURM_TESTS"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"slurm: real Slurm daemons on loopback (opt-in: {OPT_IN}=1; tests/slurm)"
    )


@pytest.fixture(scope="session")
def slurm_conf(tmp_path_factory) -> Path:
    """A one-node Slurm cluster for this test session; stopped by PID at the end."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"opt-in tier: set {OPT_IN}=1 (needs Debian's slurmctld, slurmd, slurm-client)")
    missing = [x for x in ("slurmctld", "slurmd", "sbatch", "squeue") if not shutil.which(x)]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed: apt-get install slurmctld slurmd slurm-client"
        )
    state = tmp_path_factory.mktemp("slurm")
    port = 17000 + 2 * (os.getpid() % 1000)  # slurmctld and slurmd; apart from a manual cluster
    env = dict(os.environ, SLURM_LOCAL_DIR=str(state), SLURM_LOCAL_PORT=str(port))
    script = str(ROOT / "scripts" / "slurm_local.sh")
    r = subprocess.run(["bash", script, "start"], env=env, capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"scripts/slurm_local.sh start failed:\n{r.stdout}{r.stderr}")
    yield state / "slurm.conf"
    subprocess.run(["bash", script, "stop"], env=env, capture_output=True, timeout=60)
