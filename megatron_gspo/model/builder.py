"""Build a Megatron `TransformerConfig` + `GPTModel` chunks from an HF config (`ModelSpec`).

Our config meets megatron-core's here, at the edge. Qwen3-MoE maps as: RMSNorm, QK-norm per head,
RoPE (non-interleaved, theta from the config), GQA via `num_query_groups`, SwiGLU experts and dense
MLPs, softmax top-k router (`norm_topk_prob=True` is megatron's softmax over the top-k logits,
False is softmax over all experts then top-k), dense layers from `mlp_only_layers` /
`decoder_sparse_step` as `moe_layer_freq`, tied or untied embeddings. Dense Qwen3 / Qwen2 go
through the same function (Qwen2: qkv bias, no QK-norm).

Fusions that need CUDA kernels are off on a CPU; the Transformer Engine layer spec is used when TE
imports and the run is on a GPU, the local (pure torch) spec otherwise, with our RMSNorm
(`norm.py`) and SDPA core attention (`attention.py`). The output layer hands back hidden
states for the chunked LM head (`lm_head.py`) by default; with the head off it computes its
logits batch-major without sequence parallelism (`_batch_major_logits`).

MoE experts are grouped (`moe_grouped_gemm`: one GEMM per projection over all local experts, two
weight tensors per layer) or sequential (megatron's SequentialMLP: a matmul pair and two weight
tensors per expert; without Transformer Engine its loop over the experts runs as one autograd
node, `expert_loop.py`, bit for bit megatron's). Grouped is the default on a GPU: with
Transformer Engine megatron's TEGroupedMLP, without it `GroupedExperts` (experts.py, torch's
grouped GEMM). On a CPU the default stays sequential: grouped experts run torch's CPU grouped
kernel there (on bench_pack.py's training phase 3-7% faster than megatron's own loop, 0.99x
`expert_loop.py`'s time, at another float rounding), but sequential ones keep the studies'
numbers (docs/results.md) and let weight sync lend each expert's weights without a transposing
copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import ModelSpec
from megatron_gspo.model.lm_head import DEFAULT_CHUNK_TOKENS, DEFAULT_KEEP_MB, use_chunked_lm_head
from megatron_gspo.model.modes import Recompute
from megatron_gspo.model.norm import use_local_rmsnorm
from megatron_gspo.model.parallel import ParallelDims, device_type
from megatron_gspo.model.without_te import have_transformer_engine

VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class BuildOptions:
    params_dtype: torch.dtype | None = None  # None: the checkpoint's dtype (fp32 for new models)
    padded_vocab_size: int | None = None  # None: round vocab up to VOCAB_PAD_MULTIPLE
    token_dispatcher: str = "alltoall"  # alltoall | allgather
    recompute: Recompute | str | None = None  # None (none) | full | selective
    routing_replay: bool = False
    init_weights: bool = False  # random init (False: weights are loaded right after)
    sequence_parallel: bool | None = None  # None: on when tp > 1 (MoE needs it)
    use_transformer_engine: bool | None = None  # None: when importable and on a GPU
    moe_grouped_gemm: bool | None = None  # None: grouped experts on a GPU, sequential on a CPU
    # Tokens per chunk of the LM head (model/lm_head.py: log-probs from hidden states, never the
    # whole logits); 0: the output layer's logits, whole.
    lm_head_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    lm_head_keep_mb: int = DEFAULT_KEEP_MB  # logits up to this size are not recomputed

    def __post_init__(self):
        if not isinstance(self.lm_head_chunk_tokens, int) or self.lm_head_chunk_tokens < 0:
            raise UserError(f"lm_head_chunk_tokens must be an integer >= 0 (0: off), "
                            f"not {self.lm_head_chunk_tokens!r}")  # fmt: skip

    def grouped(self) -> bool:
        if self.moe_grouped_gemm is None:
            return device_type() == "cuda"
        return self.moe_grouped_gemm

    def uses_te(self) -> bool:
        if self.use_transformer_engine is None:
            return device_type() == "cuda" and have_transformer_engine()
        return self.use_transformer_engine


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Vocab rounded up so every TP rank holds an equal slice; independent of tp when possible."""
    step = math.lcm(multiple, tp)
    return -(-vocab_size // step) * step


def transformer_config(spec: ModelSpec, dims: ParallelDims, opts: BuildOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = device_type() == "cuda"
    dtype = opts.params_dtype or torch.float32
    sp = dims.tp > 1 if opts.sequence_parallel is None else opts.sequence_parallel
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.virtual_stages,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
        sequence_parallel=sp,
        use_cpu_initialization=not on_gpu,
        perform_initialization=opts.init_weights,
        # Kernels that exist only with CUDA / TE / apex.
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        # Batched isend/irecv post send_prev/recv_prev/send_next/recv_next in one order on every
        # rank; with pp=2 "prev" and "next" are the same peer, and gloo matches messages by
        # posting order, so an activation would land in a gradient buffer. The unbatched path
        # orders operations by rank parity, which gloo matches correctly.
        batch_p2p_comm=on_gpu,
        # megatron-core 0.16's default ("full") is its own deprecated spelling of the whole
        # layer, which warns on every build; [] is the same, without the warning.
        cuda_graph_scope=[],
    )
    kwargs.update(_recompute_fields(Recompute(opts.recompute or Recompute.NONE), spec, opts))
    if spec.is_moe:
        kwargs.update(_moe_fields(spec, opts))
    return TransformerConfig(**_known_fields(TransformerConfig, kwargs))


def _recompute_fields(mode: Recompute, spec: ModelSpec, opts: BuildOptions) -> dict:
    """full: every layer recomputed from its input; selective: the core attention, and with
    grouped experts their activation too (megatron recomputes `moe_act` only there)."""
    if mode is Recompute.FULL:
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if mode is Recompute.SELECTIVE:
        grouped = spec.is_moe and opts.grouped()
        modules = ["core_attn", "moe_act"] if grouped else ["core_attn"]
        return dict(recompute_granularity="selective", recompute_modules=modules)
    return {}


def _moe_fields(spec: ModelSpec, opts: BuildOptions) -> dict:
    """TransformerConfig's MoE fields for an HF Qwen3-MoE router and experts."""
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.topk,
        moe_router_score_function="softmax",
        # HF norm_topk_prob=False: softmax over all experts, then top-k (unnormalized).
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=[int(m) for m in spec.moe_layers],
        moe_token_dispatcher_type=opts.token_dispatcher,
        moe_grouped_gemm=opts.grouped(),
        moe_permute_fusion=False,
        moe_router_fusion=False,  # it silently skips routing replay
        moe_enable_routing_replay=opts.routing_replay,
    )


