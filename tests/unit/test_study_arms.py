"""Where a study finds its arms' configs when the package is installed without the repository
(the image's `pip install .` copies megatron_gspo/ alone into site-packages)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ASK = (
    "from megatron_gspo.study.arms import CONFIGS_DIR, available_arms\n"
    "from megatron_gspo.study.plan import algo_table\n"
    "print(CONFIGS_DIR)\n"
    "print(','.join(available_arms(None)))\n"
    "try:\n"
    "    algo_table(arms=['gspo'])\n"
    "except Exception as e:\n"
    "    print(e)\n"
    "else:\n"
    "    print('read')\n"
)


def _installed(tmp_path: Path, home: str | None) -> list[str]:
    """The package copied alone to `tmp_path`/site (as a non-editable install has it), asked
    for its arms from a directory that is not the repository."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "megatron_gspo", site / "megatron_gspo",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_GSPO_HOME"}
    env["PYTHONPATH"] = str(site)
    if home is not None:
        env["MEGATRON_GSPO_HOME"] = home
    out = subprocess.run([sys.executable, "-c", ASK], env=env, cwd=tmp_path, text=True,
                         capture_output=True, check=True)  # fmt: skip
    return out.stdout.splitlines()


def test_an_installed_package_reads_the_arms_from_megatron_gspo_home(tmp_path):
    configs, arms, table = _installed(tmp_path, str(ROOT))
    assert configs == str(ROOT / "configs")
    assert {"gspo", "grpo", "grpo_r2", "grpo_r3"} <= set(arms.split(","))
    assert table == "read"


def test_an_installed_package_without_megatron_gspo_home_names_it(tmp_path):
    configs, arms, error = _installed(tmp_path, None)
    assert arms == "" and not Path(configs).is_dir()
    assert error.endswith(
        f"set MEGATRON_GSPO_HOME to the repository (no arm's config in {configs})"
    )
