"""The actor's optimizer step gives the same loss and grad norm however the batch is split:
one microbatch vs four, DP1 vs DP2, TP1 vs TP2, EP2, PP2 (1F1B and VPP2), TP2xEP2 (gloo).

Every worker run of this file is a job in JOBS; the jobs of one parallel layout run in one
torchrun launch (the worker's --jobs), the first time a test asks for one of them: 8 launches
instead of 32, each job still with its own model and optimizer."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("actor_worker.py")

GROUPS = {  # layout: (processes, flags)
    "single": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["--tp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "pp2-vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
    "pp2xep2": (4, ["--pp", "2", "--ep", "2"]),
}
# resume jobs load checkpoints that jobs of these layouts save
NEEDS = {"single": ["ep2"], "tp2": ["single", "ep2"], "pp2xep2": ["single", "ep2"]}


@dataclass(frozen=True)
class Job:
    group: str
    mbs: int
    extra: tuple[str, ...] = ()  # "{tmp}" is the runs' directory
    kind: str = "grpo"
    model: str = "moe4"


LAYOUTS = {  # name: (layout, micro batch size)
    "4-microbatches": ("single", 2),
    "dp2": ("dp2", 4),
    "tp2": ("tp2", 4),
    "ep2": ("ep2", 4),
    "pp2-1f1b": ("pp2", 2),
    "pp2-vpp2": ("pp2-vpp2", 2),
    "tp2xep2": ("tp2xep2", 2),
}
TIS = ("--steps", "1", "--on-policy", "--tis-cap", "1.5")
ON_POLICY = {"tp1": ("single", 8), "pp2": ("pp2", 2), "ep2": ("ep2", 4)}
SAVES = {  # the full four steps, checkpointed after two: (optimizer flags, layout)
    "tp1": (["--no-dist-opt"], "single"),
    "distopt-ep2": ([], "ep2"),
}
RESUME = {  # name: (the save it resumes, resume layout)
    "tp1-to-tp1": ("tp1", "single"),
    "tp1-to-tp2": ("tp1", "tp2"),
    "tp1-to-pp2xep2": ("tp1", "pp2xep2"),
    "distopt-ep2-to-ep2": ("distopt-ep2", "ep2"),
    "distopt-ep2-to-dp1": ("distopt-ep2", "single"),
    "distopt-ep2-to-tp2": ("distopt-ep2", "tp2"),
    "distopt-ep2-to-pp2xep2": ("distopt-ep2", "pp2xep2"),
}

PACK = ("--pack", "40")  # tokens per packed microbatch: 2-3 of the batch's 6-20 token rows
PACKED = ("grpo", "gspo")

JOBS: dict[str, Job] = {  # (a layout's jobs run in this order: a save before its resumes)
    "reference": Job("single", 8),  # TP1, one process, the whole batch in one microbatch
    "reference/gspo": Job("single", 8, kind="gspo"),
    **{
        f"pack/{kind}/{name}": Job(group, mbs, PACK, kind=kind)
        for name, (group, mbs) in LAYOUTS.items()
        for kind in PACKED
    },
    **{f"layout/{name}": Job(group, mbs) for name, (group, mbs) in LAYOUTS.items()},
    "fit": Job("single", 2, ("--fit-logits",)),
    **{
        f"seq/{kind}/{where}": Job(group, mbs, kind=kind, model="moe")
        for kind in ("gspo", "gspo_token")
        for where, group, mbs in (("ref", "single", 8), ("ep2", "ep2", 2))
    },
    **{
        f"tis/{tis}/{where}": Job(group, mbs, (*TIS, "--tis", tis))
        for tis in ("token", "sequence")
        for where, group, mbs in (("tp1", "single", 8), ("tp2", "tp2", 2))
    },
    **{
        f"on-policy/{name}/{how}": Job(group, mbs, (flag,))
        for name, (group, mbs) in ON_POLICY.items()
        for how, flag in (("ref", "--on-policy"), ("own", "--own-forward"))
    },
    **{
        f"save/{name}": Job(
            group,
            2,
            (*opt, "--steps", "4", "--save-after", "2", "--save-dir", f"{{tmp}}/save-{name}"),
        )
        for name, (opt, group) in SAVES.items()
    },
    **{
        f"resume/{case}": Job(
            group, 2, (*SAVES[src][0], "--steps", "2", "--load", f"{{tmp}}/save-{src}")
        )
        for case, (src, group) in RESUME.items()
    },
}


class Runs:
    """The jobs' results, by tag; a layout's jobs are launched together on first use."""

    def __init__(self, tmp: Path, models: dict):
        self.tmp, self.models = tmp, models
        self.launched: dict[str, BaseException | None] = {}

    def out(self, tag: str) -> Path:
        return self.tmp / (tag.replace("/", "--") + ".json")

    def __getitem__(self, tag: str) -> dict:
        self.launch(JOBS[tag].group)
        return json.loads(self.out(tag).read_text())

    def launch(self, group: str) -> None:
        if group not in self.launched:
            for need in NEEDS.get(group, []):
                self.launch(need)
            try:
                self._launch(group)
                self.launched[group] = None
            except BaseException as e:  # (every test of this layout fails with it, once run)
                self.launched[group] = e
        failed = self.launched[group]
        if failed is not None:
            raise AssertionError(f"the {group} launch failed: {failed}")

    def _launch(self, group: str) -> None:
        nproc, flags = GROUPS[group]
        jobs = [
            [str(self.models[job.model]), str(self.out(tag)), job.kind, str(job.mbs), *flags,
             *(x.format(tmp=self.tmp) for x in job.extra)]
            for tag, job in JOBS.items() if job.group == group
        ]  # fmt: skip
        file = self.tmp / f"jobs-{group}.json"
        file.write_text(json.dumps(jobs))
        run_distributed(WORKER, nproc, "--jobs", str(file), out=None,
                        log=self.tmp / f"{group}.log", timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("actor"), tiny_models)


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
def reference(runs):
    """TP1, one process, the whole batch (8 samples) in one microbatch."""
    return runs["reference"]


def test_reference_step_is_meaningful(reference):
    first, second = reference["steps"]
    assert first["clip_frac_tokens"] > 0 and first["grad_norm"] > 0
    assert second["loss"] != first["loss"]  # the optimizer step changed the policy


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_same_step(runs, reference, layout):
    assert_same_steps(runs[f"layout/{layout}"], reference)


@pytest.mark.parametrize("kind", PACKED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_microbatches_give_the_padded_step(runs, layout, kind):
    """Sequences packed into microbatches of at most 40 tokens (THD), under every layout: the
    loss, gradient norm and clip statistics of the padded reference (one microbatch of all 8
    rows), and the updated weights' log-probs of every token (scored by the padded path)."""
    got, ref = (
        runs[f"pack/{kind}/{layout}"],
        runs["reference" if kind == "grpo" else "reference/gspo"],
    )
    assert_same_steps(got, ref)
    flat = [(g, r) for gs, rs in zip(got["after"]["score"], ref["after"]["score"])
            for g, r in zip(gs, rs) if r is not None]  # fmt: skip
    assert [g for g, _ in flat] == pytest.approx([r for _, r in flat], rel=1e-5, abs=1e-6)
    # the packed forward of the whole batch scores every token as the padded path does
    both = [(g, r) for gs, rs in zip(got["after"]["logprobs"], got["after"]["score"])
            for g, r in zip(gs, rs) if r is not None]  # fmt: skip
    assert None not in [g for g, _ in both]
    assert [g for g, _ in both] == pytest.approx([r for _, r in both], rel=1e-5, abs=1e-6)


