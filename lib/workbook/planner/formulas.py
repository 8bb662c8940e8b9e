"""One formula each, with its source: weights, KV cache, LoRA adapters, training activations.

Every function takes a config, a preset name or local directory, or a ``ModelShape``, and returns
bytes (or a parameter count) for the architecture alone: no GPU, no weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from workbook import presets
from workbook.planner.architectures import (
    DOCUMENT_SDPA, FLEX_ATTENTION, SDPA_BLOCK_MASK, SDPA_MATH, TRAINING_ATTENTIONS, LatentAttention,
    attention_implementation_run,
)
from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, BITS_PER_PARAMETER, DEFAULT_LORA_TARGET_MODULES, FP32_BYTES, INT64_BYTES,
    QUANTIZED_DTYPES,
    ModelShape, canonical_dtype, check_choice, compute_bytes, lora_targets, model_shape, require_non_negative,
    require_positive,
)

# bitsandbytes quantization constants (its defaults): LLM.int8 keeps one fp32 scale per output row;
# NF4 keeps one fp32 absmax per block of 64 weights (bnb_4bit_use_double_quant=False).
NF4_BLOCK_SIZE = 64


def weights_bytes(model: PretrainedConfig | ModelShape | str, dtype: str) -> int:
    """Bytes of the model's weights stored in ``dtype`` (fp32, bf16, fp16, int8, int4).

    fp32/bf16/fp16: parameters x 4 or 2 bytes, exactly what ``sum(p.numel() * p.element_size())``
    gives for the loaded model. int8/int4 follow bitsandbytes (``load_in_8bit``/``load_in_4bit``):
    every ``nn.Linear`` except the lm_head is quantized, with its scales (LLM.int8: one fp32 per
    output row; NF4: one fp32 absmax per 64 weights); embeddings, norms, biases and the lm_head
    stay bf16, and so do mixture-of-experts experts: transformers 5.x stores them as 3-D parameters,
    not ``nn.Linear``, and ``replace_with_bnb_linear`` swaps ``nn.Linear`` only.
    """
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    if dtype not in QUANTIZED_DTYPES:
        return shape.parameters * BITS_PER_PARAMETER[dtype] // 8
    quantized = [layer for layer in shape.linear_layers if not layer.is_output_embedding]
    quantized_weights = sum(layer.in_features * layer.out_features for layer in quantized)
    if dtype == "int8":
        scale_bytes = sum(layer.out_features * FP32_BYTES for layer in quantized)
    else:
        scale_bytes = sum(
            math.ceil(layer.in_features * layer.out_features / NF4_BLOCK_SIZE) * FP32_BYTES
            for layer in quantized
        )
    kept_in_bf16 = shape.parameters - quantized_weights
    return (
        math.ceil(quantized_weights * BITS_PER_PARAMETER[dtype] / 8)
        + scale_bytes
        + kept_in_bf16 * BITS_PER_PARAMETER["bf16"] // 8
    )


@dataclass(frozen=True)
class TokenCost:
    """What one token costs a model: the numbers the bench's rooflines and the forecast's phases are made of."""

    weights_bytes: int  # streamed once per forward (an untied input embedding left out: rows are gathered)
    kv_bytes_per_token: int  # one context position's keys and values, all layers
    matmul_flops: int  # per token: 2 per matmul weight (one multiply-add)
    attention_flops: int  # per token per position attended: 4 x layers x heads x head_dim (scores, weighted values)


def token_cost(model: PretrainedConfig | str, dtype: str) -> TokenCost:
    """Norms, rotary embeddings and the softmax are left out (well under 1%)."""
    config = presets.load_config(model) if isinstance(model, str) else model
    shape = model_shape(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    streamed = shape.parameters - (0 if tied else shape.vocab_size * shape.hidden_size)
    matmul = sum(layer.in_features * layer.out_features for layer in shape.linear_layers)
    return TokenCost(weights_bytes=streamed * BITS_PER_PARAMETER[canonical_dtype(dtype)] // 8,
                     kv_bytes_per_token=kv_cache_bytes_per_token(shape, dtype), matmul_flops=2 * matmul,
                     attention_flops=4 * shape.num_layers * shape.query_width)


def kv_cache_bytes_per_token(model: PretrainedConfig | ModelShape | str, dtype: str) -> int:
    """Bytes one token adds to the KV cache of one sequence, all layers, while under any window.

    2 (key and value) x layers x key/value heads x head_dim x bytes per value. Grouped-query
    attention stores only the key/value heads. int8/int4 weights keep a bf16 cache.
    """
    shape = model_shape(model)
    return shape.num_layers * kv_bytes_per_token_per_layer(shape, dtype)


def kv_cache_bytes(
    model: PretrainedConfig | ModelShape | str,
    dtype: str,
    *,
    batch_size: int,
    tokens: int,
    last_step_tokens: int = 1,
) -> int:
    """Bytes transformers' DynamicCache holds for ``batch_size`` sequences of ``tokens`` tokens.

    Full-attention layers hold every token. A sliding-window layer (DynamicSlidingWindowLayer)
    keeps a view of the last ``window - 1`` tokens, but that view keeps alive the tensor
    ``torch.cat`` built in the last step, so it holds ``min(tokens, window - 1 + last_step_tokens)``
    tokens: all of the prompt right after prefill (``last_step_tokens = tokens``), then ``window``
    tokens while decoding one token per step (transformers 5.x cache_utils.py).
    """
    shape = model_shape(model)
    require_positive(batch_size=batch_size, tokens=tokens, last_step_tokens=last_step_tokens)
    if last_step_tokens > tokens:
        raise ValueError(f"last_step_tokens ({last_step_tokens}) cannot exceed tokens ({tokens})")
    per_layer = kv_bytes_per_token_per_layer(shape, dtype)
    held_tokens = sum(
        tokens if window is None else min(tokens, window - 1 + last_step_tokens)
        for window in shape.attention_windows
    )
    return batch_size * held_tokens * per_layer


def kv_bytes_per_token_per_layer(shape: ModelShape, dtype: str) -> int:
    """2 x kv_heads x head_dim values, or DeepSeek's compressed latent (planner/architectures.py)."""
    return shape.architecture.kv_cache_values_per_token_per_layer * compute_bytes(dtype)


