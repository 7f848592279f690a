"""The CPU speed-ups of the local spec compute what megatron-core's own code computes.

SDPA core attention against megatron's `DotProductAttention` (values and gradients, GQA, causal),
the identity chunk sort and the single-rank buffer collectives against the unpatched functions,
and the weight-gradient accumulation into `main_grad` against x^T g written out.
One subprocess: the CPU layer patches process-wide state.
"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = r"""
import torch
from megatron_gspo.model.parallel import ParallelDims, init_distributed
init_distributed(ParallelDims())
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_gspo.model.attention import SdpaAttention

torch.manual_seed(0)
cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0)
args = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
ref, ours = DotProductAttention(**args), SdpaAttention(**args)
s, b = 7, 3
def inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, 4, 16, generator=g).requires_grad_()
    k = torch.randn(s, b, 2, 16, generator=g).requires_grad_()
    v = torch.randn(s, b, 2, 16, generator=g).requires_grad_()
    return q, k, v
results = []
for module in (ref, ours):
    q, k, v = inputs()
    out = module(q, k, v, None)
    (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
    results.append((out.detach(), q.grad, k.grad, v.grad))
assert results[0][0].shape == results[1][0].shape == (s, b, 64), results[1][0].shape
for a, c in zip(*results):
    assert torch.allclose(a, c, atol=1e-5, rtol=1e-5), (a - c).abs().max()
# Causal: the first position attends to itself only (its output is its value).
q, k, v = inputs()
first = ours(q, k, v, None)[0].reshape(b, 4, 16)
assert torch.allclose(first, v[0].detach().repeat_interleave(2, dim=1), atol=1e-6)
# A mask tensor goes to megatron's own forward.
mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
q, k, v = inputs()
assert torch.allclose(ours(q, k, v, mask), ref(q, k, v, mask), atol=1e-6)
print("attention ok")

# Packed (THD): each sequence of cu_seqlens alone through megatron's attention, causal within it
# and blind across; on the CPU flash kernel (4-D inputs), not the math path; sequences of one
# length (three of 5, two of 1) in one call give what each gives packed alone, bit for bit.
from megatron.core.packed_seq_params import PackedSeqParams
def thd_of(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return cu, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
lens = [5, 1, 7, 5, 3, 1, 5]
cu, thd = thd_of(lens)
g = torch.Generator().manual_seed(4)
q, k, v = (torch.randn(sum(lens), n, 16, generator=g).requires_grad_() for n in (4, 2, 2))
with torch.profiler.profile() as prof:
    out = ours(q, k, v, None, packed_seq_params=thd)
    (out * torch.arange(out.numel()).reshape(out.shape).cos()).sum().backward()
kernels = {e.key for e in prof.key_averages()}
assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels, kernels
assert "aten::_scaled_dot_product_attention_math" not in kernels
w = torch.arange(out.numel()).reshape(out.shape).cos()
for a, n in zip(cu[:-1].tolist(), lens):
    qs, ks, vs = (t.detach()[a:a + n, None].clone().requires_grad_() for t in (q, k, v))
    alone = ref(qs, ks, vs, None)
    assert torch.allclose(out[a:a + n], alone[:, 0], atol=1e-5), (out[a:a + n] - alone[:, 0]).abs().max()
    (alone[:, 0] * w[a:a + n]).sum().backward()
    for packed, single in ((q, qs), (k, ks), (v, vs)):
        assert torch.allclose(packed.grad[a:a + n], single.grad[:, 0], atol=1e-5)
    qs, ks, vs = (t.detach()[a:a + n].clone().requires_grad_() for t in (q, k, v))
    own = ours(qs, ks, vs, None, packed_seq_params=thd_of([n])[1])
    assert torch.equal(own, out[a:a + n])
    (own * w[a:a + n]).sum().backward()
    for packed, single in ((q, qs), (k, ks), (v, vs)):
        assert torch.equal(packed.grad[a:a + n], single.grad)
print("packed attention ok")

from megatron.core.transformer.moe import moe_utils, token_dispatcher
x = torch.randn(10, 4)
split = torch.tensor([3, 0, 5, 2])
same, probs = token_dispatcher.sort_chunks_by_idxs(x, split, torch.arange(4))
assert same is x and probs is None
perm = torch.tensor([2, 0, 3, 1])
got, _ = token_dispatcher.sort_chunks_by_idxs(x, split, perm)
want, _ = moe_utils.sort_chunks_by_idxs(x, split, perm)
assert torch.equal(got, want) and not torch.equal(got, x)
print("sort ok")

import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as pgb
buf = torch.arange(12.0)
before = buf.clone()
pgb.dist_reduce_scatter_func(buf[:], buf, group=dist.group.WORLD)
pgb.dist_all_gather_func(buf, buf[:], group=dist.group.WORLD)
assert torch.equal(buf, before)
out = torch.zeros(12)
pgb.dist_all_gather_func(out, buf, group=dist.group.WORLD)
assert torch.equal(out, before)
print("collectives ok")

# Gradient-accumulation fusion: two backwards add x^T g into main_grad, as the unfused layer's
# weight gradients would sum; a layer without main_grad (not DDP-held) is left unfused.
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron_gspo.model.cpu_compat import enable_wgrad_accumulation
lin = ColumnParallelLinear(16, 8, config=cfg, init_method=cfg.init_method, bias=False)
other = ColumnParallelLinear(16, 8, config=cfg, init_method=cfg.init_method, bias=False)
lin.weight.main_grad = torch.zeros(8, 16)
lin.weight.grad_added_to_main_grad = False
assert enable_wgrad_accumulation([torch.nn.ModuleList([lin, other])]) == 1
assert lin.gradient_accumulation_fusion and not other.gradient_accumulation_fusion
want = torch.zeros(8, 16)
for seed in (2, 3):
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(seed + 10))
    out, _ = lin(x)
    (out * w).sum().backward()
    want += w.reshape(-1, 8).t() @ x.reshape(-1, 16)
assert lin.weight.grad_added_to_main_grad
assert torch.allclose(lin.weight.main_grad, want, atol=1e-5), (lin.weight.main_grad - want).abs().max()
print("wgrad ok")

# Gradient scaling (clipping) on megatron's buffers goes through torch's in-place multi-tensor
# multiply on a CPU too; the norm stays megatron's per-tensor one there.
from megatron.core import utils as mutils
from megatron.core.optimizer import clip_grads, optimizer as moptimizer
from megatron_gspo.model.without_te import foreach_scale
assert clip_grads.multi_tensor_scale_impl is foreach_scale
assert moptimizer.multi_tensor_scale_impl is foreach_scale
assert clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm
print("scale ok")
"""


def test_cpu_speedups_match_megatron():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in (
        "attention ok",
        "packed attention ok",
        "sort ok",
        "collectives ok",
        "wgrad ok",
        "scale ok",
    ):
        assert part in proc.stdout
