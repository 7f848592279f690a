"""A run directory a start cannot write (a read-only copy of a finished run, a logs/ of another
user): one line naming the path and the fix, exit 2, nothing changed; and the "nothing to train"
answer, which needs no write, given all the same. These used to end in PermissionError
tracebacks (exit 1) from the lock file or from the rollout launcher's server log.

Root ignores file permissions, so as root each command runs with the capabilities that let it
do so dropped (setpriv); a machine where permissions are not enforced anyway skips."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import dump_config, load_config
from tests.helpers import cli_env, saved_checkpoint

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SETPRIV = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
WRITABLE = "import os, sys; sys.exit(0 if os.access(sys.argv[1], os.W_OK) else 1)"


def unprivileged(*cmd: str) -> subprocess.CompletedProcess:
    """`cmd` with file permissions enforced (root's capabilities that ignore them dropped)."""
    prefix = SETPRIV if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file permissions are not enforced")
    return subprocess.run([*prefix, *cmd], capture_output=True, text=True, env=cli_env(),
                          cwd=ROOT, timeout=120)  # fmt: skip


def read_only(*paths: Path) -> None:
    for top in paths:
        for p in [top, *top.rglob("*")] if top.is_dir() else [top]:
            p.chmod(p.stat().st_mode & ~0o222)
    if unprivileged(sys.executable, "-c", WRITABLE, str(paths[0])).returncode == 0:
        pytest.skip("file permissions are not enforced here")


@pytest.fixture
def run(tmp_path):
    """A finished run (its checkpoint at step 2 of 2), writable again after the test."""
    run = tmp_path / "run"
    saved_checkpoint(run, 2)
    dump_config(load_config(None, ["model.path=m", "train.steps=2"]), run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "logs").mkdir()
    (run / "logs" / "server-0.log").write_text("the first start\n")
    (run / ".lock").touch()
    yield run
    for p in [tmp_path, *tmp_path.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# What a start does in the run directory before anything else: lock it, decide what to do.
START = """
import sys
from pathlib import Path
from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.train.run_dir import RunDirLock, prepare

run, lock = Path(sys.argv[1]), None
try:
    lock = RunDirLock(run).acquire()
    prepare(run, True, load_config(None, ["model.path=m", "train.steps=4"]), False)
except UserError as e:
    print(e)
finally:
    if lock is not None:
        lock.release()  # (as a refused start lets it go)
"""


@pytest.mark.parametrize("where", [".", "logs", "logs/server-0.log", "checkpoints/step_2"])
def test_a_run_dir_a_start_cannot_write_is_one_line_naming_the_path(run, where):
    read_only(run / where)
    before = files(run)
    done = unprivileged(sys.executable, "-c", START, str(run))
    named = run / ".lock" if where == "." else run / where
    assert done.returncode == 0 and done.stdout == (
        f"cannot write {named} (Permission denied): a run writes its checkpoints, metrics and "
        f"logs in its --run-dir; nothing was changed: make it writable (chmod -R u+w {run}) and "
        "run the command again, or pass --run-dir NEW_DIR\n"
    ), done.stdout + done.stderr
    assert files(run) == before


@pytest.mark.parametrize("lock", [True, False])
def test_a_read_only_finished_run_still_says_nothing_to_train(run, lock):
    """The answer reads the files only (the lock taken shared through a read-only file, or
    none where there is no lock file: no trainer holds the directory), so it needs no write."""
    if not lock:
        (run / ".lock").unlink()
    dump_config(load_config(None, ["model.path=m", "train.steps=2"]), run.parent / "run.yaml")
    read_only(run)
    before = files(run)
    done = unprivileged(sys.executable, "-m", "megatron_gspo", "train", "--config",
                        str(run.parent / "run.yaml"), "--run-dir", str(run), "--resume")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{run} is at step 2 of 2 (train.steps): nothing to train")
    assert files(run) == before


SERVERS = """
import sys
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.launcher import ServerGroup
from megatron_gspo.rollout.server_config import ServerConfig

group = ServerGroup([ServerConfig(model_path="m")] * 2, sys.argv[1], monitor=False)
try:
    group.start()
except UserError as e:
    print(e)
"""


def test_a_server_log_that_cannot_be_written_is_one_line_before_any_server_starts(run):
    log = run / "logs" / "server-1.log"
    log.write_text("")
    read_only(log)
    done = unprivileged(sys.executable, "-c", SERVERS, str(run / "logs"))
    assert done.returncode == 0 and done.stdout == (
        f"cannot write the server log {log} (Permission denied); make it and {log.parent} "
        "writable and start again\n"
    ), done.stdout + done.stderr
    assert (run / "logs" / "server-0.log").read_text() == "the first start\n"  # none started
