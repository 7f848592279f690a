"""docs/testing.md's table of benchmarks against the benchmarks' own parsers: every
bench/bench_*.py is in it, with the repeats flag it takes (`--reps`, or `--rounds` with `--reps`
as its alias) and `--warmup` exactly where it has one. The parsers are read by running each file
as `__main__` in one child process whose `parse_args` reports the parser's flags and stops."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TESTING_MD = ROOT / "docs" / "testing.md"
ROW = re.compile(r"^\| `bench/(bench_\w+\.py)` \| [^|]+ \| ([^|]+) \| ([^|]+) \|$", re.MULTILINE)
PROBE = r"""
import argparse, json, runpy, sys
root, paths = sys.argv[1], sys.argv[2:]
sys.path[:0] = [root + "/bench", root]
class Parsed(Exception):
    pass
def report(self, *args, **kwargs):
    raise Parsed([[a.option_strings, a.dest] for a in self._actions])
argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = report
found = {}
for path in paths:
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except Parsed as e:
        found[path] = e.args[0]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def bench_flags() -> dict[str, dict[str, list[str]]]:
    """{bench file name: {dest: its option strings}} from each benchmark's real parser."""
    paths = sorted(str(p) for p in (ROOT / "bench").glob("bench_*.py"))
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == len(paths), f"no parser reached in {set(paths) - set(found)}"
    return {Path(p).name: {dest: opts for opts, dest in acts} for p, acts in found.items()}


def documented() -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2].strip(), m[3].strip()) for m in ROW.finditer(TESTING_MD.read_text())}


def test_every_benchmark_is_in_the_table(bench_flags):
    assert set(documented()) == set(bench_flags)


def test_the_table_names_each_benchmarks_repeats_and_warmup_flags(bench_flags):
    table = documented()
    assert table, f"{TESTING_MD.name} has no table of benchmarks"
    for name, (repeats, warmup) in table.items():
        flags = bench_flags[name]
        assert re.findall(r"`(--[\w-]+)`", repeats) == flags["reps"], name
        assert warmup.startswith("`--warmup`") == ("warmup" in flags), name
        assert flags.get("warmup", ["--warmup"]) == ["--warmup"], name
        assert flags["json"] == ["--json"], name
