"""The run directory a trainer owns (train/run_dir.py): the lock, what a start does with an
earlier attempt's files, and the config check of --resume."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.cli import ALLOW_WITHOUT_RESUME
from megatron_gspo.config import dump_config, load_config
from megatron_gspo.errors import UserError
from megatron_gspo.train import checkpointing
from megatron_gspo.train import run_dir as rd
from tests.helpers import MEGATRON_METADATA, cli_env

pytestmark = pytest.mark.unit

TRY_LOCK = "import sys, pathlib; from megatron_gspo.train.run_dir import RunDirLock; "
TRY_LOCK += "RunDirLock(pathlib.Path(sys.argv[1])).acquire(); print('locked')"


def try_lock(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TRY_LOCK, str(path)], capture_output=True, text=True
    )


def test_one_process_holds_the_run_dir_until_it_lets_go(tmp_path):
    lock = rd.RunDirLock(tmp_path / "run").acquire()
    other = try_lock(tmp_path / "run")
    assert other.returncode != 0 and f"in use by another trainer (pid {os.getpid()}" in other.stderr
    lock.release()
    assert try_lock(tmp_path / "run").stdout == "locked\n"  # and a killed holder's lock is gone


def _attempt(run):
    """What a run killed before its first checkpoint leaves, and a file of the user's."""
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "server-0.log").write_text("why it died\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "checkpoints" / ".step_1.tmp" / "model").mkdir(parents=True)
    (run / "notes.txt").write_text("mine\n")


def _checkpoint(run, step=1, config=True):
    """Checkpoint step_`step` of `run` as a save leaves it, with the run's config.yaml (cfg())
    where `config` and there is none."""
    if config and not (run / "config.yaml").exists():
        run.mkdir(parents=True, exist_ok=True)
        dump_config(cfg(), run / "config.yaml")
    d = run / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text("{}")
    (d / "model").mkdir()
    (d / "model" / "shard.distcp").write_bytes(bytes(range(256)) * 16)
    (d / "model" / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    checkpointing.write_manifest(d)
    return d


def _tree(root: Path) -> list:
    return sorted((p.relative_to(root), p.stat().st_size) for p in root.rglob("*"))


def cfg(*overrides):
    return load_config(None, ["model.path=m", *overrides])


@pytest.mark.parametrize("resume", [False, True])
def test_an_attempt_without_checkpoint_starts_again(tmp_path, capsys, resume):
    run = tmp_path / "run"
    _attempt(run)
    before = _tree(run)
    plan = rd.prepare(run, resume, cfg(), False)
    assert plan.checkpoint is None and _tree(run) == before  # decided, nothing done yet
    plan.carry_out(run)
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "moved metrics.jsonl to aborted/1/" in line
    assert "deleted checkpoints/ (incomplete" in line and "logs/ goes on" in line
    assert (run / "aborted/1/metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (run / "logs/server-0.log").read_text() == "why it died\n"  # appended to, by all
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert (run / "notes.txt").read_text() == "mine\n"  # not ours: left alone
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # and once more
    rd.prepare(run, resume, cfg(), False).carry_out(run)
    assert (run / "aborted/2").is_dir()


def test_resume_in_an_empty_dir_starts_the_run(tmp_path, capsys):
    assert rd.prepare(tmp_path, True, cfg(), False) == rd.StartPlan()
    assert capsys.readouterr().out == f"--resume: no checkpoint in {tmp_path}: starting a new run\n"
    # a directory this start made (a mistyped --run-dir, say): the line says it did not exist
    assert rd.prepare(tmp_path, True, cfg(), False, new=True) == rd.StartPlan()
    assert capsys.readouterr().out == (
        f"--resume: {tmp_path} did not exist, so there is no checkpoint in it: starting a new "
        "run there (to continue an earlier run, pass its --run-dir)\n"
    )
    rd.prepare(tmp_path, False, cfg(), False, new=True)  # (without --resume: nothing to say)
    assert capsys.readouterr().out == ""


def test_a_checkpoint_needs_resume_and_the_same_config(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    dump_config(cfg(), tmp_path / "config.yaml")
    with pytest.raises(UserError, match="pass --resume"):
        rd.prepare(tmp_path, False, cfg(), False)
    free = ("train.steps=99", "logging.console=false", "rollout.urls=[http://a:1]")
    assert rd.prepare(tmp_path, True, cfg(*free), False) == rd.StartPlan(ckpt)
    changed = cfg("algo.loss=grpo", "optim.lr=2e-6", *free)
    with pytest.raises(UserError) as e:
        rd.prepare(tmp_path, True, changed, False)
    assert str(e.value).startswith(
        "--resume with a config that differs from the run's: algo.loss: 'gspo' -> 'grpo', "
        "optim.lr: 1e-06 -> 2e-06; "
    )
    assert "--allow-config-change" in str(e.value) and "\n" not in str(e.value)
    plan = rd.prepare(tmp_path, True, changed, True)
    assert plan.checkpoint == ckpt and not (tmp_path / "config.until_step_1.yaml").exists()
    plan.carry_out(tmp_path)  # once the start's inputs are checked
    assert "resuming with a changed config (algo.loss" in capsys.readouterr().out
    kept = yaml.safe_load((tmp_path / "config.until_step_1.yaml").read_text())
    assert kept["algo"]["loss"] == "gspo"  # the steps so far ran with it

    # Resumed again from the same checkpoint with another change (the first resume saved no
    # checkpoint): the config the steps up to 1 ran with stays config.until_step_1.yaml.
    dump_config(changed, tmp_path / "config.yaml")  # (what the first resume's start wrote)
    plan = rd.prepare(tmp_path, True, cfg("optim.lr=3e-6", *free), True)
    plan.carry_out(tmp_path)
    assert "the run's is kept as config.until_step_1.2.yaml" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "config.until_step_1.yaml").read_text()) == kept
    second = yaml.safe_load((tmp_path / "config.until_step_1.2.yaml").read_text())
    assert second["algo"]["loss"] == "grpo"


def test_a_resume_whose_run_config_is_gone_says_it_was_not_compared(tmp_path, capsys):
    """A run directory whose config.yaml was deleted resumed silently with whatever config was
    given (nothing to compare it with): it still does, and says so."""
    ckpt = _checkpoint(tmp_path)
    (tmp_path / "config.yaml").unlink()
    plan = rd.prepare(tmp_path, True, cfg("algo.loss=grpo"), False)
    assert plan == rd.StartPlan(ckpt, config_missing=True)
    plan.carry_out(tmp_path)
    assert capsys.readouterr().out == (
        f"--resume: {tmp_path / 'config.yaml'} is missing, so this config was not compared with "
        "the run's; resuming with it (written as the run's config.yaml)\n"
    )


def test_a_run_config_edited_into_bad_yaml_is_named_on_resume(tmp_path):
    """The config a run saved, edited by hand into YAML that does not parse, used to end a
    --resume with a yaml ScannerError traceback."""
    _checkpoint(tmp_path)
    (tmp_path / "config.yaml").write_text("model:\n  path: m\nalgo:\n\tloss: grpo\n")
    with pytest.raises(UserError) as e:
        rd.prepare(tmp_path, True, cfg(), False)
    assert str(e.value) == (
        f"{tmp_path / 'config.yaml'}, line 4, column 1: not valid YAML: found character '\\t' "
        "that cannot start any token; indent with spaces, not tabs"
    )


def test_allow_config_change_without_resume_is_refused_before_anything(tmp_path):
    """--allow-config-change lets a resumed run take a changed config; without --resume there
    is no run config to differ from, and the flag used to be accepted without a word."""
    (tmp_path / "model").mkdir()
    root = Path(__file__).resolve().parents[2]
    argv = ["train", "--config", str(root / "configs/tiny_moe_gspo.yaml"), "--run-dir",
            str(tmp_path / "run"), "--allow-config-change", f"model.path={tmp_path / 'model'}"]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "megatron_gspo", *argv], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env=cli_env())  # fmt: skip
    assert (r.returncode, r.stderr) == (2, f"error: {ALLOW_WITHOUT_RESUME}\n")
    assert ALLOW_WITHOUT_RESUME.startswith("--allow-config-change applies only with --resume; ")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_key_added_to_the_code_since_is_no_change():
    old = cfg().to_dict()
    del old["rollout"]["connect_grace_s"]
    assert rd.config_changes(old, cfg()) == []
    old["algo"]["loss"] = "grpo"
    assert rd.config_changes(old, cfg()) == [("algo.loss", "grpo", "gspo")]


