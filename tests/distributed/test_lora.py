"""LoRA on the tiny MoE (a dense layer, then MoE) against PEFT on the HF model: the same adapter
weights give the same token log-probs, the same adapter gradients of an on-policy GSPO step
(1e-5), and the weight sync's merged HF tensors equal PEFT's merge_and_unload, on 1 rank and under
TP2 (+SP, expert-TP 2), EP2, PP2, PP2 x VPP2 and TP2xEP2 (gloo).

PEFT 0.21 rewrites target_modules named gate_proj/up_proj/down_proj into expert targets for
Qwen3-MoE (a transformers-4 adapter conversion) and so drops the dense layer's MLP adapters; the
reference turns that conversion off (model/lora_peft.py)."""

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from megatron_gspo.algo.policy_loss import loss_denominator, policy_loss
from megatron_gspo.model.lora_peft import peft_config
from tests.distributed.lora_worker import LORA, fixed_batch
from tests.helpers import hf_token_logprobs, run_cli, run_distributed, stopped_mid_write

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("lora_worker.py")
LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"]),
    "pp2-vpp2": (2, ["--pp", "2", "--vpp", "2"]),  # on moe4 (4 layers, unnormalized top-k)
    # lora.experts: shared (one adapter per layer and projection for all experts): PEFT holds it
    # repeated in every expert; its gradient is the sum of PEFT's per-expert gradients
    "shared": (1, ["--experts", "shared"]),
    "shared-ep2": (2, ["--ep", "2", "--experts", "shared"]),
    "shared-tp2xep2": (4, ["--tp", "2", "--ep", "2", "--experts", "shared"]),
    # the same on grouped experts (model/experts.py: one GEMM per projection, the adapter on all
    # of the layer's tokens), the GPU's default experts
    "shared-grouped": (1, ["--experts", "shared", "--grouped"]),
    "shared-grouped-ep2": (2, ["--ep", "2", "--experts", "shared", "--grouped"]),
    "shared-grouped-tp2xep2": (4, ["--tp", "2", "--ep", "2", "--experts", "shared", "--grouped"]),
}


def peft_model(checkpoint: Path, values: dict, monkeypatch):
    import peft
    import peft.utils.transformers_weight_conversion as conv
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(conv, "convert_peft_config_for_transformers", lambda *a, **k: None)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(**peft_config(LORA)))
    result = peft.set_peft_model_state_dict(pm, values)
    assert not result.unexpected_keys, result.unexpected_keys
    missing = [k for k in result.missing_keys if "lora_" in k]
    assert not missing, missing
    return pm


def reference(pm) -> tuple[list[torch.Tensor], dict]:
    """PEFT's token log-probs and its adapter gradients of the worker's GSPO step."""
    batch = fixed_batch()
    tokens, masks = batch.row_values("tokens"), batch.row_values("loss_mask")
    rows = [pm(torch.tensor([t])).logits[0].log_softmax(-1) for t in tokens]
    logp = [r[:-1].gather(-1, torch.tensor(t[1:]).unsqueeze(-1)).squeeze(-1)
            for r, t in zip(rows, tokens)]  # fmt: skip
    n = max(len(t) for t in tokens) - 1
    logp_BT = torch.stack([torch.nn.functional.pad(lp, (0, n - len(lp))) for lp in logp])
    mask_BT = torch.tensor([[int(v) for v in m[1:]] + [0] * (n - len(m) + 1) for m in masks])
    loss, _ = policy_loss(logp_BT, logp_BT.detach(), batch["advantages"], mask_BT,
                          kind="gspo", clip_low=0.2, clip_high=0.28,
                          loss_scale_denominator=loss_denominator(mask_BT, kind="gspo"))  # fmt: skip
    loss.backward()
    grads = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n}
    return [lp.detach() for lp in logp], grads


def tied(grads: dict, rank: int) -> dict:
    """PEFT's per-expert adapter gradients -> those of one adapter the experts share, repeated in
    every expert: the sum over experts (lora_A [r*E, in] expert-major; lora_B [out, r*E], expert
    e's column j at j*E + e)."""
    out = dict(grads)
    for key, g in grads.items():
        if ".mlp.experts." not in key:
            continue
        if "lora_A" in key:
            e = g.shape[0] // rank
            out[key] = g.view(e, rank, -1).sum(0).repeat(e, 1)
        else:
            e = g.shape[1] // rank
            out[key] = g.view(-1, rank, e).sum(-1, keepdim=True).expand(-1, rank, e).flatten(1)
    return out


