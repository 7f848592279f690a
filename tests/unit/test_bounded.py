"""The pool that runs the user's code (megatron_gspo/bounded), with real worker processes: every
way a call can end is an outcome of that call alone, the worker of a call that hangs or dies is
killed (with what it started) and replaced, the time limit counts from the call, answers cross
as plain data, and no worker outlives the pool or the process that made it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.bounded import FailureLog, Kind, Pool
from megatron_gspo.bounded.pool import backoff_s

pytestmark = pytest.mark.unit

HANDLER = "tests.unit.user_code:handler"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    p = Pool(HANDLER, "s", workers=2, timeout_s=0.5, limit="test.timeout_s")
    yield p
    p.close()


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(
    "kind, ends, message",
    [
        ("hang", Kind.TIMEOUT, "ran past test.timeout_s (0.5 s)"),
        ("spin", Kind.TIMEOUT, "ran past test.timeout_s (0.5 s)"),
        ("exit", Kind.RAISED, "SystemExit: 3"),
        ("interrupt", Kind.RAISED, "KeyboardInterrupt"),
        ("raise", Kind.RAISED, "RuntimeError: broken"),
        ("die", Kind.DIED, "exited with code 7"),
        ("kill", Kind.DIED, "killed by SIGKILL"),
        ("orphan", Kind.DIED, "exited with code 7"),  # (not a time-out: what it left is no peer)
        ("object", Kind.REFUSED, "returned object, not plain data"),
    ],
)
def test_every_way_a_call_can_end_is_an_outcome_of_that_call_alone(pool, kind, ends, message):
    before = pool.pids()
    t0 = time.monotonic()
    bad, good = pool.submit(kind), pool.submit("ok")
    o = bad.result(timeout=30)
    assert o.kind is ends and o.message.startswith(message), o
    assert time.monotonic() - t0 < 15  # a hang or a spin ends at the limit (not in an hour)
    assert good.result(timeout=30).value["spec"] == "s"  # the other call: answered
    if ends in (Kind.TIMEOUT, Kind.DIED):  # its worker is gone, a new one answers the next call
        assert o.worker >= 0 and all(_gone(p) for p in before if p not in pool.pids())
        assert pool.submit("ok").result(timeout=30).value["spec"] == "s"
    if kind == "raise":
        assert "Traceback (most recent call last)" in o.detail and "misbehave" in o.detail


def test_an_unreadable_exception_or_a_long_answer_fails_that_call_and_its_worker_lives_on():
    """The worker answers for them: its death would end the state it holds (other episodes)."""
    p = Pool(HANDLER, "s", workers=1, timeout_s=5.0, limit="test.timeout_s", max_answer=1000)
    try:
        first = p.submit("ok").result(timeout=60)
        bad = p.submit("unprintable").result(timeout=30)
        long = p.submit("long").result(timeout=30)
        after = p.submit("ok").result(timeout=30)
    finally:
        p.close()
    assert (bad.kind, bad.message) == (Kind.RAISED, "Unprintable")
    assert bad.detail.endswith("Unprintable: <exception str() failed>\n")
    size = len(json.dumps({"value": "x" * 2000}))
    assert (long.kind, long.message) == (
        Kind.REFUSED, f"returned {size} bytes of str, over the limit of 1000; return less"
    )  # fmt: skip
    assert (after.value["pid"], after.incarnation) == (first.value["pid"], first.incarnation)


def test_a_worker_is_the_one_the_kernel_kills_when_memory_runs_out(pool):
    assert pool.submit("oom_score_adj").result(timeout=30).value == "1000"


def test_a_killed_worker_takes_what_it_started_with_it(tmp_path, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("USER_CODE_CALLS", str(calls))
    p = Pool(HANDLER, "s", workers=1, timeout_s=1.0, limit="test.timeout_s")
    try:
        assert p.submit("child").result(timeout=30).kind is Kind.TIMEOUT
        child = json.loads(calls.read_text())["child"]
        assert _gone(child)  # the user's `sleep` went with its worker's process group
    finally:
        p.close()


def test_the_time_limit_counts_from_the_call_not_from_the_queue():
    p = Pool(HANDLER, "s", workers=1, timeout_s=1.0, limit="test.timeout_s")
    try:  # four calls of 0.4 s, one worker: the last waits 1.2 s in the queue, and runs 0.4 s
        outcomes = [f.result(timeout=30) for f in [p.submit("ok", 0.4) for _ in range(4)]]
        assert [o.kind for o in outcomes] == [Kind.VALUE] * 4
    finally:
        p.close()


def test_a_call_pinned_to_a_worker_that_was_replaced_is_lost():
    p = Pool(HANDLER, "s", workers=1, timeout_s=0.5, limit="test.timeout_s")
    try:
        first = p.submit("ok", worker=0).result(timeout=30)
        assert p.submit("hang", worker=0).result(timeout=30).kind is Kind.TIMEOUT
        lost = p.submit("ok", worker=0, incarnation=first.incarnation).result(timeout=30)
        assert lost.kind is Kind.LOST
        assert p.submit("ok", worker=0).result(timeout=30).incarnation == first.incarnation + 1
    finally:
        p.close()


def test_code_that_fails_to_load_fails_every_call_with_its_reason():
    p = Pool(HANDLER, "broken", workers=2, timeout_s=5.0, limit="test.timeout_s")
    try:
        o = p.submit("ok").result(timeout=60)
        assert (o.kind, o.message) == (Kind.START, "no module named 'nothing_here'")
        assert p.raised_at_load
        assert p.submit("ok").result(timeout=5).message == o.message
    finally:
        p.close()


def test_code_slower_to_load_than_the_start_limit_fails_every_call_at_once():
    """A worker whose start passed start_timeout_s used to leave the pool whole: each later
    call started a worker again and waited the whole limit for it. Now it breaks the pool with
    the reason, as code that raises does, and later calls fail at once with that reason."""
    p = Pool(HANDLER, "slow", workers=2, timeout_s=5.0, limit="test.timeout_s",
             start_timeout_s=1.0, start_limit="test.start_timeout_s")  # fmt: skip
    try:
        why = ("a worker did not start within test.start_timeout_s (1 s); raise it if the code "
               "takes longer to load")  # fmt: skip
        assert p.start_error() == why and p.broken == why and not p.raised_at_load
        assert p.wait_ready(timeout_s=30) and p.pids() == []  # (the slow workers were killed)
        t0 = time.monotonic()
        outcomes = [f.result(timeout=30) for f in [p.submit("ok") for _ in range(3)]]
        assert [(o.kind, o.message) for o in outcomes] == [(Kind.START, why)] * 3
        assert time.monotonic() - t0 < 0.5  # (not a 1 s start each)
    finally:
        p.close()


def _until_ok(p: Pool, within_s: float = 30.0) -> list:
    """The outcomes of calls made one after the other until one is answered."""
    outcomes = [p.submit("ok").result(timeout=30)]
    deadline = time.monotonic() + within_s
    while not outcomes[-1].ok and time.monotonic() < deadline:
        time.sleep(0.05)
        outcomes.append(p.submit("ok").result(timeout=30))
    return outcomes


def test_a_slow_restart_fails_its_own_call_only(tmp_path):
    """Once the code has loaded, a restart slowed past start_timeout_s (a machine loaded for a
    moment) fails the call that waited for it: the pool is not broken for the rest of the run."""
    flag = tmp_path / "slow"
    p = Pool(HANDLER, f"slow:{flag}", workers=1, timeout_s=5.0, limit="test.timeout_s",
             start_timeout_s=1.0, start_limit="test.start_timeout_s",
             restart_backoff_s=(0.2, 0.2))  # fmt: skip
    try:
        assert p.start_error() is None and p.submit("ok").result(timeout=30).ok
        flag.touch()
        assert p.submit("die").result(timeout=30).kind == Kind.DIED
        o = p.submit("ok").result(timeout=30)  # waits for the restart, which takes too long
        assert (o.kind, p.broken) == (Kind.START, None), o
        assert "did not start within test.start_timeout_s (1 s)" in o.message
        flag.unlink()
        assert _until_ok(p)[-1].ok  # the next start (past its backoff) loads it again
    finally:
        p.close()


def _loads(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_code_that_fails_to_load_on_a_restart_fails_that_call_and_loads_again_later(
    tmp_path, monkeypatch
):
    """The code loads, its worker dies, and the new worker's load raises (a file missing for a
    moment): that call fails with the load's error, and a later one starts a worker that loads
    it. It used to break the pool: every later call failed at once, for the rest of the run."""
    loads = tmp_path / "loads"
    monkeypatch.setenv("USER_CODE_LOADS", f"{loads}:2")  # (user_code.py: the 2nd load raises)
    p = Pool(HANDLER, "s", workers=1, timeout_s=5.0, limit="test.timeout_s",
             restart_backoff_s=(0.2, 1.0))  # fmt: skip
    try:
        assert p.start_error() is None and p.submit("ok").result(timeout=30).ok
        assert p.submit("die").result(timeout=30).kind is Kind.DIED
        failed = p.submit("ok").result(timeout=30)
        waited, *_, later = _until_ok(p)  # (calls within the 0.2 s backoff fail at once)
        assert later.ok and p.broken is None, later
        assert (failed.kind, failed.message) == (
            Kind.START, "a new worker could not load the code: load 2: data.bin is missing"
        )  # fmt: skip
        assert waited is later or waited.message.startswith(f"{failed.message} (its next start")
        assert _loads(loads) == 3  # the first start, the failed restart, the one that loaded
    finally:
        p.close()


def test_code_that_never_loads_again_fails_the_calls_of_its_worker_alone_without_spinning(
    tmp_path, monkeypatch
):
    """From the third load on, the code raises. Worker 0 dies and cannot start again: calls only
    it can run fail at once, the other worker runs the rest; once both are gone, every call
    fails at once. One load is tried per backoff (here 60 s), not one per call."""
    loads = tmp_path / "loads"
    monkeypatch.setenv("USER_CODE_LOADS", f"{loads}:3+")
    p = Pool(HANDLER, "s", workers=2, timeout_s=5.0, limit="test.timeout_s",
             restart_backoff_s=(60.0, 60.0))  # fmt: skip
    try:
        assert p.wait_ready(timeout_s=60) and p.start_error() is None and _loads(loads) == 2
        assert p.submit("die", worker=0).result(timeout=30).kind is Kind.DIED
        first = p.submit("ok", worker=0).result(timeout=30)  # the restart: load 3 raises
        shared = [p.submit("ok") for _ in range(20)]
        pinned = [p.submit("ok", worker=0) for _ in range(20)]
        assert [f.result(timeout=30).kind for f in shared] == [Kind.VALUE] * 20  # (worker 1)
        assert first.message == "a new worker could not load the code: load 3: data.bin is missing"
        for o in (f.result(timeout=30) for f in pinned):
            assert o.kind is Kind.START and o.message.startswith(f"{first.message} (its next"), o
        assert p.usable() == [1]
        assert p.submit("die", worker=1).result(timeout=30).kind is Kind.DIED
        assert p.submit("ok", worker=1).result(timeout=30).kind is Kind.START  # load 4 raises
        rest = [f.result(timeout=30) for f in [p.submit("ok") for _ in range(20)]]
        assert [o.kind for o in rest] == [Kind.START] * 20 and p.broken is None
        assert _loads(loads) == 4  # over 63 calls: the two starts, one failed restart each
    finally:
        p.close()


def test_a_failed_start_s_backoff_doubles_up_to_its_cap():
    assert [backoff_s(n, 1.0, 60.0) for n in range(9)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_s(100_000, 1.0, 60.0) == 60.0  # (a run that never loads again: no overflow)


@pytest.mark.parametrize("budget", [1000, 1001])  # (one of them cuts in the middle of an é)
def test_a_failure_entry_longer_than_the_whole_budget_is_cut_not_dropped(tmp_path, budget):
    """It was dropped whole: the log then held only the line saying the budget was reached, and
    the failure was nowhere. Now its start is kept, with a line saying how many bytes of it were
    left out; the budget is used, so the next entry is only counted."""
    path = tmp_path / "reward.log"
    log = FailureLog(path, "reward/failed_samples", budget=budget)
    entry = "step 3: reward 'x' raised ValueError: " + "é" * 2000 + "\n"  # (4038 bytes)
    log.write(entry)
    text = path.read_text()  # (strict UTF-8: no character cut in two)
    kept, marker = text.splitlines()
    left_out = len(entry.encode()) - len(kept.encode())
    assert entry.startswith(kept) and kept.startswith("step 3: reward 'x' raised ValueError: é")
    assert marker == (f"[... {left_out} more bytes of this entry left out: it is longer than "
                      f"reward.log's whole budget, {budget} bytes]")  # fmt: skip
    assert budget - 1 <= len(text.encode()) <= budget  # (all of it, but half an é)
    log.write("step 4: small\n")
    *before, last = path.read_text().splitlines()
    assert before == [kept, marker] and log.unwritten == 1
    assert last.endswith(f" reward.log reached {budget} bytes: further failures are not written "
                         "here, only counted (reward/failed_samples in metrics.jsonl)")  # fmt: skip


def test_nothing_is_written_after_the_line_saying_the_budget_was_reached(tmp_path):
    """An entry that did not fit wrote that line; a shorter one after it still fit, and was
    written after the line that said further failures are not."""
    path = tmp_path / "env.log"
    log = FailureLog(path, "env/errors", budget=1000)
    for size in (500, 600, 100):
        log.write("x" * (size - 1) + "\n")
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[-1].endswith("(env/errors in metrics.jsonl)")
    assert log.unwritten == 2


def test_close_kills_the_workers_and_fails_what_is_queued():
    p = Pool(HANDLER, "s", workers=1, timeout_s=60.0, limit="test.timeout_s")
    assert p.submit("ok").result(timeout=30).ok
    pids = p.pids()
    running, queued = p.submit("hang"), p.submit("ok")
    time.sleep(0.2)
    p.close()
    assert running.result(timeout=10).kind is Kind.CLOSED
    assert queued.result(timeout=10).kind is Kind.CLOSED
    assert all(_gone(pid) for pid in pids) and p.pids() == []


TRAINER = """
import sys, time
from megatron_gspo.bounded import Pool
p = Pool("tests.unit.user_code:handler", "s", workers=2, timeout_s=60, limit="t")
futures = [p.submit("ok"), p.submit("ok")]
for f in futures:
    f.result()
p.submit("hang")
print(" ".join(map(str, p.pids())), flush=True)
time.sleep(3600)
"""


def test_the_workers_die_with_the_process_that_made_them():
    """Killed -9, the trainer runs no cleanup: its workers (one in a hung call) still end."""
    proc = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)  # fmt: skip
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert all(_gone(pid) for pid in pids)