def _flip(path, offset=100):
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = bytes(b ^ 0xFF for b in data[offset : offset + 4])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": lambda d: os.truncate(d / "model/shard.distcp", 1000),
    "zeroed shard": lambda d: (d / "model/shard.distcp").write_bytes(bytes(4096)),
    "4 bytes flipped": lambda d: _flip(d / "model/shard.distcp"),
    "garbled state": lambda d: (d / "trainer_state.json").write_text("{]"),
    "manifest lost": lambda d: (d / "manifest.json").unlink(),
    "manifest garbled": lambda d: (d / "manifest.json").write_text('{"files": 3}'),
    "shard lost": lambda d: (d / "model/shard.distcp").unlink(),
    # (issue 49) a manifest that no longer lists the model files, then a truncated shard: it
    # used to verify, load the half shard and fail inside torch
    "model files unlisted": lambda d: _unlist(d, "model/"),
    "a file added": lambda d: (d / "model/extra.distcp").write_bytes(b"x"),
    # a checkpoint that lost its state file used to be taken for no checkpoint: a resume went on
    # from the one before it and the next save deleted it (save's "same step again")
    "state file lost": lambda d: (d / "trainer_state.json").unlink(),
}


def _unlist(d, prefix):
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith(prefix)}
    (d / "manifest.json").write_text(json.dumps(manifest))
    os.truncate(d / "model/shard.distcp", 1000)