def _known_fields(cls, kwargs: dict) -> dict:
    """Drop options this megatron-core version does not have (feature detection, not pins)."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing = {k for k in kwargs if k not in names}
    required = {"num_layers", "hidden_size", "num_attention_heads", "moe_enable_routing_replay"}
    if missing & required and any(kwargs[k] for k in missing & required):
        raise UserError(f"this megatron-core lacks {sorted(missing & required)}; upgrade it")
    return {k: v for k, v in kwargs.items() if k in names}


def build_model(spec: ModelSpec, dims: ParallelDims, opts: BuildOptions = BuildOptions()):
    """Build this rank's model chunks (one per virtual pipeline stage). Parallel state must exist."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_gspo.model.attention import use_sdpa_attention
    from megatron_gspo.model.expert_loop import use_expert_loop
    from megatron_gspo.model.experts import use_grouped_experts
    from megatron_gspo.model.rope import use_rotary_halves

    dims.validate(spec)
    config = transformer_config(spec, dims, opts)
    use_te = opts.uses_te()
    vocab = opts.padded_vocab_size or padded_vocab_size(spec.vocab_size, dims.tp)
    if vocab % dims.tp:
        raise UserError(f"--tp {dims.tp} does not divide the padded vocabulary {vocab}")
    chunks = []
    for vp_stage in range(dims.chunks):
        vp = vp_stage if dims.chunks > 1 else None
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp
        )
        if not use_te:
            use_local_rmsnorm(layer_spec)
            use_sdpa_attention(layer_spec)
            use_grouped_experts(layer_spec)
            use_expert_loop(layer_spec)
            use_rotary_halves()
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
            vp_stage=vp,
        )
        if device_type() == "cuda":  # megatron puts its parallel layers there; the rest follows
            model.cuda(torch.cuda.current_device())
        model.model_spec = spec
        model.padded_vocab_size = vocab
        if model.post_process and opts.lm_head_chunk_tokens:
            use_chunked_lm_head(model.output_layer, opts.lm_head_chunk_tokens, opts.lm_head_keep_mb)
        elif model.post_process and not config.sequence_parallel:
            _batch_major_logits(model.output_layer)
        _mark_tensor_parallel(model)
        chunks.append(model)
    return chunks


def _batch_major_logits(output_layer) -> None:
    """Have the output layer compute its logits batch-major.

    GPTModel returns `logits.transpose(0, 1).contiguous()` ([s, b, V] -> [b, s, V]): a copy of
    the full-vocabulary logits in forward and of their gradient in backward, the largest tensors
    of the step. Transposing the hidden states instead (V / h times smaller) and handing back the
    [s, b, V] view of [b, s, V] logits makes that transpose a view and `.contiguous()` a no-op;
    the values are the same matmul's. Not under sequence parallelism, where the layer all-gathers
    its input along dim 0 (the sequence)."""
    forward = output_layer.forward

    def batch_major(input_, *args, **kwargs):
        start = output_layer.logits_from  # a window: the positions before it are not needed
        logits, bias = forward(input_[start:].transpose(0, 1).contiguous(), *args, **kwargs)
        return logits.transpose(0, 1), bias

    output_layer.logits_from = 0
    output_layer.forward = batch_major


def set_logits_from(chunk, start: int) -> None:
    """Compute the chunk's logits from sequence position `start` on (it returns [b, s - start,
    V]); positions before it carry no loss (the prompt). Only where the output layer was
    rewritten (the chunked head, or batch-major logits: not under sequence parallelism); else
    all s positions are computed, which `next_token_logprobs` takes as well."""
    layer = getattr(getattr(chunk, "module", chunk), "output_layer", None)
    if layer is not None and hasattr(layer, "logits_from"):
        layer.logits_from = start


def _mark_tensor_parallel(model) -> None:
    """Tag TP-split weights the way megatron's initializers do.

    megatron-core sets `tensor_model_parallel` / `partition_dim` on parallel linear weights only
    inside its weight initializers, so a model built with `perform_initialization=False` (weights
    loaded right after) lacks them; the optimizer then treats every shard as a TP duplicate and
    the grad norm counts TP rank 0 alone. Grouped experts (GroupedMLP and its subclasses) are
    split over expert-TP like their SequentialMLP counterparts: weight1 [H, E*2F] along its
    columns (dim 1, fc1's output), weight2 [E*F, H] along its rows (dim 0, fc2's input).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megatron.core.transformer.moe.experts import GroupedMLP

    for module in model.modules():
        if isinstance(module, GroupedMLP):
            _mark(module.weight1, 1)
            _mark(module.weight2, 0)
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None:
            _mark(weight, dim)


def _mark(weight, dim: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if not hasattr(weight, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(weight, True, dim, 1)
