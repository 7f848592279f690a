"""`megatron-gspo train` end to end: the four tiny configs, exact resume after kill -9, and the
errors a user meets first (typos, a broken reward plugin, a server that will not start)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

from megatron_gspo.train.metric_defs import undefined
from tests.helpers import QUICK_TRAIN, StepGate, cli_env, torchrun

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
# Every sync is checked: the servers' probe log-probs must be the trainer's (else the run fails).
QUICK = [*QUICK_TRAIN, "sync.verify_every=1"]


@pytest.fixture(scope="module")
def task_model(tmp_path_factory) -> Path:
    from megatron_gspo.data.warmstart import make_task_model

    # Mechanics only (learning is checked by the quickstart run): a short warm start.
    out = tmp_path_factory.mktemp("task") / "model"
    return make_task_model(out, seed=0, clean_steps=30, sloppy_steps=10)


def train(config: str, run_dir: Path, model: Path, *extra: str, steps: int = 2, wait=True):
    cmd = [
        sys.executable,
        "-m",
        "megatron_gspo",
        "train",
        "--config",
        str(ROOT / "configs" / config),
    ]
    cmd += ["--run-dir", str(run_dir), "--steps", str(steps), f"model.path={model}", *QUICK, *extra]
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cli_env(), cwd=ROOT)
    if not wait:
        return proc
    proc.wait(timeout=600)
    return proc.returncode, Path(log.name).read_text()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "config",
    ["tiny_moe_gspo.yaml", "tiny_moe_grpo.yaml", "tiny_moe_grpo_r2.yaml", "tiny_moe_grpo_r3.yaml"],
)
def test_tiny_config_runs(config, task_model, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = train(config, run_dir, task_model)
    assert rc == 0, out[-3000:]
    # the console is for the run's own lines: no library warnings (megatron's cuda_graph_scope
    # deprecation and its optimizer's grad-access warning used to print on every run)
    assert "Warning" not in out, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "eval/reward", "weight_version"}
    for r in rows:  # every key is in the glossary (train/metric_defs.py -> docs/metrics.md)
        assert not undefined(r), undefined(r)
    for r in rows[1:]:
        for key in ("reward/mean", "loss/policy", "grad_norm", "lr", "ratio/mean", "ratio/std",
                    "ratio/max", "ratio/clip_fraction_tokens", "ratio/clip_fraction_seqs",
                    "kl/old", "entropy", "response/length_mean", "mismatch/logprob_abs_diff",
                    "time/rollout_s", "time/train_s", "time/sync_s", "time/step_s",
                    "tokens_per_s"):  # fmt: skip
            assert key in r, (key, sorted(r))
        assert r["weight_version"] == r["step"]
        assert 0.0 <= r["reward/mean"] <= 1.0
        # synchronous: the server (by its own busy time, its engine thread's CPU seconds)
        # idles while the trainer trains (the 0.5: its last pass may end after its answer)
        assert 0.5 * r["time/train_s"] <= r["time/servers_idle_s"] <= r["time/step_s"], r
    assert "eval/reward" in rows[2]
    # The rollout servers hold the trainer's weights: the first update's ratio is exactly 1
    # only if the old log-probs are the trainer's; the train-vs-rollout gap is small but real.
    assert rows[1]["mismatch/logprob_abs_diff"] < 1e-3
    agreement = [r for r in rows[1:] if "routing/rollout_train_agreement" in r]
    assert bool(agreement) == (config == "tiny_moe_grpo_r3.yaml")
    assert (run_dir / "checkpoints" / "step_2" / "trainer_state.json").is_file()
    assert (run_dir / "config.yaml").is_file()
    assert not list((run_dir / "checkpoints").glob(".*tmp"))
    # the same run with padded microbatches (train.pack=false): the same steps
    padded_dir = tmp_path / "padded"
    rc, out = train(config, padded_dir, task_model, "train.pack=false")
    assert rc == 0, out[-3000:]
    assert_same_metrics(rows, metrics(padded_dir))


SAME = ("reward/mean", "loss/policy", "grad_norm", "ratio/mean", "ratio/max", "kl/old", "entropy",
        "ratio/clip_fraction_tokens", "response/length_mean")  # fmt: skip


def assert_same_metrics(packed: list[dict], padded: list[dict]) -> None:
    """Packed and padded runs: the same rollouts (the same weights drew them) and the same
    updates to float rounding (1e-5 relative; a clip fraction may not move a whole token)."""
    assert [r["step"] for r in packed] == [r["step"] for r in padded]
    for p, q in zip(packed[1:], padded[1:]):
        for key in SAME:
            assert p[key] == pytest.approx(q[key], rel=1e-5, abs=1e-7), (p["step"], key)
        assert p["train/padding_fraction"] == 0.0 < q["train/padding_fraction"]


def test_bf16_servers_open_a_train_inference_gap_that_r3_measures(task_model, tmp_path):
    """rollout.dtype=bfloat16 against the fp32 trainer: the gap is bf16-sized, some routing
    differs between server and trainer, and the gap is split by that agreement."""
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_grpo_r3.yaml", run_dir, task_model, "rollout.dtype=bfloat16")
    assert rc == 0, out[-3000:]  # every sync verified, at bf16's tolerance
    for r in metrics(run_dir)[1:]:
        assert 1e-4 < r["mismatch/logprob_abs_diff"] < 0.5, r["mismatch/logprob_abs_diff"]
        assert 0.5 < r["routing/rollout_train_agreement"] <= 1.0
        assert "mismatch/logprob_abs_diff_routing_same" in r


def test_bf16_trainer_trains_checkpoints_and_resumes(task_model, tmp_path):
    run_dir = tmp_path / "run"
    bf16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16", "sync.verify_every=0",
            "train.checkpoint_every=1")  # fmt: skip
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, *bf16, steps=1)
    assert rc == 0, out[-3000:]
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, *bf16, "--resume", steps=2)
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # (this weak start may draw all-equal rewards: zero advantages)
        assert 0.0 <= r["grad_norm"] < 1e3 and abs(r["loss/policy"]) < 1e3, r
        assert r["mismatch/logprob_abs_diff"] < 0.5  # bf16 on both sides: rounding apart

    steps = 4
    ref = tmp_path / "ref"
    rc, out = train("tiny_moe_gspo.yaml", ref, task_model, "train.checkpoint_every=1", steps=steps)
    assert rc == 0, out[-3000:]

    run = tmp_path / "killed"
    gate = StepGate(tmp_path / "gate", run, after=2)  # holds the run inside step 3
    proc = train("tiny_moe_gspo.yaml", run, task_model, "train.checkpoint_every=1",
                 gate.override, steps=steps, wait=False)  # fmt: skip
    _wait_for(lambda: gate.holding, proc)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)  # no handler, no atexit: servers die with their parent
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [" ".join(p.cmdline())[:200] for p in alive]  # nothing left behind
    gate.open()
    rc, out = train("tiny_moe_gspo.yaml", run, task_model, "--resume",
                    "train.checkpoint_every=1", gate.override, steps=steps)  # fmt: skip
    assert rc == 0, out[-3000:]
    got, want = metrics(run), metrics(ref)
    assert [r["step"] for r in got] == list(range(steps + 1))
    for g, w in zip(got, want):
        for key in ("reward/mean", "loss/policy", "grad_norm", "eval/reward", "ratio/max"):
            assert g.get(key) == w.get(key), (g["step"], key, g.get(key), w.get(key))


def _wait_for(cond, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def server_process(proc, run_dir: Path, k: int = 0) -> psutil.Process:
    """Rollout server k of the run `proc` (its built-in server process, by the port in its log)."""
    port = (run_dir / "logs" / f"server-{k}.log").read_text().split("--port ")[1].split()[0]
    [server] = [
        p for p in psutil.Process(proc.pid).children(recursive=True)
        if "megatron_gspo.server" in " ".join(p.cmdline()) and port in p.cmdline()
    ]  # fmt: skip
    return server


def test_run_dir_without_a_checkpoint_starts_again_with_either_command(task_model, tmp_path):
    """An attempt that ended before its first checkpoint (here --steps 0; a kill, a failing
    reward plugin alike) used to leave a directory neither a plain rerun nor --resume would
    take. Now either starts it again, its files moved to aborted/<k>/; a run with a checkpoint
    still needs --resume, and --resume refuses a config that computes something else. --resume
    on a directory that does not exist starts a new run and says so (a mistyped --run-dir)."""
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume", steps=0)
    assert rc == 0, out[-3000:]
    assert f"--resume: {run_dir} did not exist, so there is no checkpoint in it" in out
    assert [r["step"] for r in metrics(run_dir)] == [0] and not (run_dir / "checkpoints").exists()
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, steps=0)  # plain: starts again
    assert rc == 0 and "the run starts again: moved metrics.jsonl" in out, out[-3000:]
    assert (run_dir / "aborted" / "1" / "metrics.jsonl").is_file()
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume", steps=1)
    assert rc == 0 and "to aborted/2/" in out, out[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [0, 1]
    before = (run_dir / "metrics.jsonl").read_text(), (run_dir / "config.yaml").read_text()

    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, steps=2)
    assert rc == 2 and "pass --resume" in error_lines(out)[-1], out[-3000:]
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume", "algo.loss=grpo",
                    "train.steps=7")  # fmt: skip
    error = error_lines(out)[-1]  # (the log holds every attempt on this run directory)
    assert rc == 2 and "algo.loss: 'gspo' -> 'grpo'" in error and "--allow-config-change" in error
    assert "train.steps" not in error  # --resume may change it freely (and logging.*)
    assert (
        (run_dir / "metrics.jsonl").read_text(),
        (run_dir / "config.yaml").read_text(),
    ) == before
    # A changed config allowed, then refused on its dataset: the run's config stays the run's.
    missing = tmp_path / "none.jsonl"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume",
                    "--allow-config-change", "algo.loss=grpo", f"data.train={missing}")  # fmt: skip
    assert rc == 2 and str(missing) in error_lines(out)[-1], out[-3000:]
    assert (run_dir / "config.yaml").read_text() == before[1]
    assert not list(run_dir.glob("config.until_*"))
    # Another model's shapes (a changed model.path): one line, not torch's CheckpointException
    # (a BaseException) traceback, and the checkpoint loads before anything is written.
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    other = make_tiny_model(TinySpec(moe_ffn=48), tmp_path / "other")
    seen = len((tmp_path / "run.log").read_text())
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume",
                    "--allow-config-change", f"model.path={other}")  # fmt: skip
    error = error_lines(out)[-1]
    assert rc == 2 and "Traceback" not in out[seen:], out[seen:][-3000:]
    assert error.startswith(f"error: cannot load checkpoint {run_dir / 'checkpoints' / 'step_1'} (")
    assert "Global shape mismatch" in error and "resume with the run's" in error
    assert (run_dir / "config.yaml").read_text() == before[1]
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume", steps=2)
    assert rc == 0 and [r["step"] for r in metrics(run_dir)] == [0, 1, 2], out[-3000:]


def files(root: Path) -> dict[str, bytes]:
    """Every file under root but the lock and the logs (which each start appends to)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock" and "logs" not in p.relative_to(root).parts
    }


