"""The measuring harness every benchmark in bench/ shares: variants measured side by side,
warm-up calls, repeats in interleaved order, medians and spread, ratios between variants of the
same run, one JSON schema and a markdown table writer. A benchmark keeps only its measurement:
the set-up, the callables it times and what its table shows.

    result = measure([Variant("ours", f), Variant("limit", g)], reps=5, warmup=1, name="convert")
    result.ratio("ours", "limit", "seconds")      # median(ours) / median(limit), kept for the JSON
    print(result.table({"seconds": "s"}))         # | variant | s | ... markdown rows
    finish(result, args)                          # --json PATH: the machine-readable record

Order: rep r runs the variants rotated by r (A B C, B C A, C A B, ...; with two, A B, B A), so a
change in the machine's load over the run (a shared machine) hits every variant alike, and each
variant runs first as often as the others. Only ratios of variants measured in the same run are
comparable: the absolute numbers move with the machine's load (recorded before and after).

A sample is a dict of metrics. The harness times each call with its clocks (default: wall
seconds, `perf_counter`); a callable may return a dict of metrics of its own (merged over the
clocks' readings: a subprocess that measured itself), or a list of such dicts (several samples
from one call: the steps of one training run)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "megatron-gspo-bench/1"
Sample = dict[str, float]
Clock = Callable[[], float]
WALL: dict[str, Clock] = {"seconds": time.perf_counter}
WALL_AND_CPU: dict[str, Clock] = {"seconds": time.perf_counter, "cpu_s": time.process_time}


# ---- statistics ------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    return float(statistics.median(list(values)))


def spread(values: Iterable[float]) -> tuple[float, float]:
    """(min, max)."""
    xs = list(values)
    return float(min(xs)), float(max(xs))


def iqr(values: Iterable[float]) -> tuple[float, float]:
    """(first quartile, third quartile), linear interpolation between order statistics (numpy's
    default); a single value is both."""
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0]), float(xs[0])
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return float(q1), float(q3)


def summarize(rows: Iterable[Mapping[str, float]], keys: Iterable[str]) -> Sample:
    """The median over `rows` of each of `keys` (0 where a row lacks one): one run's steady-state
    value of each metric, e.g. over its training steps."""
    rows = list(rows)
    return {k: median(r.get(k, 0.0) for r in rows) for k in keys}


def bootstrap_ci(
    values: Sequence[float], stat: str = "median", level: float = 0.95, n: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """(statistic, low, high): `stat` ("median" or "mean") of `values` and a `level` bootstrap
    interval of it (percentiles of the statistic over `n` resamples with replacement, seeded)."""
    fns: dict[str, Callable[[Sequence[float]], float]] = {
        "median": median,
        "mean": statistics.fmean,
    }
    fn = fns[stat]
    rng = random.Random(seed)
    xs = list(values)
    boot = sorted(fn(rng.choices(xs, k=len(xs))) for _ in range(n))
    lo, hi = (1 - level) / 2, (1 + level) / 2
    return float(fn(xs)), _quantile(boot, lo), _quantile(boot, hi)


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = q * (len(sorted_xs) - 1)
    i = int(pos)
    j = min(i + 1, len(sorted_xs) - 1)
    return float(sorted_xs[i] + (sorted_xs[j] - sorted_xs[i]) * (pos - i))


# ---- measuring -------------------------------------------------------------------------------


@dataclass
class Variant:
    """One thing measured side by side: `fn` is timed; `setup` (untimed) runs before each call."""

    name: str
    fn: Callable[[], Any]
    setup: Callable[[], None] | None = None


def interleaved(names: Sequence[str], reps: int) -> list[list[str]]:
    """The order of each rep: the variants rotated by the rep's index."""
    n = len(names)
    return [list(names[r % n :]) + list(names[: r % n]) for r in range(reps)]