def lora_parameter_count(
    model: PretrainedConfig | ModelShape | str,
    rank: int,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGET_MODULES,
) -> int:
    """Trainable parameters LoRA adds: rank x (in_features + out_features) per targeted Linear.

    Each target gets A (rank x in) and B (out x rank) (Hu et al. 2021, "LoRA", sec. 4.1). Targets
    match module names the way PEFT does: the full name, or its ending after a dot.
    """
    shape = model_shape(model)
    require_non_negative(lora_rank=rank)
    targeted = lora_targets(shape, target_modules)
    return sum(rank * (layer.in_features + layer.out_features) for layer in targeted)



def training_activation_bytes_per_layer(
    model: PretrainedConfig | ModelShape | str,
    *,
    batch_size: int,
    seq_len: int,
    dtype: str = "bf16",
    mixed_precision: bool = True,
    attn_implementation: str = "sdpa",
) -> int:
    """Bytes autograd saves for backward in one decoder layer (no gradient checkpointing).

    Counted tensor by tensor for transformers' Llama layer (verified on CPU against
    ``torch.autograd.graph.saved_tensors_hooks``), per token:
    - each RMSNorm saves its input upcast to fp32 (4h), the normalized value in the residual
      dtype (r h), its output as the next Linear's input (r h; under autocast each consuming
      Linear saves its own bf16 cast, 2h each: 3 for q/k/v, 2 for gate/up) and an fp32 rsqrt;
    - attention (sdpa or flash) saves rotated q, k, v, the output and an fp32 logsumexp per head:
      p (2 q_width + 2 kv_width) + 4 heads. eager saves q, k and v repeated to all heads, the
      output, and the probabilities as fp32 softmax plus their p copy: p 4 q_width + heads s (4+p);
    - the SwiGLU MLP saves gate, silu(gate), up and their product: 4 p intermediate.
    p is the compute dtype (2 for bf16), r the residual stream dtype (fp32 under autocast). The
    method is Korthikanti et al. 2022, "Reducing Activation Recomputation", sec. 4, applied to
    this block instead of GPT's (no dropout, SwiGLU, GQA, fp32 norm internals).
    """
    shape = model_shape(model)
    precision = training_precision(dtype, mixed_precision, lora=False)
    require_positive(batch_size=batch_size, seq_len=seq_len)
    check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS + TRAINING_ATTENTIONS)
    per_token = layer_activation_bytes_per_token(shape, precision, attn_implementation, seq_len)
    return batch_size * seq_len * per_token


@dataclass(frozen=True)
class Precision:
    """Byte sizes a training run uses. autocast_casts: fp32 weights cast per op (autocast)."""

    compute_bytes: int  # matmul inputs/outputs, attention, MLP
    residual_bytes: int  # the residual stream between layers (the model's own dtype)
    autocast_casts: bool