def _rewrite(d, rel, change):
    """A file changed and the manifest made anew: the checkpoint verifies."""
    (d / rel).write_text(json.dumps(change(json.loads((d / rel).read_text()))))
    checkpointing.write_manifest(d)


# (issue 49) checkpoints that verify but this version cannot load: they used to fail with a
# traceback from megatron's loader instead of falling back to the one before
UNLOADABLE = {
    "unknown backend": (
        lambda d: _rewrite(d, "model/metadata.json", lambda m: {**m, "sharded_backend": "zarr"}),
        "model/metadata.json names a format this version cannot read (Cannot find a default "
        "strategy for: ('load_sharded', 'zarr', 1))",
    ),
    "unknown version": (
        lambda d: _rewrite(
            d, "model/metadata.json", lambda m: {**m, "sharded_backend_version": 99}
        ),
        "('load_sharded', 'torch_dist', 99)",
    ),
    "metadata keys of another version": (
        lambda d: _rewrite(d, "model/metadata.json", lambda m: {**m, "layout": 2}),
        "model/metadata.json names a format this version cannot read",
    ),
    "no model metadata": (
        lambda d: ((d / "model/metadata.json").unlink(), checkpointing.write_manifest(d)),
        "model/metadata.json is missing",
    ),
    "state no object": (
        lambda d: _rewrite(d, "trainer_state.json", lambda m: [1]),
        "trainer_state.json holds no JSON object",
    ),
}


@pytest.mark.parametrize("damage", UNLOADABLE)
def test_resume_skips_a_checkpoint_that_verifies_but_cannot_be_loaded(tmp_path, capsys, damage):
    good, bad = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    change, problem = UNLOADABLE[damage]
    change(bad)
    assert checkpointing.verify(bad) is None and problem in checkpointing.loadable(bad)
    assert checkpointing.loadable(good) is None
    plan = rd.prepare(tmp_path, True, cfg(), False)
    assert plan.checkpoint == good and bad.exists()  # set aside once the start goes on
    plan.carry_out(tmp_path)
    line = capsys.readouterr().out.strip()
    assert line.startswith("resuming from step_1, the newest checkpoint that verifies; skipped")
    assert "step_2: " in line and problem in line and "\n" not in line
    assert (tmp_path / "checkpoints" / "unverified" / "step_2").is_dir() and not bad.exists()


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_skips_a_checkpoint_that_does_not_verify(tmp_path, capsys, damage):
    good, bad = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    assert checkpointing.verify(bad) is None
    DAMAGE[damage](bad)
    problem = checkpointing.verify(bad)
    assert problem is not None and "\n" not in problem
    plan = rd.prepare(tmp_path, True, cfg(), False)
    assert plan.checkpoint == good and bad.exists()  # set aside once the start goes on
    plan.carry_out(tmp_path)
    line = capsys.readouterr().out.strip()
    assert line.startswith("resuming from step_1, the newest checkpoint that verifies; skipped")
    assert f"step_2: {problem}" in line and "\n" not in line
    kept = tmp_path / "checkpoints" / "unverified" / "step_2"
    assert kept.is_dir() and not bad.exists()  # set aside, not deleted, not counted
    assert checkpointing.saved_checkpoints(tmp_path) == [good]


