"""The actor's optimizer step gives the same loss and grad norm however the batch is split:
one microbatch vs four, DP1 vs DP2, TP1 vs TP2, EP2, PP2 (1F1B and VPP2), TP2xEP2 (gloo)."""

import math
from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("actor_worker.py")


def run_worker(tmp_path, checkpoint, nproc, mbs, flags=(), kind="grpo", tag="run", extra=()):
    out = tmp_path / f"{tag}.json"
    args = (str(checkpoint), str(out), kind, str(mbs), *flags, *extra)
    return run_distributed(WORKER, nproc, *args, out=out)


def assert_same_steps(got, ref):
    """The first step: relative 1e-6. Later steps start from weights that Adam moved by
    m / (sqrt(v) + eps), which turns float-rounding differences of near-zero gradients into
    slightly larger weight differences, so they are held to 1e-5."""
    for n, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
        rel = 1e-6 if n == 0 else 1e-5
        for key in ("loss", "grad_norm"):
            assert g[key] == pytest.approx(r[key], rel=rel, abs=1e-9), (n, key, g[key], r[key])
        for key in ("clip_frac_tokens", "clip_frac_seqs", "ratio_max"):
            assert g[key] == pytest.approx(r[key], rel=1e-5, abs=1e-6), (key, g[key], r[key])


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    """TP1, one process, the whole batch (8 samples) in one microbatch."""
    return run_worker(tmp_path_factory.mktemp("ref"), tiny_models["moe4"], 1, 8, tag="ref")


def test_reference_step_is_meaningful(reference):
    first, second = reference["steps"]
    assert first["clip_frac_tokens"] > 0 and first["grad_norm"] > 0
    assert second["loss"] != first["loss"]  # the optimizer step changed the policy


