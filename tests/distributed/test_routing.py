"""Routing replay (R2, R3) under TP1, TP2 (+SP), EP2, PP2, PP2xVPP2, TP2xEP2 (also with grouped
experts), with and without activation recompute (PP, where several forwards run before their
backwards), on a model whose first layer is dense and a batch of samples of different lengths
(gloo, 4 ranks, every layout in one launch), padded and packed (THD microbatches under a token
budget).

R3's routed experts come from the built-in rollout server serving checkpoint A; the trainer loads
B, A with its router weights perturbed, so its natural routing differs from the server's and
replay matters from the first forward. Independent references: an HF transformers forward of B
(natural top-k for R2's recording; top-k forced to the server's for R3's log-probs and agreement).
"""

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gspo.rollout.client import RolloutClient
from tests.distributed.routing_worker import MINIBATCH  # the second update's rows
from tests.e2e.server_process import running_server
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("routing_worker.py")
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34], [40, 41, 42, 43]]
MODES = ["r2", "r3"]
PLAN = [  # 4 ranks: every layout has data-parallel replicas too
    {"name": "tp1", "tp": 1, "pp": 1, "ep": 1, "mbs": 1},
    {"name": "tp2", "tp": 2, "pp": 1, "ep": 1, "mbs": 2},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2, "mbs": 1},
    {"name": "pp2", "tp": 1, "pp": 2, "ep": 1, "mbs": 2},
    {"name": "tp2xep2", "tp": 2, "pp": 1, "ep": 2, "mbs": 2},
    {"name": "tp2xpp2-recompute", "tp": 2, "pp": 2, "ep": 1, "mbs": 2, "recompute": True},
    {"name": "pp2xvpp2-recompute", "tp": 1, "pp": 2, "ep": 1, "vpp": 2, "mbs": 1,
     "recompute": True},
    # grouped experts (model/experts.py), with the router recomputed under replay
    {"name": "grouped-tp2xep2-recompute", "tp": 2, "pp": 1, "ep": 2, "mbs": 2, "grouped": True,
     "recompute": True},
]  # fmt: skip
# The same layouts with sequences packed into microbatches of at most 24 tokens (THD; the
# samples have 9-14): every check below holds packed as padded, against the padded tp1.
PLAN += [dict(layout, name=f"{layout['name']}-packed", pack=24) for layout in PLAN]
REF = "tp1"
# Layouts that also run mode "none" (training routes naturally), for the drift split: one
# process, sequence parallel (each TP rank routes part of the tokens), two pipeline stages (a
# token moved if any stage's layers moved it).
SPLIT_LAYOUTS = ["tp1", "tp2", "pp2"]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    """(A, B): B is A with every router weight moved by noise of its own scale."""
    a = tiny_models["moe4"]
    b = tmp_path_factory.mktemp("perturbed") / "b"
    shutil.copytree(a, b)
    weights = load_file(b / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            weights[name] = w + 0.3 * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, b / "model.safetensors", metadata={"format": "pt"})
    return a, b


@pytest.fixture(scope="module")
def batch_file(checkpoints, tmp_path_factory):
    """Samples of different lengths from the built-in server on A, with routed experts."""
    sp = {"max_new_tokens": 7, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}

    async def go(url):
        async with RolloutClient([url], topk=2) as c:
            return await c.generate(PROMPTS, n=2, sampling_params=sp, return_routed_experts=True)

    with running_server(checkpoints[0], "--enable-return-routed-experts") as url:
        groups = asyncio.run(go(url))
    samples = [s for group in groups for s in group][:8]
    g = torch.Generator().manual_seed(0)
    out = tmp_path_factory.mktemp("batch") / "batch.json"
    out.write_text(
        json.dumps(
            {
                "tokens": [s.prompt_ids + s.tokens for s in samples],
                "loss_mask": [[0] * len(s.prompt_ids) + [1] * len(s.tokens) for s in samples],
                "advantages": torch.randn(len(samples), generator=g).tolist(),
                "rollout_experts": [s.routed_experts.tolist() for s in samples],
            }
        )
    )
    return out


@pytest.fixture(scope="module")
def runs(checkpoints, batch_file, tmp_path_factory):

    tmp = tmp_path_factory.mktemp("routing")
    plan = tmp / "plan.json"
    plan.write_text(
        json.dumps(
            [
                dict(layout, modes=MODES + (["none"] if layout["name"] in SPLIT_LAYOUTS else []))
                for layout in PLAN
            ]
        )
    )
    out = tmp / "out.json"
    args = (str(checkpoints[1]), str(batch_file), str(out), str(plan))
    return run_distributed(WORKER, 4, *args, out=out, timeout=900)