def per_expert(state: dict) -> dict:
    """transformers 5's fused expert tensors [E, 2F, H] / [E, H, F] under the checkpoint's
    per-expert names (experts.{e}.gate_proj / up_proj / down_proj), as the bridge writes them."""
    out = {}
    for name, t in state.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and t.dim() == 3:
            out.update({f"{base}.{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_matches_peft(layout, tiny_models, tmp_path, monkeypatch):
    nproc, flags = LAYOUTS[layout]
    out, model = tmp_path / "out.pt", tiny_models["moe4" if "--vpp" in flags else "moe"]
    run_distributed(WORKER, nproc, str(model), str(out), *flags, out=None)
    got = torch.load(out)
    pm = peft_model(model, got["values"], monkeypatch)
    logp, grads = reference(pm)
    if "shared" in flags:
        grads = tied(grads, LORA.rank)
        a = next(v for k, v in got["values"].items() if ".experts." in k and "lora_A" in k)
        assert torch.equal(a[: LORA.rank], a[-LORA.rank :])  # one adapter, repeated
    for mine, ref in zip(got["logprobs"], logp):
        torch.testing.assert_close(torch.tensor(mine[1:]), ref, atol=1e-5, rtol=0)
    assert set(got["grads"]) == set(grads)
    for key, ref in grads.items():
        torch.testing.assert_close(got["grads"][key], ref, atol=1e-5, rtol=0, msg=key)
    assert max(g.abs().max() for g in grads.values()) > 1e-3  # the gradients are not all zero
    merged = per_expert(pm.merge_and_unload().state_dict())
    assert set(got["merged"]) <= set(merged)
    for name, t in got["merged"].items():
        torch.testing.assert_close(t, merged[name], atol=1e-6, rtol=0, msg=name)
    # a sync after the first sends the adapted tensors only: every attention and MLP
    # projection, no embedding, norm or router
    adapted = ("_proj.weight",)
    assert got["changed"] == sorted(n for n in got["merged"] if n.endswith(adapted))
    assert len(got["changed"]) < len(got["merged"])


@pytest.mark.parametrize(
    "layout", ["single", "tp2xep2", "shared-tp2xep2", "shared-grouped-tp2xep2"]
)
def test_lora_checkpoint_resumes_exactly_without_the_base(layout, tiny_models, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    nproc, flags = LAYOUTS[layout]
    out, ckpt = tmp_path / "out.pt", tmp_path / "ckpt"
    run_distributed(WORKER, nproc, str(tiny_models["moe"]), str(out), *flags,
                    "--resume", str(ckpt), out=None)  # fmt: skip
    got = torch.load(out)
    assert got["straight"] == got["resumed"]
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.endswith((".weight", ".A")) or ".B." in k]
    assert weights and all("_lora." in k for k in weights), weights[:5]
    assert (ckpt / "lora.json").is_file()


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_convert_exports_the_merged_model_and_a_peft_adapter(experts, tiny_models, tmp_path):
    """A checkpoint saved under EP2, exported on one rank: the merged HF model and PEFT's
    loading of the adapter onto the base both give the trainer's log-probs at the save (a shared
    expert adapter: repeated in each expert of the PEFT adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, out, step = tiny_models["moe_all"], tmp_path / "out.pt", tmp_path / "step_2"
    run_distributed(WORKER, 2, str(base), str(out), "--ep", "2", "--resume", str(step / "model"),
                    "--experts", experts, out=None)  # fmt: skip
    want = [torch.tensor(r[1:]) for r in torch.load(out)["at_save"]]
    hf = tmp_path / "hf"
    proc = run_cli(["convert", "lora-to-hf", "--checkpoint", str(step), "--out", str(hf)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = f"wrote {hf} (HF model, adapters merged) and {hf / 'adapter'} (PEFT adapter)"
    assert proc.stdout.splitlines()[-1] == said
    seqs = fixed_batch().row_values("tokens")
    for mine, ref in zip(hf_token_logprobs(hf, seqs), want):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), hf / "adapter")
    with torch.no_grad():
        for tokens, ref in zip(seqs, want):
            logp = pm(torch.tensor([tokens])).logits[0].log_softmax(-1)[:-1]
            got = logp.gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    untrained = hf_token_logprobs(base, seqs)
    assert max((a - b).abs().max() for a, b in zip(untrained, want)) > 1e-3  # it moved


def test_the_merged_models_config_names_the_dtype_of_its_weights(tmp_path):
    """A bf16 base whose config.json says float32 (an HF export of an earlier version did so):
    the adapters merge into its bf16 weights, and the merged model's config says bfloat16, the
    rest of it the base's; transformers loads it in bf16. It used to copy the base's config."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    base, step, hf = tmp_path / "base", tmp_path / "step_2", tmp_path / "hf"
    make_tiny_model(TinySpec(dtype="bfloat16", layers=1), base)
    cfg = {**json.loads((base / "config.json").read_text()), "dtype": "float32"}
    (base / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    run_distributed(WORKER, 1, str(base), str(tmp_path / "out.pt"), "--resume",
                    str(step / "model"), out=None)  # fmt: skip
    proc = run_cli(["convert", "lora-to-hf", "--checkpoint", str(step), "--out", str(hf)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {t.dtype for t in load_file(hf / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((hf / "config.json").read_text()) == {**cfg, "dtype": "bfloat16"}
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def lora_step(tiny_models, tmp_path_factory) -> Path:
    """A LoRA checkpoint (rank 4, every target, per-expert adapters) saved on one rank."""
    step = tmp_path_factory.mktemp("lora") / "step_2"
    run_distributed(WORKER, 1, str(tiny_models["moe_all"]), str(step.parent / "out.pt"),
                    "--resume", str(step / "model"), out=None)  # fmt: skip
    return step


def _edit_record(rec: dict, change: str) -> str | None:
    """Apply one named damage to a lora.json record; a str is written as the file instead."""
    lora = rec["lora"]
    edits = {
        "rank 2": lambda: lora.update(rank=2),
        "rank -1": lambda: lora.update(rank=-1),
        "unknown target": lambda: lora.update(targets=["nope"]),
        "shared experts": lambda: lora.update(experts="shared"),
        "bogus experts": lambda: lora.update(experts="bogus"),
        "no lora": lambda: rec.pop("lora"),
        "extra key": lambda: lora.update(extra=1),
        "alpha NaN": lambda: lora.update(alpha=float("nan")),
        "fewer targets": lambda: lora.update(targets=["linear_qkv"]),
    }
    if change == "not JSON":
        return "{bad"
    edits[change]()
    return None


@pytest.mark.parametrize(
    "change, message",
    [
        ("rank 2", "layers.0.self_attention.linear_qkv_lora.A is (12, 64), lora.json implies "
                   "(6, 64)"),
        ("rank -1", "lora.json: lora.rank must be an integer >= 1, not -1"),
        ("unknown target", "lora.json: lora.targets: unknown target 'nope'"),
        ("shared experts", "disagrees with the adapters saved beside it: 20 adapter tensor(s) "
                           "differ"),
        ("bogus experts", "lora.json: lora.experts 'bogus' is not one of"),
        ("no lora", 'lora.json has no "lora" object'),
        ("extra key", "must hold exactly ['alpha', 'dropout', 'experts', 'rank', 'targets'] "
                      "(not so: ['extra'])"),
        ("alpha NaN", "lora.json: lora.alpha must be a finite number > 0, not nan"),
        ("fewer targets", "disagrees with the adapters saved beside it: "),
        ("not JSON", "lora.json is not valid JSON"),
    ],
)  # fmt: skip
def test_lora_to_hf_refuses_a_record_that_disagrees_with_the_adapters(
    lora_step, tmp_path, change, message
):
    """A lora.json that disagrees with the saved tensors used to give a traceback
    (CheckpointException, AttributeError, KeyError, TypeError, JSONDecodeError), or exit 0 with
    NaN in every merged weight (alpha NaN) or half the trained adapters dropped (fewer
    targets)."""
    bad = tmp_path / "step"
    shutil.copytree(lora_step, bad)
    path = bad / "model" / "lora.json"
    rec = json.loads(path.read_text())
    text = _edit_record(rec, change)
    path.write_text(text if text is not None else json.dumps(rec))
    out = tmp_path / "hf"
    proc = run_cli(["convert", "lora-to-hf", "--checkpoint", str(bad), "--out", str(out)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp*"))


def test_lora_to_hf_refuses_a_truncated_adapter_file(lora_step, tmp_path):
    bad = tmp_path / "step"
    shutil.copytree(lora_step, bad)
    f = bad / "model" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    out = tmp_path / "hf"
    proc = run_cli(["convert", "lora-to-hf", "--checkpoint", str(bad), "--out", str(out)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot read dist-checkpoint {bad / 'model'} (a file is truncated or corrupt); "
        "re-copy it"
    )
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lora_to_hf_stopped_by_a_signal_mid_write_leaves_nothing_behind(lora_step, tmp_path, sig):
    """SIGTERM (a job scheduler's stop) used to end the export with its .OUT.tmp-XXXX left
    beside --out. Now it is removed; the files the user had there are as they were."""
    (tmp_path / "mine.txt").write_text("mine")
    out = tmp_path / "hf"
    rc, err = stopped_mid_write(
        ["convert", "lora-to-hf", "--checkpoint", str(lora_step), "--out", str(out)], out, sig
    )
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
    assert (tmp_path / "mine.txt").read_text() == "mine"
    # SIGTERM: SystemExit(143); SIGINT: the CLI's one line "interrupted" and exit 130
    assert rc == 128 + sig, err[-2000:]


@pytest.mark.parametrize("command", ["megatron-to-hf", "score"])
def test_a_lora_checkpoint_given_as_a_model_names_lora_to_hf(lora_step, tmp_path, command):
    """It used to say "no config.json ...; point at an HF checkpoint directory"."""
    out = tmp_path / "o"
    args = {
        "megatron-to-hf": ["convert", "megatron-to-hf", "--megatron", str(lora_step),
                           "--out", str(out)],
        "score": ["score", "--checkpoint", str(lora_step), "--input", str(tmp_path / "in"),
                  "--output", str(out)],
    }[command]  # fmt: skip
    proc = run_cli(args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {lora_step} holds LoRA adapters, not a model; make the model with "
        f"`megatron-gspo convert lora-to-hf --checkpoint {lora_step} --out NEW_DIR` and use that"
    )
    assert not out.exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


def test_lora_to_hf_takes_a_moved_base_from_base(tiny_models, tmp_path):
    """A base moved since the run: the error named editing base_path in lora.json (whose
    checksum the checkpoint's manifest holds); now --base NEW_PATH exports the same files as
    before the move (the PEFT adapter naming the base where it is now), and a --base that is
    another model is one line, nothing written. The export's stderr has no warning: torch's
    FutureWarnings from the dist-checkpoint load came with their source lines."""
    base, step = Path(shutil.copytree(tiny_models["moe_all"], tmp_path / "base")), tmp_path / "s"
    run_distributed(WORKER, 1, str(base), str(tmp_path / "out.pt"), "--resume",
                    str(step / "model"), out=None)  # fmt: skip
    convert = ["convert", "lora-to-hf", "--checkpoint", str(step)]
    proc = run_cli([*convert, "--out", str(tmp_path / "before")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [ln for ln in proc.stderr.splitlines() if "Warning" in ln], proc.stderr
    moved = base.rename(tmp_path / "moved")
    proc = run_cli([*convert, "--out", str(tmp_path / "x")])
    assert proc.returncode == 2 and not (tmp_path / "x").exists()
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "does not exist; put the base model the adapters were trained on back there, or pass "
            "--base PATH where it is now"
        )
    )
    proc = run_cli([*convert, "--base", str(moved), "--out", str(tmp_path / "after")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [ln for ln in proc.stderr.splitlines() if "Warning" in ln], proc.stderr
    before, after = _files(tmp_path / "before"), _files(tmp_path / "after")
    config = "adapter/adapter_config.json"
    assert before.pop(config).replace(str(base).encode(), str(moved).encode()) == after.pop(config)
    assert before == after and "model.safetensors" in after
    other = tiny_models["moe"]
    proc = run_cli([*convert, "--base", str(other), "--out", str(tmp_path / "wrong")])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: --base {other} is not the base model the adapters were trained on ({base} when "
        f"saved): its files differ from base_fingerprint in {step / 'model' / 'lora.json'}; "
        "pass that model's directory"
    ]
    assert not (tmp_path / "wrong").exists()