LAYOUTS = {
    "4-microbatches": (1, 2, []),
    "dp2": (2, 4, []),
    "tp2": (2, 4, ["--tp", "2"]),
    "ep2": (2, 4, ["--ep", "2"]),
    "pp2-1f1b": (2, 2, ["--pp", "2"]),
    "pp2-vpp2": (2, 2, ["--pp", "2", "--vpp", "2"]),
    "tp2xep2": (4, 2, ["--tp", "2", "--ep", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_same_step(tmp_path, tiny_models, reference, layout):
    nproc, mbs, flags = LAYOUTS[layout]
    got = run_worker(tmp_path, tiny_models["moe4"], nproc, mbs, flags, tag=layout)
    assert_same_steps(got, reference)


def test_fitted_forward_scores_the_batch_in_one_microbatch(tmp_path, tiny_models, reference):
    """logprobs(fit_logits=True) with micro batch 2: the 8 samples' logits fit one forward, whose
    log-probs are bit for bit those of the reference's one microbatch of 8."""
    got = run_worker(tmp_path, tiny_models["moe4"], 1, 2, ["--fit-logits"], tag="fit")
    assert got["old"] == reference["old"]
    assert_same_steps(got, reference)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_sequence_level_kinds_split_the_same(tmp_path, tiny_models, kind):
    ref = run_worker(tmp_path, tiny_models["moe"], 1, 8, kind=kind, tag="ref")
    got = run_worker(tmp_path, tiny_models["moe"], 2, 2, ["--ep", "2"], kind=kind, tag="ep2")
    assert_same_steps(got, ref)


@pytest.mark.parametrize("tis", ["token", "sequence"])
def test_truncated_importance_sampling_weights_the_objective(tmp_path, tiny_models, tis):
    """On-policy first step (ratio 1), rollout log-probs off by log rho = 0.3 k: the GRPO loss
    is -(1/B) sum_i (1/|y_i|) sum_t A_i w_it, w = min(rho, cap) per token or per sequence
    (written out here), the same under TP2 with 4 microbatches."""
    flags = ["--steps", "1", "--on-policy", "--tis", tis, "--tis-cap", "1.5"]
    got = run_worker(tmp_path, tiny_models["moe4"], 1, 8, tag="tp1", extra=flags)
    mask, adv = got["mask"], got["adv"]
    per_seq, weights = [], []
    for i in range(len(mask)):
        idx = [t for t in range(len(mask[i])) if mask[i][t]]
        log_rho = [got["old"][i][t] - got["rollout"][i][t] for t in idx]
        if tis == "token":
            w = [min(math.exp(x), 1.5) for x in log_rho]
        else:
            w = [min(math.exp(sum(log_rho)), 1.5)] * len(idx)
        weights += w
        per_seq.append(adv[i] * sum(w) / len(idx))
    step = got["steps"][0]
    assert step["loss"] == pytest.approx(-sum(per_seq) / len(mask), rel=1e-6)
    assert step["tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-6)
    assert min(weights) < 1 < max(weights) and max(weights) == 1.5  # both sides, and capped
    tp2 = run_worker(tmp_path, tiny_models["moe4"], 2, 2, ["--tp", "2"], tag="tp2", extra=flags)
    assert tp2["steps"][0]["loss"] == pytest.approx(step["loss"], rel=1e-6)
    assert tp2["steps"][0]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-6)


RESUME = {  # name: (optimizer flags, save layout, resume layout); each layout (processes, flags)
    "tp1-to-tp1": (["--no-dist-opt"], (1, []), (1, [])),
    "tp1-to-tp2": (["--no-dist-opt"], (1, []), (2, ["--tp", "2"])),
    "tp1-to-pp2xep2": (["--no-dist-opt"], (1, []), (4, ["--pp", "2", "--ep", "2"])),
    "distopt-ep2-to-ep2": ([], (2, ["--ep", "2"]), (2, ["--ep", "2"])),
    "distopt-ep2-to-dp1": ([], (2, ["--ep", "2"]), (1, [])),
    "distopt-ep2-to-tp2": ([], (2, ["--ep", "2"]), (2, ["--tp", "2"])),
    "distopt-ep2-to-pp2xep2": ([], (2, ["--ep", "2"]), (4, ["--pp", "2", "--ep", "2"])),
}
_saved: dict = {}


def saved_run(tmp_path_factory, checkpoint, opt_flags, layout):
    """Four steps under `layout`, checkpointed after two; cached per (optimizer, layout)."""
    key = (tuple(opt_flags), layout[0], tuple(layout[1]))
    if key not in _saved:
        tmp = tmp_path_factory.mktemp("resume")
        run = run_worker(
            tmp,
            checkpoint,
            layout[0],
            2,
            [*layout[1], *opt_flags],
            tag="full",
            extra=["--steps", "4", "--save-after", "2", "--save-dir", str(tmp / "ckpt")],
        )
        _saved[key] = (run, tmp / "ckpt")
    return _saved[key]


@pytest.mark.parametrize("case", list(RESUME))
def test_resume_continues_the_run(tmp_path, tmp_path_factory, tiny_models, case):
    opt_flags, save_layout, resume_layout = RESUME[case]
    full, ckpt = saved_run(tmp_path_factory, tiny_models["moe4"], opt_flags, save_layout)
    nproc, flags = resume_layout
    resumed = run_worker(
        tmp_path,
        tiny_models["moe4"],
        nproc,
        2,
        [*flags, *opt_flags],
        tag=case,
        extra=["--steps", "2", "--load", str(ckpt)],
    )
    tail = full["steps"][2:]
    if resume_layout == save_layout:  # same layout: bit for bit
        for g, r in zip(resumed["steps"], tail):
            assert (g["loss"], g["grad_norm"]) == (r["loss"], r["grad_norm"])
    else:  # another layout sums in another order: the same to float rounding
        for g, r in zip(resumed["steps"], tail):
            for key in ("loss", "grad_norm"):
                assert g[key] == pytest.approx(r[key], rel=1e-5), (key, g[key], r[key])


@pytest.mark.parametrize(
    "nproc,mbs,flags", [(1, 8, []), (2, 2, ["--pp", "2"]), (2, 4, ["--ep", "2"])],
    ids=["tp1", "pp2", "ep2"],
)  # fmt: skip
def test_on_policy_step_takes_old_logprobs_from_its_own_forward(tmp_path, tiny_models, nproc,
                                                                mbs, flags):  # fmt: skip
    """train_step(on_policy=True) without a logprobs pass: the same two steps as old log-probs
    computed first (first step: ratios exactly 1 either way), and the batch's old log-probs
    equal the logprobs pass's on every trained token (the on-policy step computes logits from
    the first trained position on, so the prompt tokens before it have None)."""
    ckpt = tiny_models["moe4"]
    ref = run_worker(tmp_path, ckpt, nproc, mbs, flags, tag="ref", extra=["--on-policy"])
    got = run_worker(tmp_path, ckpt, nproc, mbs, flags, tag="own", extra=["--own-forward"])
    assert got["steps"][0]["ratio_max"] == 1.0 and got["steps"][0]["ratio_mean"] == 1.0
    assert_same_steps(got, ref)
    for g, r, mask in zip(got["old"], ref["old"], got["mask"], strict=True):
        assert g[0] is None and r[0] is None and len(g) == len(r) == len(mask)
        trained = [t for t, m in enumerate(mask) if m]
        assert [g[t] for t in trained] == pytest.approx([r[t] for t in trained], abs=1e-5)
        assert all(t < min(trained) for t, v in enumerate(g) if v is None)
    assert any(g[1] is None for g in got["old"])  # prompt logits were skipped
    # ... in training only: scoring and the log-prob pass after it cover every position.
    for s, lp in zip(got["after"]["score"], got["after"]["logprobs"], strict=True):
        assert s[0] is None and None not in s[1:]
        assert s[1:] == pytest.approx(lp[1:], abs=1e-5)