def run_names():
    return [f"{layout['name']}/{mode}" for layout in PLAN for mode in MODES]


@pytest.mark.parametrize("name", run_names())
def test_unchanged_weights_give_ratios_of_exactly_one(runs, name):
    step = runs[name]["step1"]
    assert step["ratio_min"] == 1.0 and step["ratio_max"] == 1.0
    assert step["routing/changed_fraction"] == 0.0


@pytest.mark.parametrize("name", run_names())
def test_replayed_forward_uses_the_stored_experts(runs, name):
    """After the update the router's own top-k moved, but every router token of the replayed
    forward went to exactly the stored experts (checked per layer from the routers' output)."""
    run = runs[name]
    per_layer: dict[str, list[int]] = {}
    for rank in run["experts"]:
        for layer, (checked, wrong) in rank.items():
            acc = per_layer.setdefault(layer, [0, 0])
            acc[0] += checked
            acc[1] += wrong
    assert sorted(per_layer) == ["1", "2", "3"]
    for layer, (checked, wrong) in per_layer.items():
        assert checked > 0 and wrong == 0, (layer, checked, wrong)
    changed = run["replay_metrics"]
    assert changed["routing/changed_fraction"] > 0.05
    assert all(changed[f"routing/changed_fraction/layer_{i}"] > 0 for i in (1, 2, 3))
    assert run["step2"]["routing/changed_fraction"] > 0.05


@pytest.mark.parametrize("name", [n for n in run_names() if not n.startswith(REF + "/")])
def test_layouts_give_identical_replay(runs, name):
    got, ref = runs[name], runs[f"{REF}/{name.split('/')[1]}"]
    for key in ("old", "replayed"):
        for g, r in zip(got[key], ref[key]):
            assert np.allclose(g[1:], r[1:], rtol=0, atol=2e-5), key
    assert got["recorded"] == ref["recorded"]
    for step in ("step1", "step2"):
        for key in ("loss", "grad_norm", "ratio_max", "routing/changed_fraction"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-5), (step, key)
    for key in ("routing/tokens_changed_any", "log_ratio_std_same", "log_ratio_std_moved"):
        assert (key in got["step2"]) == (key in ref["step2"]), key
        if key in ref["step2"]:
            assert got["step2"][key] == pytest.approx(ref["step2"][key], rel=1e-4), key
    assert got.get("rollout_differs") == ref.get("rollout_differs")
    # Under R3 each stage packs its own patch bits (n x its layers, rounded up to bytes).
    key = "routing/bytes_per_token"
    (got_rec, got_bytes), (ref_rec, ref_bytes) = (
        split(r["record_metrics"], key) for r in (got, ref)
    )
    assert got_bytes == pytest.approx(ref_bytes, rel=0.03)
    assert got_rec == pytest.approx(ref_rec, rel=1e-9)
    assert got["replay_metrics"] == pytest.approx(ref["replay_metrics"], rel=1e-9)


def split(metrics: dict, key: str) -> tuple[dict, float]:
    return {k: v for k, v in metrics.items() if k != key}, metrics[key]


def test_metrics_have_their_keys(runs):
    r2, r3 = runs[f"{REF}/r2"], runs[f"{REF}/r3"]
    # 3 MoE layers x top-2 x uint8, against SGLang's 4 layers x 2 x int32 = 32 bytes per token.
    assert r2["record_metrics"] == {"routing/bytes_per_token": 6.0}
    keys = {"routing/rollout_train_agreement"} | {
        f"routing/rollout_train_agreement/layer_{i}" for i in (1, 2, 3)
    }
    assert keys | {"routing/bytes_per_token"} == set(r3["record_metrics"])
    # R3 keeps the rollout's ids (n - 1 tokens) and the recorded ones as a patch on them.
    assert 5.0 < r3["record_metrics"]["routing/bytes_per_token"] < 12.0


# ---- independent references: an HF forward of the trainer's checkpoint --------------------