def host_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    torch = sys.modules.get("torch")  # (not imported here: a benchmark that needs it has)
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, ended ones too), from /proc: clock ticks of
    10 ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuRead:
    """A process's CPU time at one moment: in clock ticks (`cpu_seconds`), and each live
    thread's in ns (its schedstat), which resolves a run of a tenth of a second."""

    seconds: float
    threads_ns: dict[int, int]

    @classmethod
    def of(cls, pid: int) -> CpuRead:
        threads = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (one ending)
                threads[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        return cls(cpu_seconds(pid), threads)

    def seconds_to(self, later: CpuRead) -> float | None:
        """CPU seconds from this read to `later`, from the threads' ns; None where that is not
        all of it: a thread of this read ended by `later`, or the ticks count more than a tick
        per thread beyond the threads' sum (a thread started and ended between the reads)."""
        if not self.threads_ns.keys() <= later.threads_ns.keys():
            return None
        fine = sum(ns - self.threads_ns.get(t, 0) for t, ns in later.threads_ns.items()) / 1e9
        tick = 1 / os.sysconf("SC_CLK_TCK")
        if later.seconds - self.seconds - fine > (len(later.threads_ns) + 1) * tick:
            return None
        return fine


@dataclass
class Result:
    """Everything one run of a benchmark measured: per variant the samples of each rep in the
    order run; ratios computed from them; `extra` for what is not a variant's sample (a model's
    size, a floor measured once)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=host_info)

    def add(self, variant: str, got: Sample | Sequence[Sample]) -> None:
        """Record a variant's sample (or samples) measured outside `measure`."""
        rows = [got] if isinstance(got, Mapping) else list(got)
        self.samples.setdefault(variant, []).extend(dict(r) for r in rows)
        self.order.append(variant)

    def include(self, other: Result, prefix: str) -> None:
        """Another run's variants, ratios and extras, under "prefix variant" (e.g. one measure per
        model size, one JSON)."""
        for v, rows in other.samples.items():
            self.samples[f"{prefix} {v}"] = [dict(r) for r in rows]
        self.order += [f"{prefix} {v}" for v in other.order]
        self.ratios.update({f"{prefix} {k}": r for k, r in other.ratios.items()})
        self.extra[prefix] = other.extra

    @property
    def variants(self) -> list[str]:
        return list(self.samples)

    def values(self, variant: str, metric: str) -> list[float]:
        return [s[metric] for s in self.samples[variant] if metric in s]

    def median(self, variant: str, metric: str = "seconds") -> float:
        return median(self.values(variant, metric))

    def spread(self, variant: str, metric: str = "seconds") -> tuple[float, float]:
        return spread(self.values(variant, metric))

    def medians(self, variant: str) -> Sample:
        return {m: self.median(variant, m) for m in self.metrics(variant)}

    def metrics(self, variant: str) -> list[str]:
        return list(dict.fromkeys(k for s in self.samples[variant] for k in s))

    def ratio(self, num: str, den: str, metric: str = "seconds") -> float:
        """median(num) / median(den) of `metric`, kept under "num/den:metric" for the JSON."""
        r = self.median(num, metric) / self.median(den, metric)
        self.ratios[f"{num}/{den}:{metric}"] = r
        return r

    def paired(self, num: str, den: str, metric: str = "seconds") -> list[float]:
        """Per rep, num's sample over den's (the two measured next to each other)."""
        a, b = self.values(num, metric), self.values(den, metric)
        if len(a) != len(b):
            raise ValueError(f"{num} has {len(a)} samples of {metric}, {den} {len(b)}")
        return [x / y for x, y in zip(a, b)]

    def to_json(self) -> dict[str, Any]:
        variants = {}
        for v in self.samples:
            ms = self.metrics(v)
            variants[v] = {
                "samples": {m: self.values(v, m) for m in ms},
                "median": {m: self.median(v, m) for m in ms},
                "min": {m: self.spread(v, m)[0] for m in ms},
                "max": {m: self.spread(v, m)[1] for m in ms},
                "iqr": {m: list(iqr(self.values(v, m))) for m in ms},
            }
        return {"schema": SCHEMA, "benchmark": self.name, "params": self.params,
                "host": self.host, "order": self.order, "variants": variants,
                "ratios": self.ratios, "extra": self.extra}  # fmt: skip

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")

    def table(self, columns: Mapping[str, str] | Sequence[str], fmt: str = ".3f") -> str:
        """Markdown rows, one per variant: the median of each metric in `columns` (metric ->
        header) with its (min-max) when there is more than one sample."""
        cols = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
        rows = [[v, *(self.cell(v, m, fmt) for m in cols)] for v in self.samples]
        return markdown_table(["variant", *cols.values()], rows)

    def cell(self, variant: str, metric: str, fmt: str = ".3f") -> str:
        xs = self.values(variant, metric)
        if not xs:
            return "-"
        med, (lo, hi) = median(xs), spread(xs)
        return f"{med:{fmt}}" if len(xs) == 1 else f"{med:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


def measure(
    variants: Sequence[Variant],
    reps: int,
    warmup: int = 0,
    name: str = "",
    params: Mapping[str, Any] | None = None,
    clocks: Mapping[str, Clock] | None = None,
    on_sample: Callable[[str, int, list[Sample]], None] | None = None,
) -> Result:
    """`warmup` untimed calls of each variant (declared order), then `reps` reps in interleaved
    order. `on_sample(variant, rep, samples)` after each timed call (to print as it goes)."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0 (got reps={reps}, warmup={warmup})")
    by_name = {v.name: v for v in variants}
    if len(by_name) != len(variants):
        raise ValueError(f"variant names repeat: {[v.name for v in variants]}")
    clocks = WALL if clocks is None else clocks
    result = Result(name, dict(params or {}), {v.name: [] for v in variants})
    result.extra["load_average_before"] = load_average()
    for _ in range(warmup):
        for v in variants:
            _call(v, clocks)
    for rep, order in enumerate(interleaved(list(by_name), reps)):
        for n in order:
            got = _call(by_name[n], clocks)
            result.add(n, got)
            if on_sample is not None:
                on_sample(n, rep, got)
    result.extra["load_average_after"] = load_average()
    return result


def _call(v: Variant, clocks: Mapping[str, Clock]) -> list[Sample]:
    if v.setup is not None:
        v.setup()
    start = {k: c() for k, c in clocks.items()}
    out = v.fn()
    took = {k: c() - start[k] for k, c in clocks.items()}
    if out is None:
        return [took]
    if isinstance(out, Mapping):
        return [{**took, **out}]
    return [dict(r) for r in out]  # several samples: each its own, the call's time is not one


# ---- output ----------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], fmt: str = ".4g") -> str:
    """A markdown table (the rows docs/results.md shows); numbers formatted with `fmt`."""

    def cell(x: Any) -> str:
        return format(x, fmt) if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def add_common(
    ap: argparse.ArgumentParser,
    reps: int = 3,
    warmup: int | None = 0,
    reps_flags: Sequence[str] = ("--reps",),
    quick: str | None = None,
) -> argparse.ArgumentParser:
    """The flags every benchmark shares: `--reps` (or the names in `reps_flags`, dest "reps"),
    `--warmup` (untimed calls of each variant; None: the benchmark has no such flag),
    `--json PATH`, and `--quick` when `quick` says what it does."""
    ap.add_argument(*reps_flags, dest="reps", type=int, default=reps,
                    help="repeats of each variant, in interleaved order")  # fmt: skip
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup,
                        help="untimed calls of each variant first")  # fmt: skip
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the results here (one schema for every benchmark)")  # fmt: skip
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    return ap


@contextlib.contextmanager
def workdir(path: str | None, prefix: str) -> Iterator[Path]:
    """A bench's working directory: `path` where given (kept, what it holds reused), else a new
    temporary one, removed after the run."""
    if path is not None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def parser(doc: str | None, **common: Any) -> argparse.ArgumentParser:
    """An argument parser described by the first line of `doc`, with `add_common`'s flags."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    return add_common(ap, **common)


def finish(result: Result, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The run's parameters into the result, its JSON written where `--json` says; the JSON."""
    if args is not None:
        result.params = {k: v for k, v in vars(args).items() if k != "json"} | result.params
        if getattr(args, "json", None):
            result.write_json(args.json)
    return result.to_json()
