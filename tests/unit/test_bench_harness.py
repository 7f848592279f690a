"""The harness bench/ shares (bench/harness.py), driven by a clock this test controls: each
variant's call advances it by a cost written out here, so every median, ratio and table cell
below is a number worked out by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import harness  # noqa: E402
from harness import Variant, markdown_table, measure  # noqa: E402

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def costs(self, name: str, costs: list[float]):
        """A callable whose k-th call takes costs[k] seconds of this clock."""
        it = iter(costs)

        def fn():
            self.calls.append(name)
            self.now += next(it)

        return fn


def test_interleaved_order_rotates_every_rep():
    assert harness.interleaved(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert harness.interleaved(["a", "b", "c"], 3) == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]
    ]  # fmt: skip


def test_medians_spread_ratios_and_order_from_a_controlled_clock():
    clock = FakeClock()
    # call 0 of each is the warm-up (100 s: must not count); then 3 reps
    a = Variant("a", clock.costs("a", [100.0, 2.0, 4.0, 3.0]))
    b = Variant("b", clock.costs("b", [100.0, 1.0, 1.5, 2.5]))
    res = measure([a, b], reps=3, warmup=1, name="fake", clocks={"seconds": clock})
    assert clock.calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert res.order == ["a", "b", "b", "a", "a", "b"]
    assert res.values("a", "seconds") == [2.0, 4.0, 3.0]
    assert res.values("b", "seconds") == [1.0, 1.5, 2.5]
    assert res.median("a") == 3.0 and res.median("b") == 1.5
    assert res.spread("a") == (2.0, 4.0)
    assert res.ratio("a", "b") == pytest.approx(2.0)
    assert res.paired("a", "b") == pytest.approx([2.0, 4.0 / 1.5, 1.2])
    assert res.ratios == {"a/b:seconds": pytest.approx(2.0)}


def test_a_callable_may_report_its_own_metrics_or_several_samples():
    clock = FakeClock()
    tick = clock.costs("x", [1.0, 1.0])
    own = Variant("own", lambda: (tick(), {"gbps": 5.0})[1])
    steps = iter([[{"step_s": 1.0}, {"step_s": 3.0}], [{"step_s": 2.0}]])
    runs = Variant("runs", lambda: next(steps))
    setups: list[int] = []
    own.setup = lambda: setups.append(1)
    res = measure([own, runs], reps=2, clocks={"seconds": clock})
    assert res.samples["own"] == [{"seconds": 1.0, "gbps": 5.0}] * 2
    assert res.values("runs", "step_s") == [1.0, 3.0, 2.0]  # pooled over the calls
    assert res.median("runs", "step_s") == 2.0
    assert setups == [1, 1]


def test_statistics_helpers():
    assert harness.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    assert harness.iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    assert harness.iqr([1.0, 2.0, 3.0, 4.0]) == (1.75, 3.25)  # numpy's linear interpolation
    assert harness.summarize([{"x": 1.0, "y": 4.0}, {"x": 3.0}, {"x": 2.0}], ["x", "y"]) == {
        "x": 2.0, "y": 0.0
    }  # fmt: skip
    point, lo, hi = harness.bootstrap_ci([5.0] * 7, stat="mean")
    assert (point, lo, hi) == (5.0, 5.0, 5.0)
    point, lo, hi = harness.bootstrap_ci([1.0, 2.0, 3.0, 4.0, 100.0])
    assert point == 3.0 and 1.0 <= lo <= point <= hi <= 100.0


def test_json_schema(tmp_path):
    clock = FakeClock()
    res = measure(
        [Variant("a", clock.costs("a", [2.0, 4.0])), Variant("b", clock.costs("b", [1.0, 1.0]))],
        reps=2, name="fake", params={"size": 3}, clocks={"seconds": clock},
    )  # fmt: skip
    res.ratio("a", "b")
    res.extra["model_gb"] = 1.5
    args = harness.parser("doc", reps=2).parse_args(["--json", str(tmp_path / "r.json")])
    harness.finish(res, args)
    got = json.loads((tmp_path / "r.json").read_text())
    assert set(got) == {"schema", "benchmark", "params", "host", "order", "variants", "ratios",
                        "extra"}  # fmt: skip
    assert got["schema"] == harness.SCHEMA and got["benchmark"] == "fake"
    assert got["params"] == {"size": 3, "reps": 2, "warmup": 0}
    assert got["variants"]["a"] == {
        "samples": {"seconds": [2.0, 4.0]}, "median": {"seconds": 3.0},
        "min": {"seconds": 2.0}, "max": {"seconds": 4.0}, "iqr": {"seconds": [2.5, 3.5]},
    }  # fmt: skip
    assert got["ratios"] == {"a/b:seconds": 3.0}
    assert got["extra"]["model_gb"] == 1.5 and len(got["extra"]["load_average_before"]) == 3
    assert got["host"]["cpus"] >= 1 and got["order"] == ["a", "b", "b", "a"]


def test_table_rows():
    clock = FakeClock()
    res = measure(
        [Variant("a", clock.costs("a", [2.0, 4.0, 3.0])), Variant("b", clock.costs("b", [1.0]))],
        reps=1, clocks={"seconds": clock},
    )  # fmt: skip
    res.add("a", [{"seconds": 4.0}, {"seconds": 3.0}])
    assert res.table({"seconds": "s"}, fmt=".1f") == (
        "| variant | s |\n|---|---|\n| a | 3.0 (2.0-4.0) |\n| b | 1.0 |"
    )
    assert markdown_table(["x", "y"], [["r", 0.123456], ["s", 7]]) == (
        "| x | y |\n|---|---|\n| r | 0.1235 |\n| s | 7 |"
    )


def test_bad_arguments_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="reps must be >= 1"):
        measure([Variant("a", lambda: None)], reps=0)
    with pytest.raises(ValueError, match="variant names repeat"):
        measure([Variant("a", lambda: None), Variant("a", lambda: None)], reps=1)
    ap = harness.parser("d", reps=2, warmup=None, reps_flags=("--rounds", "--reps"), quick="q")
    a = ap.parse_args(["--rounds", "4", "--quick"])
    assert a.reps == 4 and a.quick and not hasattr(a, "warmup")


def test_results_of_several_runs_combine_under_a_prefix():
    clock = FakeClock()
    one = measure([Variant("a", clock.costs("a", [2.0]))], reps=1, clocks={"seconds": clock})
    one.extra["x"] = 1
    res = harness.Result("both")
    res.include(one, "tiny")
    assert res.samples == {"tiny a": [{"seconds": 2.0}]} and res.order == ["tiny a"]
    assert res.extra["tiny"]["x"] == 1


def test_a_process_cpu_time_summed_over_its_threads():
    """`CpuRead` on a child process whose two threads spin for 0.3 s of CPU each (by each
    thread's own clock): read while they are alive, about 0.6 s between two reads; read after
    they ended (they started and ended between the reads, so only the ticks count them), or
    with a thread of the first read gone, None."""
    import subprocess
    import time

    code = (
        "import sys, threading, time\n"
        "def spin(spun, ev):\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.3: pass\n"
        "    spun.wait(); ev.wait()\n"
        "print('ready', flush=True)\n"
        "for _ in range(2):\n"
        "    sys.stdin.readline(); ev, spun = threading.Event(), threading.Barrier(3)\n"
        "    ts = [threading.Thread(target=spin, args=(spun, ev)) for _ in range(2)]\n"
        "    [t.start() for t in ts]; spun.wait(); print('spun', flush=True)\n"
        "    sys.stdin.readline(); ev.set(); [t.join() for t in ts]; print('ended', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip

    def say(line: str, answer: str):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == answer

    def one_thread() -> harness.CpuRead:
        """A read once the ended threads have left /proc (a joined thread's task lingers a
        moment)."""
        for _ in range(500):
            read = harness.CpuRead.of(p.pid)
            if list(read.threads_ns) == [p.pid]:
                return read
            time.sleep(0.01)
        raise AssertionError(f"threads still listed: {read.threads_ns}")

    try:
        assert p.stdout.readline().strip() == "ready"
        before = harness.CpuRead.of(p.pid)
        assert list(before.threads_ns) == [p.pid]  # one thread yet
        say("go", "spun")
        alive = harness.CpuRead.of(p.pid)
        assert len(alive.threads_ns) == 3
        assert 0.55 < before.seconds_to(alive) < 0.7
        say("end", "ended")
        ended = one_thread()
        assert alive.seconds_to(ended) is None  # two threads ended
        say("again", "spun")
        say("end", "ended")
        assert ended.seconds_to(one_thread()) is None  # in the ticks only
    finally:
        p.kill()
        p.wait()