def hf_forward(path, tokens, forced=None):
    """(log p(token_t | prefix) [n-1], natural top-k sets per MoE layer [n, L, k]) from HF.
    forced: {moe column: [n-1, k]} replaces the router's top-k (the last token routes freely),
    with its weights taken from the same softmax, as megatron's replay does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gates = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    natural = []
    for col, gate in enumerate(gates):
        gate.forward = _forced_gate(gate, None if forced is None else forced[col], natural)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    logp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return logp, torch.stack(natural, 1).sort(-1).values


def _forced_gate(gate, forced, natural):
    def forward(hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
        probs = logits.softmax(-1, dtype=torch.float)
        top = torch.topk(probs, gate.top_k, dim=-1).indices
        natural.append(top)
        if forced is not None:
            top = top.clone()
            top[: len(forced)] = torch.as_tensor(forced, dtype=torch.long)
        values = probs.gather(1, top)
        if gate.norm_topk_prob:
            values = values / values.sum(-1, keepdim=True)
        return logits, values.to(logits.dtype), top

    return forward


def test_r2_records_the_natural_routing(runs, checkpoints, batch_file):
    batch = json.loads(batch_file.read_text())
    recorded = runs[f"{REF}/r2"]["recorded"]  # [sample][layer][token][k]
    for i, tokens in enumerate(batch["tokens"]):
        _, natural = hf_forward(checkpoints[1], tokens)
        got = torch.tensor(recorded[i]).permute(1, 0, 2).sort(-1).values
        assert torch.equal(got, natural)


def test_r3_replays_the_rollout_routing(runs, checkpoints, batch_file):
    """Old log-probs under R3 equal HF's with the router forced to the server's experts; the
    agreement metric equals the share of (token, layer) positions where HF's own top-k under
    that forcing matches the server's."""
    batch = json.loads(batch_file.read_text())
    run = runs[f"{REF}/r3"]
    same = total = 0
    for i, tokens in enumerate(batch["tokens"]):
        rollout = np.array(batch["rollout_experts"][i])[:, [1, 2, 3]]  # drop the dense layer 0
        logp, natural = hf_forward(checkpoints[1], tokens, rollout.transpose(1, 0, 2))
        assert np.allclose(run["old"][i][1:], logp.numpy(), rtol=0, atol=2e-5)
        want = torch.from_numpy(np.sort(rollout, -1)).long()
        hits = (natural[:-1] == want).all(-1)
        same, total = same + int(hits.sum()), total + hits.numel()
        # Per position: does the trainer's routing differ from the server's in any MoE layer
        # (the split of mismatch/logprob_abs_diff)? The last position was never fed: no.
        differs = (~hits.all(-1)).tolist() + [False]
        assert run["rollout_differs"][i] == differs, i
    agreement = run["record_metrics"]["routing/rollout_train_agreement"]
    assert 0.3 < agreement < 0.99  # the perturbation moved some routing, not all
    assert agreement == pytest.approx(same / total, abs=1e-12)


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_log_ratio_std_is_split_by_whether_routing_moved(runs, batch_file, layout):
    """The second update's token log-ratio std over the loss tokens whose routing moved (any
    MoE layer, at the position that produced the token) and over the others, against the same
    split written out here: log-ratio = natural log-prob under the updated weights - old
    log-prob; moved = the top-k SET of some layer at position t - 1 differs between the natural
    routing under the updated weights and the one the old log-probs recorded."""
    batch = json.loads(batch_file.read_text())
    run = runs[f"{layout}/none"]
    old, new = run["old"], run["natural_logprobs"]
    before, after = run["recorded"], run["natural_recorded"]  # [sample][layer][position][k]
    groups: dict[bool, list[float]] = {False: [], True: []}
    for i in MINIBATCH:
        for t in range(1, len(batch["tokens"][i])):
            if batch["loss_mask"][i][t]:
                moved = any(
                    sorted(before[i][layer][t - 1]) != sorted(after[i][layer][t - 1])
                    for layer in range(len(before[i]))
                )
                groups[moved].append(new[i][t] - old[i][t])
    same, moved = groups[False], groups[True]
    assert same and moved, (len(same), len(moved))  # the update moved some routing, not all
    step = run["step2"]
    assert step["routing/tokens_changed_any"] == pytest.approx(
        len(moved) / (len(same) + len(moved))
    )
    for key, group in (("log_ratio_std_same", same), ("log_ratio_std_moved", moved)):
        if len(group) < 2:  # a std over one token is undefined: not logged
            assert key not in step, key
        else:
            assert step[key] == pytest.approx(float(np.std(group)), rel=1e-3), key