def test_resume_of_a_finished_run_says_so_before_any_server_or_model_starts(task_model, tmp_path):
    """--resume on a run at its last step used to start the rollout servers, build the model and
    load the checkpoint before it said there was nothing to train. Now it says so first, on every
    layout (under torchrun every rank ends, rank 0 says it once): the server's log has no new
    start in it (each start of a server appends a header to it), and nothing in the run
    directory changed. A config --resume refuses is still refused, before anything starts too."""
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, steps=2)
    assert rc == 0, out[-3000:]
    server_log = run_dir / "logs" / "server-0.log"
    started = server_log.read_bytes()
    assert started.count(b"==== ") == 1  # the one start of the run's server
    before = files(run_dir)

    def resume(*extra: str, nproc: int = 1) -> tuple[int, str, str]:
        config = str(ROOT / "configs" / "tiny_moe_gspo.yaml")
        args = ["-m", "megatron_gspo", "train", "--config", config, "--run-dir", str(run_dir),
                "--resume", f"model.path={task_model}", *QUICK, *extra]  # fmt: skip
        cmd = [sys.executable, *args] if nproc == 1 else torchrun(nproc, *args)
        done = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                              timeout=600)  # fmt: skip
        assert server_log.read_bytes() == started, done.stdout[-3000:]  # no server started
        assert files(run_dir) == before and os.listdir(run_dir / "logs") == ["server-0.log"]
        return done.returncode, done.stdout, done.stderr

    rc, out, err = resume("--steps", "2", nproc=2)
    said = f"{run_dir} is at step 2 of 2 (--steps): nothing to train; pass --steps N with N > 2"
    assert rc == 0 and out.count(said) == 1 and not error_lines(err), (out + err)[-3000:]
    rc, out, err = resume("--steps", "1")
    said = f"{run_dir} is at step 2, past step 1 (--steps): nothing to train; pass --steps N"
    assert rc == 0 and said in out, (out + err)[-3000:]
    rc, out, err = resume("--steps", "2", "algo.loss=grpo", nproc=2)
    assert rc != 0 and "error: --resume with a config that differs" in err, (out + err)[-3000:]
    assert "nothing to train" not in out