def test_fitted_forward_scores_the_batch_in_one_microbatch(runs, reference):
    """logprobs(fit_logits=True) with micro batch 2: the 8 samples' logits fit one forward, whose
    log-probs are bit for bit those of the reference's one microbatch of 8."""
    got = runs["fit"]
    assert got["old"] == reference["old"]
    assert_same_steps(got, reference)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_sequence_level_kinds_split_the_same(runs, kind):
    assert_same_steps(runs[f"seq/{kind}/ep2"], runs[f"seq/{kind}/ref"])


@pytest.mark.parametrize("tis", ["token", "sequence"])
def test_truncated_importance_sampling_weights_the_objective(runs, tis):
    """On-policy first step (ratio 1), rollout log-probs off by log rho = 0.3 k: the GRPO loss
    is -(1/B) sum_i (1/|y_i|) sum_t A_i w_it, w = min(rho, cap) per token or per sequence
    (written out here), the same under TP2 with 4 microbatches."""
    got = runs[f"tis/{tis}/tp1"]
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
    tp2 = runs[f"tis/{tis}/tp2"]
    assert tp2["steps"][0]["loss"] == pytest.approx(step["loss"], rel=1e-6)
    assert tp2["steps"][0]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("case", list(RESUME))
def test_resume_continues_the_run(runs, case):
    """Four steps checkpointed after two; resumed (in the same or another layout) from that
    checkpoint, the two steps after it."""
    src, group = RESUME[case]
    full, resumed = runs[f"save/{src}"], runs[f"resume/{case}"]
    tail = full["steps"][2:]
    if group == SAVES[src][1]:  # same layout: bit for bit
        for g, r in zip(resumed["steps"], tail):
            assert (g["loss"], g["grad_norm"]) == (r["loss"], r["grad_norm"])
    else:  # another layout sums in another order: the same to float rounding
        for g, r in zip(resumed["steps"], tail):
            for key in ("loss", "grad_norm"):
                assert g[key] == pytest.approx(r[key], rel=1e-5), (key, g[key], r[key])


@pytest.mark.parametrize("layout", list(ON_POLICY))
def test_on_policy_step_takes_old_logprobs_from_its_own_forward(runs, layout):
    """train_step(on_policy=True) without a logprobs pass: the same two steps as old log-probs
    computed first (first step: ratios exactly 1 either way), and the batch's old log-probs
    equal the logprobs pass's on every trained token (the on-policy step computes logits from
    the first trained position on, so the prompt tokens before it have None)."""
    ref, got = runs[f"on-policy/{layout}/ref"], runs[f"on-policy/{layout}/own"]
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
