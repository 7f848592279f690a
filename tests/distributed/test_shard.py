"""The RL loop's training step on a sharded batch (train/shard.py): rank 0 holds the batch, every
rank receives its replica's rows and its stage's routing, and the step gives the metrics of one
process holding everything: PP2 x DP2 (routing cut per stage, rows per replica) and TP2 x EP2
(two replicas, tensor-parallel peers sharing rows), for routing replay none, R2 and R3 (gloo).
No object collective of the step carries per-token data (a counting wrapper records them)."""

import math
from pathlib import Path

import pytest

from tests.distributed.shard_worker import MODES
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("shard_worker.py")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_batch.py"
LAYOUTS = {  # name: (processes, flags)
    "single": (1, []),
    "pp2xdp2": (4, ["--pp", "2"]),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
}
# the step's numbers: float sums in other orders (and, for routing, near-tied router scores
# rounded another way under TP) give the same to these tolerances
EXACT_TO = {"loss/policy": 1e-5, "grad_norm": 1e-5, "ratio/": 1e-5, "kl/old": 1e-5,
            "entropy": 1e-5, "mismatch/": 1e-5, "routing/": 0.02}  # fmt: skip
TIMING = ("time/",)


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard")
    out = {}
    for name, (procs, flags) in LAYOUTS.items():
        path = tmp / f"{name}.json"
        out[name] = run_distributed(WORKER, procs, str(tiny_models["moe4"]), str(path), *flags,
                                    out=path)  # fmt: skip
    return out


def _tolerance(key: str) -> float | None:
    for prefix, tol in EXACT_TO.items():
        if key.startswith(prefix):
            return tol
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["pp2xdp2", "tp2xep2"])
def test_sharded_step_gives_the_metrics_of_one_process(results, layout, mode):
    ref, got = results["single"][mode]["metrics"], results[layout][mode]["metrics"]
    assert ref["grad_norm"] > 0 and ref["ratio/clip_fraction_tokens"] >= 0
    assert "mismatch/logprob_abs_diff" in ref  # rollout log-probs reached the step
    if mode == "r3":
        assert 0 < ref["routing/rollout_train_agreement"] < 1  # random server routing
        assert "mismatch/logprob_abs_diff_routing_differs" in ref
    compared = 0
    for key, value in ref.items():
        tol = _tolerance(key)
        if tol is None or not isinstance(value, float) or math.isnan(value):
            continue
        assert key in got, key
        assert got[key] == pytest.approx(value, rel=tol, abs=tol), (key, got[key], value)
        compared += 1
    assert compared >= 15


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_object_collective_carries_per_token_data(results, layout):
    """The step's only object collective: the stat names, agreed on before their values are
    all-reduced as tensors (a few hundred bytes whatever the batch)."""
    for mode in MODES:
        seen = results[layout][mode]["objects"]
        if layout == "single":
            assert not seen  # one process: nothing to send
            continue
        assert seen, "the step reduced its stats somehow; the wrapper must see the names"
        assert {kind for kind, _ in seen} == {"names"}, seen
        assert max(size for _, size in seen) < 1024, seen


def test_bench_batch_sends_each_rank_what_its_layout_needs(tmp_path):
    """bench/bench_batch.py at a small scale (8k tokens), PP2 x DP2 on 4 gloo ranks: every
    receiver gets within 1.1x of its rows and its stage's layers, several times less than the
    whole batch the broadcast sends."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_batch", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--scale", "512", "--layouts", "PP2xDP2", "--json", str(tmp_path / "b.json")])
    summary = out["extra"]["summary"]["PP2xDP2"]
    assert 1.0 <= summary["recv_over_need"] <= 1.1
    assert summary["broadcast_over_recv"] >= 4