def test_second_trainer_on_a_run_dir_is_refused(task_model, tmp_path):
    """The first trainer has far more steps than the second needs to start and be refused (a
    short first run could end, and free the lock, before the second looks: a race, not a
    refusal); it is killed afterwards, and its metrics are its own alone."""
    run_dir = tmp_path / "run"
    first = train("tiny_moe_gspo.yaml", run_dir, task_model, "train.steps=1000", steps=1000,
                  wait=False)  # fmt: skip
    try:
        _wait_for(lambda: (run_dir / ".lock").is_file() and (run_dir / ".lock").read_text(), first)
        rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume")
        assert first.poll() is None, "the first trainer ended before the second was refused"
        # The server the first trainer started has a key only that trainer knows.
        server_log = run_dir / "logs" / "server-0.log"
        _wait_for(lambda: server_log.is_file() and " on http" in server_log.read_text(), first)
        log = server_log.read_text()
        assert "api-key" not in log and "API_KEY" not in log
        url = log.split(" on ", 1)[1].split()[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + "/get_model_info", timeout=10)
        assert refused.value.code == 401
        _wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), first)  # (checked below)
    finally:
        first.kill()
        first.wait(timeout=60)
    assert rc == 2 and error_lines(out) == [  # (both write the same log)
        f"error: {run_dir} is in use by another trainer (pid {first.pid} on {os.uname()[1]}); "
        "wait for it to end or stop it, or pass --run-dir NEW_DIR"
    ], out[-3000:]
    from megatron_gspo.train.metrics import read_metrics  # (a torn last line is skipped)

    steps = [r["step"] for r in read_metrics(run_dir)]  # the first run's, each once, in order
    assert steps == list(range(len(steps)))


