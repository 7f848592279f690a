"""The built-in server's plain-torch model against an HF transformers forward of the same tiny
checkpoint: log-probs, routed experts, KV-cache decoding, weight loading by HF name."""

import pytest
import torch

from megatron_gspo.errors import UserError
from megatron_gspo.hf.io import HFReader, write_index
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.server import model as rollout_model
from megatron_gspo.server.model import Chunk, RolloutModel

pytestmark = pytest.mark.unit

SPECS = {
    "qwen3_moe": TinySpec(arch="qwen3_moe", layers=3, dense_layers=[0], init_std=0.2),
    "qwen3": TinySpec(arch="qwen3", init_std=0.2),
    "qwen2": TinySpec(arch="qwen2", init_std=0.2, tie_embeddings=True),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_model(spec, root / arch) for arch, spec in SPECS.items()}


def hf_forward(path, tokens: list[int], model: RolloutModel | None = None):
    """HF logits (and router logits); Qwen2's zero-initialised q/k/v biases are randomised first
    and copied into `model` by name, so the bias path is checked too."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        biases = [(n, p.normal_(std=0.5)) for n, p in hf.named_parameters() if n.endswith("bias")]
        if model is not None:
            model.load_weights(biases)
        out = hf(torch.tensor([tokens]), output_router_logits=hf.config.model_type == "qwen3_moe")
    return hf, out


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(SPECS))
def test_full_logprobs_equal_hf(ckpts, arch):
    tokens = prompt(24)
    model = RolloutModel.from_pretrained(ckpts[arch])
    _, out = hf_forward(ckpts[arch], tokens, model)
    ref = torch.log_softmax(out.logits[0].float(), -1)
    mine = torch.log_softmax(model.full_logits(tokens).logits[0], -1)
    assert ref.std() > 0.5  # a model whose predictions vary, so the check means something
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_both_expert_paths_equal_hf(ckpts, monkeypatch, grouped_mm):
    if grouped_mm and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    monkeypatch.setattr(rollout_model, "_GROUPED_MM", grouped_mm)
    tokens = prompt(24, seed=2)
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    _, out = hf_forward(ckpts["qwen3_moe"], tokens)
    ref = torch.log_softmax(out.logits[0].float(), -1)
    mine = torch.log_softmax(model.full_logits(tokens).logits[0], -1)
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)


def test_routed_experts_equal_hf_router_topk(ckpts):
    tokens = prompt(32, seed=1)
    hf, out = hf_forward(ckpts["qwen3_moe"], tokens)
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    routed_TLk = model.full_logits(tokens, record_routing=True).routed[0]
    assert model.moe_layer_ids == [1, 2]
    assert routed_TLk.shape == (32, 2, 2) and routed_TLk.dtype == torch.int32
    for layer, router_logits in enumerate(out.router_logits):  # MoE layers only
        want = torch.topk(router_logits.float(), hf.config.num_experts_per_tok, -1).indices
        assert torch.equal(routed_TLk[:, layer].sort(-1).values, want.sort(-1).values.int())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_kv_cache_decoding_equals_full_forward(ckpts, arch):
    """Two sequences in one cache, prefilled and decoded in mixed batches (continuous batching)."""
    model = RolloutModel.from_pretrained(ckpts[arch])
    a, b = prompt(20, seed=2), prompt(13, seed=3)
    full_a = model.full_logits(a).logits[0]
    full_b = model.full_logits(b).logits[0]
    cache = model.new_cache(slots=1, capacity=4)  # both grow during the test
    got_a, got_b = [], []
    out = model.forward([Chunk(slot=3, start=0, tokens=a[:6], logits_from=0)], cache)
    got_a.append(out.logits[0])
    # b's prefill joins a's decode steps; then both decode one token per step.
    out = model.forward([Chunk(3, 6, a[6:7]), Chunk(0, 0, b[:9], logits_from=0)], cache)
    got_a.append(out.logits[0])
    got_b.append(out.logits[1])
    for i in range(9, 13):
        out = model.forward([Chunk(0, i, b[i : i + 1]), Chunk(3, i - 2, a[i - 2 : i - 1])], cache)
        got_b.append(out.logits[0])
        got_a.append(out.logits[1])
    out = model.forward([Chunk(3, 11, a[11:], logits_from=0)], cache)
    got_a.append(out.logits[0])
    # each chunk's last row, batched: what the sampler reads
    out = model.forward([Chunk(0, 0, b[:5], logits_from=2), Chunk(3, 0, a[:7])], cache)
    torch.testing.assert_close(out.last_BV, torch.stack([out.logits[0][-1], out.logits[1][-1]]))
    torch.testing.assert_close(torch.cat(got_a), full_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), full_b, atol=1e-4, rtol=0)


def test_load_weights_by_hf_name(ckpts, tmp_path):
    other = make_tiny_model(TinySpec(**{**SPECS["qwen3_moe"].__dict__, "seed": 7}), tmp_path / "o")
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    want = RolloutModel.from_pretrained(other).full_logits(prompt(10)).logits[0]
    reader = HFReader(other)
    assert model.load_weights((n, reader.get(n)) for n in reader.keys()) == len(reader.keys())
    torch.testing.assert_close(model.full_logits(prompt(10)).logits[0], want, atol=0, rtol=0)

    # The transformers-5 fused expert layout loads into the same experts.
    gate = torch.stack(
        [reader.get(f"model.layers.1.mlp.experts.{j}.gate_proj.weight") for j in range(8)]
    )
    up = torch.stack(
        [reader.get(f"model.layers.1.mlp.experts.{j}.up_proj.weight") for j in range(8)]
    )
    model.load_weights([("model.layers.1.mlp.experts.gate_up_proj", torch.cat([up, gate], 1))])
    assert torch.equal(model.experts[1]["gate"], up) and torch.equal(model.experts[1]["up"], gate)

    with pytest.raises(UserError, match="does not belong"):
        model.load_weights([("model.layers.0.mlp.experts.0.up_proj.weight", up[0])])
    with pytest.raises(UserError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_checkpoint_reads_into_the_weights_and_a_bad_file_changes_nothing(ckpts, tmp_path):
    """load_checkpoint reads each tensor straight into its weight (fp32), or through a
    temporary when the dtypes differ (a bf16 server); a truncated shard is refused before any
    weight is written."""
    src = ckpts["qwen3_moe"]
    reader = HFReader(src)
    model = RolloutModel.from_pretrained(src)
    assert all(torch.equal(model._target(n), reader.get(n)) for n in model.hf_names())
    half = RolloutModel.from_pretrained(src, dtype=torch.bfloat16)
    assert all(
        torch.equal(half._target(n), reader.get(n).to(torch.bfloat16)) for n in half.hf_names()
    )

    other = make_tiny_model(TinySpec(**{**SPECS["qwen3_moe"].__dict__, "seed": 5}), tmp_path / "o")
    shard = other / "model-00001-of-00001.safetensors"  # indexed: opened only when read
    (other / "model.safetensors").rename(shard)
    write_index(other, {n: shard.name for n in reader.keys()}, 0)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)
    before = {n: model._target(n).clone() for n in model.hf_names()}
    with pytest.raises(UserError, match="truncated"):
        model.load_checkpoint(other)
    assert all(torch.equal(model._target(n), t) for n, t in before.items())


def test_partial_update_lands_in_fused_layout_and_matches_hf(ckpts, tmp_path):
    """Updating only some tensors (a k projection inside the fused q|k|v weight, a q-norm weight
    that the forward keeps expanded per head, one expert) gives HF's forward of those weights."""
    import transformers

    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    tokens = prompt(20, seed=5)
    model.full_logits(tokens)  # derived per-head norm weights are built here, then must refresh
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["qwen3_moe"], dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    names = [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.mlp.experts.3.down_proj.weight",
    ]
    update = [(n, torch.randn(model._target(n).shape, generator=g) * 0.3) for n in names]
    assert model.load_weights(update) == len(update)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, t in update:
            if ".experts." in name:  # transformers 5 keeps the experts fused: [E, D, F]
                hf_params["model.layers.2.mlp.experts.down_proj"][3].copy_(t)
            else:
                hf_params[name].copy_(t)
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    mine = torch.log_softmax(model.full_logits(tokens).logits[0], -1)
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)
    s = model.spec
    q_rows, kv_rows = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    k_part = model.fused["model.layers.1.qkv"][q_rows : q_rows + kv_rows]
    assert torch.equal(k_part, update[0][1])  # the k rows of the one fused q|k|v matmul