def training_precision(dtype: str, mixed_precision: bool, *, lora: bool) -> Precision:
    dtype = canonical_dtype(dtype)
    compute = compute_bytes(dtype)
    if lora:  # the frozen base runs in its own dtype; quantized bases dequantize to bf16
        residual = FP32_BYTES if dtype == "fp32" else 2
        return Precision(compute, residual, autocast_casts=False)
    autocast = mixed_precision and compute < FP32_BYTES
    return Precision(compute, FP32_BYTES if autocast else compute, autocast_casts=autocast)


def layer_activation_bytes_per_token(
    shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int, *,
    routed: bool | None = None, windowed: bool | None = None,
) -> int:
    """What one decoder layer saves per token: its attention (full or sliding-window) and its MLP (dense or
    routed experts). None picks the larger of the kinds the model has."""
    routed_kinds = [routed] if routed is not None else _kinds(shape.architecture.moe_layers, shape.num_layers)
    windowed_kinds = [windowed] if windowed is not None else _kinds(
        sum(_masked(window, seq_len) for window in shape.attention_windows), shape.num_layers)
    return (max(attention_saved_bytes_per_token(shape, precision, attn_implementation, seq_len, windowed=kind)
                for kind in windowed_kinds)
            + max(mlp_saved_bytes_per_token(shape, precision, routed=kind) for kind in routed_kinds))


def decoder_activation_bytes_per_token(
    shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int
) -> int:
    """All decoder layers together, per token: each layer's attention and MLP at its own kind."""
    moe_layers = shape.architecture.moe_layers
    attention = sum(attention_saved_bytes_per_token(shape, precision, attn_implementation, seq_len,
                                                    windowed=_masked(window, seq_len))
                    for window in shape.attention_windows)
    mlp = sum(count * mlp_saved_bytes_per_token(shape, precision, routed=routed)
              for routed, count in ((True, moe_layers), (False, shape.num_layers - moe_layers)) if count)
    return attention + mlp


def _masked(window: int | None, seq_len: int) -> bool:
    """A window shorter than the sequence needs an explicit mask (transformers skips it otherwise)."""
    return window is not None and window < seq_len


def _kinds(count: int, num_layers: int) -> list[bool]:
    return [kind for kind, present in ((True, count > 0), (False, count < num_layers)) if present]


def attention_saved_bytes_per_token(
    shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int, *, windowed: bool = False
) -> int:
    """The attention half of a layer, with the norm before it (and after it: Gemma)."""
    architecture = shape.architecture
    norms = norm_saved_bytes_per_token(shape, precision, consuming_linears=_attention_input_linears(architecture))
    norms += _post_norm_bytes_per_token(shape)
    p = precision.compute_bytes
    return (norms + attention_core_bytes_per_token(shape, p, attn_implementation, seq_len, windowed=windowed)
            + _attention_variant_bytes_per_token(shape, p))


def attention_core_bytes_per_token(
    shape: ModelShape, p: int, attn_implementation: str, seq_len: int, *, windowed: bool = False
) -> int:
    """What the attention itself saves, whether its projections train or not: rotated q, k, v, the output and
    the logsumexp (eager: the probabilities; a window: its mask and keys/values repeated to every head)."""
    architecture = shape.architecture
    attn_implementation = attention_implementation_run(architecture.sdpa_supported, attn_implementation)  # Gemma-2
    if architecture.latent_attention is not None:
        return _latent_attention_core_bytes_per_token(shape, p, attn_implementation, seq_len)
    windowed = windowed or attn_implementation == SDPA_BLOCK_MASK  # packed rows' 4D mask: as a window's
    if attn_implementation == "eager":
        # Softmax runs in fp32 and is cast back to p; in pure fp32 the cast is the same tensor.
        probabilities_bytes = FP32_BYTES + (p if p != FP32_BYTES else 0)
        attention = (
            p * 4 * shape.query_width
            + shape.num_attention_heads * seq_len * probabilities_bytes
        )
        if architecture.attention_logit_softcapping:  # tanh(scores / cap) saves its output
            attention += shape.num_attention_heads * seq_len * p
    else:
        # A sliding window is an explicit mask, and transformers then repeats keys and values to every head
        # itself (integrations/sdpa_attention.py, use_gqa_in_sdpa) instead of sdpa's grouped-query path.
        # torch converts that boolean mask to an additive one in the query's dtype at every call, and keeps
        # it for backward: one (batch, 1, seq, seq) tensor per windowed layer.
        # (one key/value head is repeated as a view: no copy). Flex attention runs grouped queries only
        # for a power-of-two count of heads; otherwise transformers repeats keys and values to every
        # head before the call (integrations/flex_attention.py), and the kernel keeps those copies.
        heads = shape.num_attention_heads
        flex_repeats = attn_implementation == FLEX_ATTENTION and heads & (heads - 1) != 0
        repeated = (windowed or flex_repeats) and shape.num_key_value_heads > 1
        key_value_width = shape.query_width if repeated else shape.key_value_width
        attention = p * (2 * shape.query_width + 2 * key_value_width)
        attention += FP32_BYTES * shape.num_attention_heads  # logsumexp kept for backward
        attention += p * seq_len if windowed else 0
        if attn_implementation == DOCUMENT_SDPA:  # each example's output is joined into one o_proj input
            attention += p * shape.query_width
    return attention