def test_broken_rows_and_a_dead_rollout_url_fail_fast(task_model, tmp_path):
    rows = [json.dumps({"prompt": f"{i} + 1 =", "answer": i + 1}) for i in range(18)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join([*rows, "{not json", '{"prompt": ""}', "[1]"]) + "\n")
    use = [f"data.train={data}", f"data.eval={data}"]
    rc, out = train("tiny_moe_gspo.yaml", tmp_path / "a", task_model, *use)
    [error] = error_lines(out)
    assert rc == 2 and "3 of 21 rows are broken (more than 10%)" in error, out[-3000:]
    assert not (tmp_path / "a").exists()  # a refused dataset leaves no run directory
    data.write_text("\n".join([*rows, "{not json"]) + "\n")
    from megatron_gspo.comm import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    rc, out = train(
        "tiny_moe_gspo.yaml", tmp_path / "b", task_model, *use, f"rollout.urls=[{dead}]"
    )
    took = time.monotonic() - t0
    [error] = error_lines(out)
    assert rc == 2 and f"nothing answers at {dead}" in error and "rollout.urls" in error, out
    assert f"data.train {data}: skipped 1 broken row of 19" in out
    assert took < 60  # rollout.connect_grace_s (15 s) after start-up, not the 300 s health timeout
    print(f"dead rollout.urls: error after {took:.1f} s")


@contextlib.contextmanager
def faulty_server(model: Path, fault: str, key: str):
    """The built-in server with one injected fault (tests/e2e/faulty_server.py); its URL."""
    cmd = [sys.executable, "-m", "tests.e2e.faulty_server", fault, "--model", str(model),
           "--port", "0", "--threads", "1", "--api-key", key]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert " on http://127.0.0.1:" in line, f"server did not start: {line!r}"
        yield line.split()[-1]
    finally:
        server.kill()
        server.wait(timeout=60)


def test_a_server_sending_nan_logprobs_stops_the_run_before_it_trains(
    task_model, tmp_path, monkeypatch
):
    """rollout.urls at a server whose /generate answers NaN log-probs: the run used to train
    its steps on them (the NaNs read as "no log-prob" in the batch); now its first answer stops
    it with one line naming the server."""
    monkeypatch.setenv("MEGATRON_GSPO_API_KEY", "k" * 32)
    with faulty_server(task_model, "nan", "k" * 32) as url:
        rc, out = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model, f"rollout.urls=[{url}]")
    [error] = error_lines(out)
    assert rc == 2 and error.startswith(f"error: {url}/generate answered output_token_logprobs["), (
        out
    )
    assert (
        "] = [NaN, " in error and "; a log-prob is a number <= 0; check that rollout.urls" in error
    )
    assert "Traceback" not in out
    logged = tmp_path / "run" / "metrics.jsonl"
    assert not logged.exists() or all(
        r["step"] == 0 for r in metrics(tmp_path / "run")
    )  # untrained


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_server_that_keeps_the_old_weights_stops_the_run(
    task_model, tmp_path, monkeypatch, ahead
):
    """rollout.urls at a server whose answers always name the base weights (one that does not
    take updates, or a cache in front of one): every step after the first used to drop all its
    groups as stale, generate twice more, train nothing, and the run ended with exit 0. (The
    sync's verification, off by default, catches it apart.) The same with the batches generated
    a step ahead (rollout.max_staleness=1), where every step from the third trained nothing
    (its batch, queued on version 1, came back all from the base weights) and nothing was
    generated again: that batch is now generated again from the trainer's weights, with the
    same catch-ups, and the run stops on the same line a step later."""
    monkeypatch.setenv("MEGATRON_GSPO_API_KEY", "k" * 32)
    with faulty_server(task_model, "old_version", "k" * 32) as url:
        rc, out = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model, f"rollout.urls=[{url}]",
                        "sync.verify_every=0", f"rollout.max_staleness={ahead}",
                        steps=2 + ahead)  # fmt: skip
    assert rc == 2 and error_lines(out) == [
        f"error: step {2 + ahead}: every rollout sample came from weights older than the "
        f"trainer's (version {1 + ahead}; the servers answered weight_version 'default'), 3 "
        "times with the servers caught up in between: they do not load the weights the trainer "
        "sends, or do not report them; check that rollout.urls points at SGLang-compatible "
        "servers of this run (not a cache or a server another run updates)"
    ], out[-3000:]
    rows = metrics(tmp_path / "run")  # the step that stopped trained nothing
    assert [r["step"] for r in rows] == list(range(2 + ahead))
    assert all(r["rollout/stale_samples"] == 0 for r in rows[1:])  # (trained: none stale)


