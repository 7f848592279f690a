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