def _latent_attention_core_bytes_per_token(shape: ModelShape, p: int, attn_implementation: str, seq_len: int) -> int:
    """DeepSeek's MLA core (transformers' DeepseekV2Attention): query and key are new full-width tensors per head
    (nope and rotated rope parts joined by torch.cat / copy_), the value a slice of kv_b_proj's output; the
    rotary multiplies save only the frequencies all layers share."""
    latent, heads = shape.architecture.latent_attention, shape.num_attention_heads
    query_and_key = 2 * p * heads * latent.qk_head_dim
    output = p * heads * latent.v_head_dim
    if attn_implementation in ("eager", SDPA_MATH):
        # The matmuls save contiguous copies of q, k and v, softmax its probabilities (fp32, then cast back),
        # and o_proj gets a head-major copy of the output.
        probabilities_bytes = FP32_BYTES + (p if p != FP32_BYTES else 0)
        return query_and_key + 2 * output + heads * seq_len * probabilities_bytes
    # sdpa's kernel (memory-efficient: flash refuses unequal head dims) saves q, k, the value as a view that keeps
    # all of kv_b_proj's output alive (its key half too), the output and an fp32 logsumexp per head.
    value = p * heads * (latent.qk_nope_head_dim + latent.v_head_dim)
    return query_and_key + value + output + FP32_BYTES * heads


def latent_norms_bytes_per_token(latent: LatentAttention, p: int, *, frozen: bool) -> int:
    """MLA's norms inside the attention, over the latent (kv_a_layernorm) and the query's bottleneck
    (q_a_layernorm), per token: each saves its fp32 input and rsqrt; trained, also the normalized value and the
    next Linear's input (p each). In pure fp32 the latent's "upcast" input is a view of kv_a_proj_with_mqa's
    output, which keeps its rotary part alive too."""
    latent_input = latent.kv_lora_rank + (latent.qk_rope_head_dim if p == FP32_BYTES else 0)
    widths = [(latent_input, latent.kv_lora_rank)]
    if latent.q_lora_rank:
        widths.append((latent.q_lora_rank, latent.q_lora_rank))
    trained = 0 if frozen else 2 * p
    return sum(FP32_BYTES * (fp32_input + 1) + trained * width for fp32_input, width in widths)


def mlp_saved_bytes_per_token(shape: ModelShape, precision: Precision, *, routed: bool = False) -> int:
    """The MLP half of a layer, with the norm before it (and after it: Gemma): SwiGLU/GeGLU (gate, act(gate),
    up, their product) or the routed experts."""
    architecture = shape.architecture
    if routed:
        norm = norm_saved_bytes_per_token(shape, precision, consuming_linears=_router_linears(architecture.moe))
        return norm + experts_saved_bytes_per_token(shape, precision) + _post_norm_bytes_per_token(shape)
    norm = norm_saved_bytes_per_token(shape, precision, consuming_linears=1 if architecture.fused_qkv else 2)
    return norm + 4 * precision.compute_bytes * shape.intermediate_size + _post_norm_bytes_per_token(shape)


def _attention_input_linears(architecture) -> int:
    """Linear layers reading the attention norm's output (autocast casts it for each): q, k, v; Phi-3's fused
    qkv; MLA's query projection and kv_a_proj_with_mqa."""
    if architecture.fused_qkv:
        return 1
    return 2 if architecture.latent_attention is not None else 3


def _post_norm_bytes_per_token(shape: ModelShape) -> int:
    """Gemma's norm after attention and after the MLP (4 per layer): its fp32 input, the fp32 normalized value
    and the rsqrt; its output goes to the residual add, which saves nothing."""
    return FP32_BYTES * (2 * shape.hidden_size + 1) if shape.architecture.norms_per_layer == 4 else 0