def test_a_server_that_refuses_the_weights_stops_the_run_in_one_line(task_model, tmp_path):
    """rollout.urls at a server started here without --api-key refuses the tensor transport's
    shared memory with a 400 that names the fix: the run used to end on a WeightSyncError
    traceback (exit 1) with the report over four lines."""
    from tests.e2e.server_process import running_server

    with running_server(task_model) as url:
        rc, out = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model, f"rollout.urls=[{url}]")
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    [error] = error_lines(out)
    assert error.startswith(
        f"error: weight sync to version '1' (tensor) failed: server {url}: {url}: "
        "/update_weights_from_tensor answered HTTP 400: weight payload refers to shared memory"
    ), error
    assert "start it with --api-key KEY" in error
    assert error.endswith(f"; servers now: {url} = default (restored); fix what the servers say "
                          "(their logs say more), then run again (--resume goes on from the last "
                          "checkpoint)")  # fmt: skip


def _flip_each_tensor_file(directory: Path) -> list[str]:
    """4 bytes flipped in the middle of every model/optimizer shard: the damage that used to load
    silently and train NaN."""
    names = []
    for f in sorted(directory.rglob("*.distcp")):
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
        f.write_bytes(bytes(data))
        names.append(f.name)
    return names


def test_resume_skips_a_corrupt_checkpoint_and_trains_on_the_last_good_one(task_model, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "train.checkpoint_every=1")
    assert rc == 0, out[-3000:]
    step2 = run_dir / "checkpoints" / "step_2"
    assert _flip_each_tensor_file(step2 / "model")
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, "--resume",
                    "train.checkpoint_every=1", steps=3)  # fmt: skip
    assert rc == 0, out[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("resuming from step_1"))
    assert "skipped step_2: model/" in line and "does not match its checksum" in line, line
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 2 trained again, from step_1
    assert all(np.isfinite(r["loss/policy"]) and np.isfinite(r["grad_norm"]) for r in rows[1:])
    assert (run_dir / "checkpoints" / "unverified" / "step_2" / "manifest.json").is_file()
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert done == ["step_2", "step_3"]  # keep_checkpoints=2: step_1 rotated out only now


# The injected fault: from the first checkpoint on, the policy loss is NaN (in the trainer only;
# the servers and everything else run as they are).
POISON = """
import sys
from pathlib import Path
import megatron_gspo.train.actor as actor
from megatron_gspo.cli import main

real, trigger = actor.policy_loss, Path(sys.argv.pop(1))

def poisoned(*args, **kwargs):
    value, stats = real(*args, **kwargs)
    return (value * float("nan") if trigger.exists() else value), stats

actor.policy_loss = poisoned
main()
"""


