"""The built-in server's fp8 weights (`--quantization fp8`, server/quantize.py): every linear
weight lands on the e4m3 grid of its own scale, at the grid point nearest to the weight; the
router, embeddings, norms and lm_head are left as they are; the result is the same however the
weights arrive (checkpoint, per-expert names, fused names); HF's forward on the rounded weights
gives the server's log-probs."""

import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.hf.io import HFReader
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.server.model import RolloutModel

pytestmark = pytest.mark.unit


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8 e4m3fn value, from the format: 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal; exponent 15 with mantissa 7 is NaN."""
    values = [m / 8 * 2.0**-6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor(values[:-1], dtype=torch.float64)  # the last is NaN; 448 the largest


def assert_nearest_on_grid(orig: torch.Tensor, got: torch.Tensor) -> None:
    """got = grid point nearest to orig, on the scale amax|orig| / 448 of that tensor."""
    grid = e4m3_grid()
    assert grid.max() == 448
    scale = orig.double().abs().max() / 448
    x = (orig.double() / scale).abs().flatten()
    nearest = (x[:, None] - grid[None, :]).abs().min(1).values
    q = (got.double() / scale).abs().flatten()
    err = (q - x).abs()
    # on the grid (up to fp32 rounding of the scaled value) and no farther than the nearest point
    assert ((q[:, None] - grid[None, :]).abs().min(1).values <= 1e-5 * q.clamp(min=1)).all()
    assert (err <= nearest + 1e-5 * x.clamp(min=1)).all()
    assert torch.equal(got.sign(), orig.sign()) or (got[orig.sign() != got.sign()] == 0).all()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    spec = TinySpec(arch="qwen3_moe", layers=3, dense_layers=[0], init_std=0.2)
    return make_tiny_model(spec, tmp_path_factory.mktemp("fp8") / "m")


def _weights(path) -> dict[str, torch.Tensor]:
    reader = HFReader(path)
    return {n: reader.get(n).float() for n in reader.keys()}


def test_linear_weights_are_rounded_to_the_e4m3_grid_the_rest_left_alone(ckpt):
    plain = RolloutModel.from_pretrained(ckpt, torch.float32)
    fp8 = RolloutModel.from_pretrained(ckpt, torch.float32, quantization="fp8")
    rounded = left = 0
    for name, w in _weights(ckpt).items():
        got = fp8._target(name)
        assert torch.equal(plain._target(name), w)
        linear = name.endswith("_proj.weight")  # q k v o, dense and expert gate up down
        if linear:
            assert not torch.equal(got, w), name
            assert_nearest_on_grid(w, got)
            rounded += 1
        else:  # embeddings, norms, router gate, lm_head
            assert torch.equal(got, w), name
            left += 1
    spec = fp8.spec
    experts = 2 * spec.num_experts * 3  # two MoE layers, gate/up/down per expert
    assert rounded == experts + 4 * spec.num_layers + 3 and left > spec.num_layers


def test_the_same_weights_whichever_way_they_arrive(ckpt):
    """Checkpoint, one HF name per expert, or the fused expert tensors: the same fp8 weights."""
    weights = _weights(ckpt)
    a = RolloutModel.from_pretrained(ckpt, torch.bfloat16, quantization="fp8")
    b = RolloutModel(a.spec, torch.bfloat16, quantization="fp8")
    b.load_weights(weights.items())
    c = RolloutModel(a.spec, torch.bfloat16, quantization="fp8")
    fused = {}
    for i in (1, 2):
        p = f"model.layers.{i}.mlp.experts."
        per = [[weights.pop(f"{p}{j}.{w}_proj.weight") for j in range(a.spec.num_experts)]
               for w in ("gate", "up", "down")]  # fmt: skip
        fused[p + "gate_up_proj"] = torch.cat([torch.stack(per[0]), torch.stack(per[1])], 1)
        fused[p + "down_proj"] = torch.stack(per[2])
    c.load_weights([*weights.items(), *fused.items()])
    for name in a.hf_names():
        assert torch.equal(a._target(name), b._target(name)), name
        assert torch.equal(a._target(name), c._target(name)), name


def test_server_logprobs_equal_hf_on_the_rounded_weights(ckpt):
    """The fp8 server computes what HF computes on the rounded weights (fp32 compute), and
    differs from the unrounded model by more than rounding of fp32 would."""
    import transformers

    fp8 = RolloutModel.from_pretrained(ckpt, torch.float32, quantization="fp8")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(5, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        plain = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
        for name, p in hf.named_parameters():
            p.copy_(fp8._target(name))
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    mine = torch.log_softmax(fp8.full_logits(tokens).logits[0], -1)
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)
    assert (mine - plain).abs().max() > 1e-3


def test_unknown_quantization_is_a_user_error(ckpt):
    with pytest.raises(UserError, match="unknown quantization 'int4'"):
        RolloutModel.from_pretrained(ckpt, torch.float32, quantization="int4")


def test_rollout_quantization_reaches_both_servers_and_sglang_on_a_cpu_is_refused(ckpt):
    """`rollout.quantization: fp8` is `--quantization fp8` on either server's command line;
    SGLang's CPU build has no fp8 kernels, so on a CPU host that is a one-line error before
    anything starts (with a GPU it goes through)."""
    from pathlib import Path

    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.server_config import ServerConfig, size_sglang

    root = Path(__file__).resolve().parents[2]
    keys = [f"model.path={ckpt}", "rollout.backend=sglang", "rollout.quantization=fp8"]
    cfg = load_config(root / "configs" / "tiny_moe_gspo.yaml", keys)
    server = ServerConfig(model_path=str(ckpt), kind="sglang", quantization="fp8")
    with pytest.raises(UserError, match="with SGLang needs a GPU") as e:
        size_sglang(server, cfg, ckpt, longest_prompt=16, gpu=False)
    assert "rollout.backend=builtin" in str(e.value) and "\n" not in str(e.value)
    size_sglang(server, cfg, ckpt, longest_prompt=16, gpu=True)
    assert " --quantization fp8 " in " ".join(server.command(1)) + " "
    det = load_config(root / "configs" / "tiny_moe_gspo.yaml",
                      [*keys[:2], "rollout.deterministic=true"])  # fmt: skip
    with pytest.raises(UserError, match="deterministic with SGLang needs a GPU") as e:
        size_sglang(ServerConfig(model_path=str(ckpt), kind="sglang"), det, ckpt, 16, gpu=False)
    assert "rollout.backend=builtin" in str(e.value) and "\n" not in str(e.value)
    builtin = ServerConfig(model_path=str(ckpt), quantization="fp8")
    assert " --quantization fp8 " in " ".join(builtin.command(1)) + " "
    with pytest.raises(UserError, match="rollout.quantization"):
        load_config(root / "configs" / "tiny_moe_gspo.yaml", ["rollout.quantization=int8"]).check()
