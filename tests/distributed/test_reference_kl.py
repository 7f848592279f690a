"""The KL reference: the run's starting weights, swapped into the policy's own modules.

Judged against independent computations: the reference log-probs after the policy has moved
equal an HF transformers forward of the starting checkpoint (1e-4); kl/ref at the first update
(the policy still the reference) is 0; on a later batch it equals the k3 estimator written out
over the HF reference and the policy's own log-probs (1e-4). Under 1 rank, TP2 and EP2."""

from pathlib import Path

import pytest
import torch

from tests.helpers import hf_token_logprobs, run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("reference_worker.py")
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "ep2": (2, ["--ep", "2"])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reference_is_the_start_and_kl_ref_is_k3_against_it(layout, tiny_models, tmp_path):
    nproc, flags = LAYOUTS[layout]
    out, model = tmp_path / "out.json", tiny_models["moe"]
    got = run_distributed(WORKER, nproc, str(model), str(out), *flags, out=out)
    cu, tokens = got["cu"], got["tokens"]
    seqs = [tokens[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]
    hf = hf_token_logprobs(model, seqs)  # log p(token_t | prefix) for t >= 1, per row
    ref = torch.tensor([v if v is not None else float("nan") for v in got["ref"]])
    own = torch.tensor([v if v is not None else float("nan") for v in got["own"]])
    mask = torch.tensor(got["mask"], dtype=torch.bool)
    moved = 0.0
    log_r, trained = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        torch.testing.assert_close(ref[a + 1 : b], hf[i], atol=1e-4, rtol=0)
        moved = max(moved, float((own[a + 1 : b] - hf[i]).abs().max()))
        log_r.append(hf[i] - own[a + 1 : b])
        trained.append(mask[a + 1 : b])
    assert moved > 1e-3  # the policy did move away from the reference
    assert abs(got["kl_first"]) < 1e-6
    lr, m = torch.cat(log_r).double(), torch.cat(trained)
    k3 = (torch.exp(lr) - 1 - lr)[m].mean()  # Schulman's k3, written out
    assert got["kl_later"] == pytest.approx(float(k3), abs=1e-4, rel=1e-3)
    assert got["kl_later"] > 1e-5
    assert got["reference_bytes"] > 0


REWARD_WORKER = Path(__file__).with_name("reward_kl_worker.py")
REWARD_LAYOUTS = {"one": (1, []), "dp2": (2, []), "tp2": (2, ["--tp", "2"]),
                  "pp2": (2, ["--pp", "2"])}  # fmt: skip


@pytest.mark.parametrize("layout", list(REWARD_LAYOUTS))
def test_kl_in_the_reward_gives_the_advantages_of_the_penalized_rewards(
    layout, tiny_models, tmp_path
):
    """algo.kl_in: reward on each rank's shard: every rank holds the advantages of
    r_i - beta * sum_t (log pi_old - log pi_ref) (k1) group-normalized over the whole batch,
    with pi_ref an HF forward of the starting checkpoint and pi_old the moved policy's own
    log-probs; kl/ref is k1's mean over the trained tokens."""
    nproc, flags = REWARD_LAYOUTS[layout]
    out, model = tmp_path / "out.json", tiny_models["moe"]
    got = run_distributed(REWARD_WORKER, nproc, str(model), str(out), *flags, out=out)
    cu, tokens, mask = got["cu"], got["tokens"], got["mask"]
    seqs = [tokens[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]
    hf = hf_token_logprobs(model, seqs)
    old = {i: row for r in got["ranks"] for i, row in r["old"]}
    assert sorted(old) == list(range(len(seqs)))  # every row, from the last stage
    kl, tokens_trained = [], 0
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        m = torch.tensor(mask[a + 1 : b], dtype=torch.bool)
        own = torch.tensor(old[i][1:], dtype=torch.float64)
        kl.append(float((own - hf[i].double())[m].sum()))  # k1 = log pi - log pi_ref
        tokens_trained += int(m.sum())
    assert max(abs(k) for k in kl) > 1e-2  # the policy did move
    shaped = torch.tensor(got["rewards"], dtype=torch.float64) - 0.5 * torch.tensor(kl)
    groups = shaped.view(-1, 4)
    scale = groups.abs().amax(1, keepdim=True)
    want = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6 * scale)
    held = [(i, adv) for r in got["ranks"] for i, adv in r["adv"]]
    assert {i for i, _ in held} == set(range(len(seqs)))
    for i, adv in held:
        assert adv == pytest.approx(float(want.flatten()[i]), abs=2e-4), (i, layout)
    for r in got["ranks"]:  # the same numbers on every rank
        assert r["metrics"]["kl/ref"] == pytest.approx(sum(kl) / tokens_trained, abs=1e-5)
        assert r["metrics"]["kl/reward_penalty"] == pytest.approx(0.5 * sum(kl) / len(kl), abs=1e-5)