def test_a_run_that_goes_non_finite_skips_updates_then_stops_without_checkpoints(
    task_model, tmp_path
):
    """A NaN loss from step 2 on: each such step skips its update and writes no checkpoint,
    and the third in a row ends the run with one line; step_1 is intact."""
    run_dir, script = tmp_path / "run", tmp_path / "poison.py"
    script.write_text(POISON)
    cmd = [sys.executable, str(script), str(run_dir / "checkpoints" / "step_1"), "train",
           "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run_dir),
           "--steps", "6", f"model.path={task_model}", *QUICK, "train.checkpoint_every=1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=600)
    errors = error_lines(out.stdout + out.stderr)
    assert out.returncode == 2 and errors == [
        "error: training is not finite: 3 steps in a row up to step 4 had loss/policy nan, "
        "grad_norm nan; their updates were skipped and no checkpoint was written since; lower "
        "optim.lr (or optim.clip_grad), check the data and rewards, then --resume from the last "
        "checkpoint (the limit is train.max_nonfinite_steps=3)"
    ], (out.stdout + out.stderr)[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["update/nonfinite"] for r in rows[1:]] == [0.0, 1.0, 1.0, 1.0]
    assert [r["update/skipped"] for r in rows[1:]] == [0.0, 1.0, 1.0, 1.0]
    assert [r["grad_norm"] for r in rows[2:]] == [
        "NaN"
    ] * 3  # (written as a string: JSON has no NaN)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    from megatron_gspo.train import checkpointing

    assert checkpointing.verify(run_dir / "checkpoints" / "step_1") is None


STALE = """
import sys
from pathlib import Path
import torch.distributed as dist
from megatron_gspo.config import load_config
from megatron_gspo.comm import free_port
from contextlib import ExitStack
from megatron_gspo.train.share import rollout_side

config, model, run_dir = sys.argv[1:4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
cfg = load_config(config, [f"model.path={model}", *sys.argv[4:]])
with ExitStack() as stack:
    fleet, rl = rollout_side(cfg, Path(run_dir), Path(model), stack)
    for version in ("default", "7"):  # the servers' (the base model's), and the trainer's step 7
        got = rl.collect([0, 1, 2, 3], step=1, version=version)
        m = got.metrics
        print(version, m["rollout/stale_samples"], m["rollout/stale_groups_dropped"],
              None if got.batch is None else len(got.batch))
dist.destroy_process_group()
"""


def test_samples_from_other_weights_are_dropped_by_group_and_counted(task_model, tmp_path):
    """A server on other weights than the step's (a restart onto an older restore point): its
    samples' groups are dropped and counted, never trained on."""
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    cmd = [sys.executable, str(script), str(ROOT / "configs" / "tiny_moe_gspo.yaml"),
           str(task_model), str(tmp_path / "run"), *QUICK,
           "algo.dynamic_sampling=false"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()[-2:]
    assert lines == ["default 0.0 0.0 16", "7 16.0 4.0 None"], out.stdout[-2000:]


# The injected fault: step 2's sync sends noise in place of its first bucket (a copy: the
# trainer's own weights stay as they are).
CORRUPT = """
import sys
import torch
import megatron_gspo.weight_sync.transports.tensor as transport
from megatron_gspo.cli import main
from megatron_gspo.weight_sync.bucket import Bucket

real = transport.TensorTransport.send

def send(self, bucket, ctx):
    if ctx.version == "2" and bucket.index == 0:
        noise = torch.randn(bucket.nbytes // 4, generator=torch.Generator().manual_seed(0))
        buffer = self.alloc(bucket.nbytes, bucket.flat.device)
        buffer.view(torch.float32).copy_(noise * 0.05)
        bucket = Bucket(bucket.stage, 0, buffer, bucket.nbytes, bucket.metadata, pooled=False)
    return real(self, bucket, ctx)

transport.TensorTransport.send = send
main()
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "bfloat16+fp8"])
def test_verification_passes_16_bit_servers_and_catches_a_corrupt_bucket(task_model, tmp_path,
                                                                          dtype):  # fmt: skip
    """Against a 16-bit server (or one with fp8 weights) the probe differs by rounding alone
    and passes (step 1); a bucket of noise (step 2) fails the run with one line that says what
    differed, by how much, against which tolerance."""
    dtype, _, quantization = dtype.partition("+")
    run_dir, script = tmp_path / "run", tmp_path / "corrupt.py"
    script.write_text(CORRUPT)
    cmd = [sys.executable, str(script), "train",
           "--config", str(ROOT / "configs" / "tiny_moe_gspo.yaml"), "--run-dir", str(run_dir),
           "--steps", "3", f"model.path={task_model}", *QUICK, f"rollout.dtype={dtype}",
           "sync.bucket_mb=0.02"]  # fmt: skip
    cmd += [f"rollout.quantization={quantization}"] if quantization else []
    out = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=600)
    errors = error_lines(out.stdout + out.stderr)
    assert out.returncode == 2 and len(errors) == 1, (out.stdout + out.stderr)[-3000:]
    tol = {"bfloat16": "0.391 (bfloat16's)", "float16": "0.0488 (float16's)"}[dtype]
    tol = "1.5 (fp8's)" if quantization else tol
    assert errors[0].startswith("error: weight sync verification failed: http://127.0.0.1:")
    assert "on average (max " in errors[0] and f"above the tolerance {tol}" in errors[0]
    assert [r["step"] for r in metrics(run_dir)] == [0, 1]  # step 1 synced and verified


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_a_run_dir_that_is_a_file_is_one_line_error(task_model, tmp_path):
    (tmp_path / "afile").write_text("mine\n")
    rc, out = train("tiny_moe_gspo.yaml", tmp_path / "afile", task_model)
    assert rc == 2 and error_lines(out) == [
        f"error: --run-dir {tmp_path / 'afile'} is a file; pass --run-dir NEW_DIR"
    ], out[-2000:]
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_config_typo_is_one_line_error(task_model, tmp_path):
    rc, out = train("tiny_moe_gspo.yaml", tmp_path / "run", task_model, "algo.clip_hihg=0.3")
    assert rc == 2
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert lines == ["error: unknown config key 'algo.clip_hihg'; did you mean 'algo.clip_high'?"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("config", "fix"),
    [
        ("tiny_moe_gspo.yaml", "make arith's starting model there: megatron-gspo make-task-model "
                               "--task arith --out {path}"),
        ("drift_moe_gspo.yaml", "make sortlong's starting model there: megatron-gspo "
                                "make-task-model --preset drift --out {path}"),
        ("qwen3_30b_a3b_gspo.yaml", None),
    ],
)  # fmt: skip
def test_a_missing_model_path_is_one_line_error_naming_how_to_make_it(tmp_path, config, fix):
    """A new user's first command without the starting model: one line that names the command
    making it for a built-in task (what scripts/quickstart.sh runs), nothing written."""
    missing = tmp_path / "no_model"
    rc, out = train(config, tmp_path / "run", missing)
    assert rc == 2, out[-2000:]
    want = f"error: model.path {missing} does not exist: point model.path at an HF or Megatron "
    want += "checkpoint" + ("" if fix is None else ", or " + fix.format(path=missing))
    assert error_lines(out) == [want]
    assert not (tmp_path / "run").exists()


def test_reward_plugin_that_raises(task_model, tmp_path):
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text("def score(prompt, response, answer):\n    raise ValueError('boom')\n")
    run_dir = tmp_path / "run"
    rc, out = _with_pythonpath(tmp_path, lambda: train("tiny_moe_gspo.yaml", run_dir, task_model,
                                                       "reward.fn=bad_reward:score"))  # fmt: skip
    assert rc == 2, out[-2000:]
    assert "bad_reward:score" in out and "boom" in out
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


def test_reward_plugin_failing_on_some_samples_ends_those_samples_not_the_run(task_model,
                                                                             tmp_path):  # fmt: skip
    """Every ninth call raises: the run finishes; each step counts its failed samples and drops
    their groups (a group's baseline needs every sample), and trains on the rest."""
    plugin = tmp_path / "flaky_reward.py"
    plugin.write_text(
        "from megatron_gspo.rewards.exact import exact_answer\n"
        "CALLS = [0]\n"
        "def score(prompt, response, answer):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] % 9 == 0:\n"
        "        raise ValueError('flaky')\n"
        "    return exact_answer(prompt, response, answer)\n"
    )
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model, f"reward.fn={plugin}:score",
                    "rollout.prompts_per_step=8", "train.micro_batch_size=8",
                    "reward.workers=1")  # fmt: skip  # (one worker process counts every call)
    assert rc == 0, out[-3000:]
    assert "the reward failed on" in out and "raised ValueError: flaky" in out
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # 32 samples a step, every ninth call fails (3 or 4 of them: the count runs on)
        assert r["reward/failed_samples"] in (3.0, 4.0), r
        assert 1 <= r["rollout/reward_failed_groups_dropped"] <= r["reward/failed_samples"], r
        assert 0 < r["rollout/samples"] == 32.0 and r["grad_norm"] >= 0.0, r


def _with_pythonpath(path: Path, fn):
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{path}{os.pathsep}{old}" if old else str(path)
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def test_rollout_server_that_will_not_start(task_model, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, task_model,
                    "rollout.extra_server_args=[--no-such-flag]")  # fmt: skip
    assert rc == 2, out[-2000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert errors and "rollout server did not start" in errors[0]
    # the cause, from the server's log, and where the whole log is, in the one line
    assert "unrecognized arguments: --no-such-flag" in errors[0], errors[0]
    assert f"(whole log: {run_dir / 'logs' / 'server-0.log'})" in errors[0], errors[0]


def test_tis_and_lr_warmup_reach_the_step(task_model, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_grpo.yaml", run_dir, task_model, "algo.tis=token",
                    "algo.tis_cap=1.5", "optim.warmup_steps=2", "optim.lr=1e-4",
                    "optim.clip_grad=0")  # fmt: skip
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)[1:]
    # no clipping: megatron gives no norm (or 0); the non-finite check's own one is reported
    assert all(r["grad_norm"] > 0 for r in rows if r["reward/std"] > 0), rows
    assert all(r["update/nonfinite"] == 0 for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([5e-5, 1e-4])
    for r in rows:  # min(pi_old / pi_rollout, 1.5) averaged over tokens: ~1 (tiny mismatch)
        assert 0.9 < r["tis/weight_mean"] <= 1.5, r["tis/weight_mean"]
        assert "mismatch/masked_fraction_tokens" not in r  # (TIS masks nothing: no such key)


@pytest.mark.parametrize("ahead", [(), ("rollout.max_staleness=1", "rollout.partial=true")])
def test_a_rollout_server_killed_mid_run_is_restarted_and_caught_up(task_model, tmp_path, ahead):
    """Two servers; server 0 is killed once step 1 is logged. The syncs leave it out while it
    is down, or fail for it alone if it dies during one, and the run goes on (its supervisor
    restarts it on the base weights); the step after it is back waits for the restart and
    catch_up brings it to the trainer's weights before the rollouts, so all of that step's
    samples come from them. (Back before the next sync, that sync reaches it.) Every sync was
    verified (sync.verify_every=1) on the servers it reached. Also with partial rollouts one
    step ahead: the kill then lands in a generation that overlaps training."""
    run = tmp_path / "run"
    proc = train("tiny_moe_gspo.yaml", run, task_model, "rollout.servers=2", *ahead, steps=4,
                 wait=False)  # fmt: skip
    logged = run / "metrics.jsonl"
    _wait_for(lambda: logged.exists() and '"step": 1,' in logged.read_text(), proc)
    server0 = server_process(proc, run)
    server0.kill()
    assert proc.wait(timeout=600) == 0, (run.parent / "run.log").read_text()[-3000:]
    rows = [r for r in metrics(run) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    events = [(r["sync/failed_servers"], r["sync/caught_up_servers"]) for r in rows]
    # The kill lands some time after step 1 is logged (a loaded machine may run a step or two
    # first): the syncs before it is back leave it out (down) or fail for it alone (it died
    # during one); the first step after it is back catches it up, once, before its rollouts.
    assert events[0] == (0, 0) and all(f in (0, 1) and c in (0, 1) for f, c in events), events
    caught = [k for k, (_, c) in enumerate(events) if c]
    if caught:
        k = caught[0]
        assert caught == [k] and events[k] == (0, 1) and events[k + 1 :] == [(0, 0)] * (3 - k)
        assert sum(f for f, _ in events[:k]) <= 1, events
        assert rows[k]["rollout/stale_samples"] == 0, rows[k]
    else:  # back before the next sync reached it (or it died in the last step's sync)
        assert all(f == 0 for f, _ in events[:-1]), events
    assert "start #1" in (run / "logs" / "server-0.log").read_text()


def test_rollouts_two_steps_ahead_train_two_versions_behind_and_resume_after_kill(
    task_model, tmp_path
):
    """rollout.max_staleness=2: step k's batch is queued in step k-2 and generated on the
    weights of version k-3, as every trained sample's own weight_version says (staleness 0 on
    step 1, 1 on step 2, 2 after). A run killed -9 while step 5's batch is being generated
    (inside step 3) and resumed finishes every step once: the checkpoint keeps the prompt
    sampler before the batches in flight, so the resumed run draws the same prompts (its final
    sampler position is the uninterrupted run's)."""
    steps, ahead = 5, ("rollout.max_staleness=2", "train.checkpoint_every=1")
    ref = tmp_path / "ref"
    rc, out = train("tiny_moe_grpo.yaml", ref, task_model, *ahead, steps=steps)
    assert rc == 0, out[-3000:]
    rows = metrics(ref)
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for r in rows[1:]:
        stale = float(min(r["step"] - 1, 2))
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == stale, r
        assert r["rollout/version_oldest"] == max(0, r["step"] - 3)
        assert r["rollout/partial_fraction"] == 0.0
        assert r["time/trainer_idle_s"] >= 0 and r["time/servers_idle_s"] >= 0
        assert np.isfinite(r["loss/policy"]) and r["weight_version"] == r["step"]

    run = tmp_path / "killed"
    gate = StepGate(tmp_path / "gate", run, after=2)  # holds step 5's generation, in step 3
    proc = train("tiny_moe_grpo.yaml", run, task_model, *ahead, gate.override, steps=steps,
                 wait=False)  # fmt: skip
    _wait_for(lambda: gate.holding, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert (run / "checkpoints" / "step_2").is_dir()
    assert not (run / "checkpoints" / "step_3").exists()  # step 3 waited for the held batch
    gate.open()
    rc, out = train("tiny_moe_grpo.yaml", run, task_model, "--resume", *ahead, gate.override,
                    steps=steps)  # fmt: skip
    assert rc == 0, out[-3000:]
    got = metrics(run)
    assert [r["step"] for r in got] == list(range(steps + 1))
    assert [r["rollout/staleness_max"] for r in got[1:]] == [0.0, 1.0, 0.0, 1.0, 2.0]

    def sampler(d):
        return json.loads((d / "checkpoints" / f"step_{steps}" / "trainer_state.json").read_text())

    assert sampler(run)["sampler"] == sampler(ref)["sampler"]


def test_kl_to_the_reference_is_zero_first_then_grows(task_model, tmp_path):
    """algo.kl_coef > 0 through the loop (one update a step): kl/ref of the first update is 0,
    the policy still the run's start; it grows as the policy moves away; a run without the
    penalty keeps no reference and logs no kl/ref. The same with the KL in the reward
    (algo.kl_in: reward), which logs the penalty taken off the rewards."""
    runs = {}
    arms = {
        "kl": ["algo.kl_coef=0.05"],
        "none": [],
        "reward": ["algo.kl_coef=0.05", "algo.kl_in=reward", "algo.kl_estimator=k1"],
    }
    for name, extra in arms.items():
        run_dir = tmp_path / name
        rc, out = train("tiny_moe_grpo.yaml", run_dir, task_model, "optim.lr=3e-3",
                        "algo.minibatches=1", *extra, steps=3)  # fmt: skip
        assert rc == 0, out[-3000:]
        runs[name] = metrics(run_dir)[1:]
    for name in ("kl", "reward"):
        kl = [r["kl/ref"] for r in runs[name]]
        assert abs(kl[0]) < 1e-6 and abs(kl[-1]) > max(1e-6, abs(kl[0])), (name, kl)
    assert not any("kl/ref" in r for r in runs["none"])
    penalty = [r["kl/reward_penalty"] for r in runs["reward"]]
    assert abs(penalty[0]) < 1e-6 and abs(penalty[-1]) > 1e-6, penalty
    assert not any("kl/reward_penalty" in r for r in runs["kl"])