def test_no_verified_checkpoint_is_an_error_that_changes_nothing(tmp_path):
    ckpt = _checkpoint(tmp_path, 3)
    _flip(ckpt / "model/shard.distcp", 4000)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as e:
        rd.prepare(tmp_path, True, cfg(), False)
    assert "no checkpoint in" in str(e.value) and "step_3: model/shard.distcp does not match" in (
        str(e.value)
    )
    assert "--run-dir NEW_DIR" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_manifest_names_every_file_with_its_sha256(tmp_path):
    d = _checkpoint(tmp_path, 1)
    files = json.loads((d / "manifest.json").read_text())["files"]
    assert sorted(files) == ["model/metadata.json", "model/shard.distcp", "trainer_state.json"]
    data = (d / "model/shard.distcp").read_bytes()
    assert files["model/shard.distcp"] == {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


@pytest.mark.parametrize(
    ("train", "flags"),
    [("builtin:arith", "--task arith"), ("builtin:sortlong", "--preset drift"),
     ("builtin:sortlong20", "--preset drift_long")],
)  # fmt: skip
def test_a_missing_model_path_names_the_command_that_makes_the_tasks_model(tmp_path, train, flags):
    """For a built-in task, the make-task-model command the shipped configs and the study use
    (a preset where one is made for the task: what results.md's studies ran on)."""
    from megatron_gspo.data.task_model import check_model_path

    with pytest.raises(UserError) as e:
        check_model_path(str(tmp_path / "m"), train)
    assert str(e.value).endswith(f"megatron-gspo make-task-model {flags} --out {tmp_path / 'm'}")


@pytest.mark.parametrize("train", ["builtin:arith", "data/train.jsonl"])
def test_a_file_as_model_path_is_named_a_file_not_a_missing_model(tmp_path, train):
    """model.path=README.md: no 'does not exist' and no make-task-model over the file."""
    from megatron_gspo.data.task_model import check_model_path

    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    with pytest.raises(UserError) as e:
        check_model_path(str(readme), train)
    msg = str(e.value)
    assert msg.startswith(f"model.path {readme} is a file, not a model directory")
    assert "config.json" in msg and "does not exist" not in msg and "make-task-model" not in msg
    assert readme.read_text() == "# not a model\n"


def test_checkpoints_that_all_lost_their_state_file_are_refused_and_kept(tmp_path):
    """Every step_N without its trainer_state.json used to read as a run that ended before its
    first checkpoint: the start "started again" and deleted checkpoints/, weights and all."""
    for step in (1, 2, 3):
        (_checkpoint(tmp_path, step) / "trainer_state.json").unlink()
    dump_config(cfg(), tmp_path / "config.yaml")
    before = _tree(tmp_path)
    with pytest.raises(UserError) as e:
        rd.prepare(tmp_path, True, cfg(), False)
    said = str(e.value)
    assert said.startswith(f"no checkpoint in {tmp_path / 'checkpoints'} verifies (step_3: ")
    assert said.count("trainer_state.json is missing") == 3 and "nothing was changed" in said
    assert "\n" not in said
    with pytest.raises(UserError, match=r"\(newest checkpoint: step_3\); pass --resume"):
        rd.prepare(tmp_path, False, cfg(), False)
    assert _tree(tmp_path) == before


def test_starting_again_deletes_only_saves_cut_short(tmp_path, capsys):
    """An attempt without a checkpoint still holding weights (a checkpoint set aside in
    checkpoints/unverified/, the disk sync's versions in weights/) has them moved to aborted/<k>/
    with its record; only a checkpoints/ holding nothing but saves cut short is deleted."""
    run = tmp_path / "run"
    _attempt(run)
    kept = _checkpoint(run, 2, config=False)
    checkpointing.set_aside(run, [kept])
    (run / "weights" / "v3").mkdir(parents=True)
    (run / "weights" / "v3" / "model.safetensors").write_bytes(b"w" * 64)
    set_aside, synced = _tree(run / "checkpoints/unverified"), _tree(run / "weights")
    rd.prepare(run, True, cfg(), False).carry_out(run)
    line = capsys.readouterr().out.strip()
    assert "moved metrics.jsonl, weights, checkpoints to aborted/1/" in line, line
    assert "deleted" not in line
    assert _tree(run / "aborted/1/checkpoints/unverified") == set_aside
    assert _tree(run / "aborted/1/weights") == synced
    assert not (run / "checkpoints").exists() and not (run / "weights").exists()


SAVE = """
import sys, torch
from pathlib import Path
from megatron_gspo.model.parallel import start_process_group
from megatron_gspo.train import checkpointing

class Files:  # writes model/ as Actor.save does (what the files hold is not what is checked)
    def save(self, directory):
        torch.save(torch.arange(4), directory / "weights.pt")

start_process_group()
checkpointing.save(Files(), Path(sys.argv[1]), 2, {"step": 2}, keep=5)
"""


def test_a_save_never_deletes_a_checkpoint_of_its_step_already_there(tmp_path):
    """A step_N the start did not resume from (put back by hand, a copy's) used to be deleted
    by the save of step N ("the same step saved before a crash"): it is moved aside, named."""
    old = _checkpoint(tmp_path, 2)
    files = _tree(old)
    done = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path)], capture_output=True,
                          text=True, env=cli_env(), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = "step_2 was there already: moved to checkpoints/unverified/, not deleted\n"
    assert done.stdout == said
    assert _tree(tmp_path / "checkpoints/unverified/step_2") == files
    new = tmp_path / "checkpoints/step_2"
    assert (new / "model/weights.pt").is_file() and checkpointing.verify(new) is None