def test_long_sequence_past_the_rope_table_equals_hf(ckpts):
    """Positions beyond the first rope table (256) and a cache that grows block by block."""
    tokens = prompt(300, seed=6)
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])
    _, out = hf_forward(ckpts["qwen3_moe"], tokens)
    ref = torch.log_softmax(out.logits[0].float(), -1)
    cache = model.new_cache(1, 64)
    got = [model.forward([Chunk(0, 0, tokens[:200], logits_from=0)], cache).logits[0]]
    for i in range(200, 300):
        got.append(model.forward([Chunk(0, i, tokens[i : i + 1])], cache).logits[0])
    mine = torch.log_softmax(torch.cat(got), -1)
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)


def test_engine_shared_prefill_equals_separate_prefills(ckpts, monkeypatch):
    """The n samples of one prompt prefill once (k/v rows and logits copied to the others):
    greedy tokens, log-probs, prompt log-probs and routed experts are those of separate prefills."""
    from megatron_gspo.server import engine as rollout_engine
    from megatron_gspo.server.engine import Engine, Request
    from megatron_gspo.server.sampling import SamplingParams

    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"])

    def generate() -> list[Request]:
        eng = Engine(model, eos_ids=set(), record_routing=True)
        model.forward([Chunk(15, 0, [1, 2])], eng.cache)  # the cache grown by a forward
        for seed in (1, 2):
            for _ in range(5):
                sp = SamplingParams(max_new_tokens=5, temperature=0)
                eng.waiting.append(
                    Request(
                        prompt(9 + seed, seed),
                        sp,
                        return_logprob=True,
                        logprob_start_len=0,
                        return_routed=True,
                    )  # fmt: skip
                )
        reqs = list(eng.waiting)
        while eng.running or eng.waiting:
            eng._admit()
            eng._step()
        return [
            (r.output_ids, r.output_logprobs, r.input_logprobs, eng.routed_experts(r)) for r in reqs
        ]

    shared = generate()
    monkeypatch.setattr(rollout_engine, "_shared_prefills", lambda chunks: list(range(len(chunks))))
    separate = generate()
    for (ids, lps, ilps, routed), (ids2, lps2, ilps2, routed2) in zip(shared, separate):
        assert ids == ids2 and torch.equal(routed, routed2)
        assert lps == pytest.approx(lps2, abs=1e-5)
        assert ilps[0] is None and ilps[1:] == pytest.approx(ilps2[1:], abs=1e-5)