def _attention_variant_bytes_per_token(shape: ModelShape, p: int) -> int:
    """What a family's attention saves beyond Llama's (measured tensor by tensor, tests/test_architectures.py)."""
    architecture = shape.architecture
    extra = 0
    if architecture.per_head_qk_norm:  # Qwen3, Gemma-3: q and k upcast to fp32 and normalized, + an fp32 rsqrt per head
        normalized = FP32_BYTES if architecture.norm_scales_in_fp32 else p
        extra += (FP32_BYTES + normalized) * (shape.query_width + shape.key_value_width)
        extra += FP32_BYTES * (shape.num_attention_heads + shape.num_key_value_heads)
    if architecture.fused_qkv:  # the value is a view of qkv_proj's output: it keeps q and k's part alive too
        extra += p * (shape.query_width + shape.key_value_width)
    if architecture.rotary_by_concatenation:  # attention's output is head-major: o_proj gets a real copy
        extra += p * shape.query_width
    if architecture.latent_attention is not None:
        extra += latent_norms_bytes_per_token(architecture.latent_attention, p, frozen=False)
    return extra


def experts_saved_bytes_per_token(shape: ModelShape, precision: Precision, *, frozen: bool = False) -> int:
    """A mixture-of-experts MLP, per token (transformers 5.x grouped_mm experts, its default).

    Each of the top-k routed experts saves its gathered input and its output (2 h) and gate|up, silu(gate) and
    their product (4 expert_intermediate); grouped_mm is not autocast, so experts compute in the weights' own
    dtype (fp32 master weights under autocast). Add the int64 ids of the routing (top-k, the sort's gather,
    the un-permute), the router's fp32 softmax (Mixtral/Qwen; DeepSeek's grouped sigmoid router is close),
    the top-k weights, and the shared experts as a dense SwiGLU (Qwen2-MoE also gates them with a sigmoid).
    ``frozen`` (LoRA): down projections save no input (the SwiGLU product) and the experts' output is not kept.
    """
    moe = shape.architecture.moe
    h, k, p = shape.hidden_size, moe.experts_per_token, precision.compute_bytes
    per_expert_values = h + 3 * moe.expert_intermediate_size if frozen else 2 * h + 4 * moe.expert_intermediate_size
    routed = k * per_expert_values * precision.residual_bytes
    routing_ids = 4 * k * INT64_BYTES
    router = FP32_BYTES * (moe.num_experts + k) + (FP32_BYTES * (k + 1) if moe.normalizes_top_k else 0)
    shared = (3 if frozen else 4) * p * moe.shared_intermediate_size
    if moe.shared_expert_gate:  # sigmoid(gate) x shared output saves both
        shared += p * (h + 1)
    return routed + routing_ids + router + shared


def _router_linears(moe) -> int:
    """Linear layers reading the post-attention norm's output in a MoE layer (autocast casts it for each)."""
    return 1 + (2 if moe.shared_intermediate_size else 0) + (1 if moe.shared_expert_gate else 0)


def norm_saved_bytes_per_token(
    shape: ModelShape, precision: Precision, consuming_linears: int
) -> int:
    """What one RMSNorm and the Linear layers reading its output save, per token."""
    h = shape.hidden_size
    fp32_input = FP32_BYTES * h
    # Gemma scales by (1 + weight) before the cast back: its normalized value is fp32 whatever the residual.
    normalized = (FP32_BYTES if shape.architecture.norm_scales_in_fp32 else precision.residual_bytes) * h
    if precision.autocast_casts:  # autocast casts the input again for every Linear
        linear_inputs = consuming_linears * precision.compute_bytes * h
    else:
        linear_inputs = precision.residual_bytes * h
    return fp32_input + normalized + linear_inputs + FP32_BYTES  # + the rsqrt scalar



def weights_explanation(shape: ModelShape, dtype: str) -> str:
    if dtype in QUANTIZED_DTYPES:
        how = (f"{shape.parameters:,} params: Linear weights at {BITS_PER_PARAMETER[dtype]} bits "
               "+ scales, embeddings/norms/lm_head in bf16 (bitsandbytes)")
        moe = shape.architecture.moe
        if moe is not None:  # transformers keeps experts as 3-D tensors; bitsandbytes swaps nn.Linear only
            how += f"; the {moe.expert_parameters:,} expert params are no nn.Linear and stay bf16"
    else:
        how = f"{shape.parameters:,} params x {BITS_PER_PARAMETER[dtype] // 8} B ({dtype})"
    return how