def test_experts_narrower_than_16_bytes_are_served(tmp_path):
    """Experts of 4 values are 8 bytes a row in bf16, below what torch's grouped matmul takes
    ("strides should be multiple of 16 bytes"): a bf16 server of such a model goes through the
    per-expert loop, and its log-probs equal HF's fp32 forward within bf16 rounding (a bf16
    rollout server of a drift model with 256 experts of width 4 failed every request)."""
    spec = TinySpec(arch="qwen3_moe", layers=2, experts=16, topk=4, moe_ffn=4, init_std=0.2)
    path = make_tiny_model(spec, tmp_path / "narrow")
    tokens = prompt(16)
    model = RolloutModel.from_pretrained(path, torch.bfloat16)
    assert not model.grouped_mm and RolloutModel.from_pretrained(path).grouped_mm
    _, out = hf_forward(path, tokens)
    ref = torch.log_softmax(out.logits[0].float(), -1)
    mine = torch.log_softmax(model.full_logits(tokens).logits[0].float(), -1)
    assert ref.std() > 0.5
    assert (mine - ref).abs().mean() < 0.1


def _mixed_step(model: RolloutModel, seed: int):
    """A cache holding 12 prompts prefilled one by one (each alone), and one step's chunks over
    it: decode steps at several positions, and two new prompts' prefills."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        prompt(int(n), seed + i) for i, n in enumerate(torch.randint(4, 40, (12,), generator=g))
    ]
    cache = model.new_cache(slots=16, capacity=64)
    for slot, p in enumerate(prompts):
        model.forward([Chunk(slot, 0, p)], cache)
    chunks = [Chunk(slot, len(p), [7 + slot]) for slot, p in enumerate(prompts)]
    chunks += [Chunk(12, 0, prompt(9, seed + 50)), Chunk(13, 0, prompt(23, seed + 51))]
    return cache, chunks


def _rows_alone_and_batched(model: RolloutModel, seed: int):
    cache, chunks = _mixed_step(model, seed)
    saved = [t.clone() for t in cache.k + cache.v]

    def restore():
        for t, s in zip(cache.k + cache.v, saved, strict=True):
            t.copy_(s)

    batched = model.forward(chunks, cache).last_BV
    alone = []
    for c in chunks:
        restore()
        alone.append(model.forward([c], cache).last_BV[0])
    return batched, torch.stack(alone)


INVARIANT_CASES = {  # (dtype, quantization, the experts' grouped matmul)
    "bf16-fp8": (torch.bfloat16, "fp8", True),
    "fp32-grouped": (torch.float32, None, True),
    "fp32-loop": (torch.float32, None, False),
}


@pytest.mark.parametrize("case", list(INVARIANT_CASES))
def test_batch_invariant_rows_are_their_forward_alone(ckpts, monkeypatch, case):
    """--enable-deterministic-inference: in a step mixing decode steps at several positions with
    prefills, every row's logits are bit for bit those of its forward alone (so a sample does
    not depend on what it is batched with), in a bf16 fp8 server and in an fp32 one through
    torch (where no compiled decode kernel is attached), with either expert path. The plain
    batched forward, whose rows attend over the batch's longest, is not. In fp32 a product of
    1-3 rows takes another kernel in MKL than one of 4 or more (gemm_rows.py): without the
    padding to 4 rows, 7 of 10 such steps moved a row here."""
    dtype, quantization, grouped = INVARIANT_CASES[case]
    if grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    monkeypatch.setattr(rollout_model, "_GROUPED_MM", grouped)
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"], dtype, quantization)
    assert model.decode_kernel is None  # (the torch path; the compiled step is tested apart)
    model.batch_invariant = True
    for seed in range(4):
        batched, alone = _rows_alone_and_batched(model, seed)
        assert torch.equal(batched, alone), seed
    model.batch_invariant = False
    moved = [not torch.equal(*_rows_alone_and_batched(model, seed)) for seed in range(4)]
    assert any(moved)  # (what the mode is for: a plain batch moves some rows' bits)


def test_padded_expert_blocks_put_each_row_in_its_experts_block():
    """Blocks of 3, 0, 5, 1 rows padded to 4, 0, 5, 4: each row's place, written out."""
    from megatron_gspo.gemm_rows import MIN_GEMM_ROWS, padded_blocks

    assert MIN_GEMM_ROWS == 4
    expert_N = torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 3])
    at_N, padded_E = padded_blocks(torch.tensor([3, 0, 5, 1]), expert_N)
    assert padded_E.tolist() == [4, 0, 5, 4]
    assert at_N.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_batch_invariant_products_take_one_kernel_whatever_their_size(ckpts):
    """torch computes a bf16 product with oneDNN or with its own kernel by the product's size
    (batch x rows x inner x columns against 16^3), and the two round differently. A decode
    step's attention (softmax [rows x kv heads, heads per kv head, k_len] times v) crosses that
    size between 2 and 3 rows at a position: a deterministic server's sample changed its
    log-probs from its 18th token when it decoded beside one row instead of two (about 1 draw in
    300 below differs without the mode). With `batch_invariant` each batch element's product is
    the same bits whatever the batch; turned off, oneDNN is back as it was."""
    model = RolloutModel.from_pretrained(ckpts["qwen3_moe"], torch.bfloat16, "fp8")
    before = torch.backends.mkldnn.enabled
    model.batch_invariant = True
    try:
        g = torch.Generator().manual_seed(0)
        for draw in range(3000):
            k_len = 24 + draw % 9  # 2 rows x 2 kv heads: under the size; 3 rows: over it
            p = torch.softmax(torch.randn(6, 2, k_len, generator=g) * 3, -1).to(torch.bfloat16)
            v = torch.randn(6, k_len, 16, generator=g).to(torch.bfloat16)
            assert torch.equal(torch.bmm(p[:4], v[:4]), torch.bmm(p, v)[:4]), draw
    finally:
        model.batch_invariant = False
    assert torch.backends.mkldnn.enabled == before
