"""One formula each, with its source: weights, KV cache, LoRA adapters, training activations.

Every function takes a config, a preset name or local directory, or a ``ModelShape``, and returns
bytes (or a parameter count) for the architecture alone: no GPU, no weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, BITS_PER_PARAMETER, DEFAULT_LORA_TARGET_MODULES, FP32_BYTES, QUANTIZED_DTYPES,
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
    stay bf16.
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
    return 2 * shape.key_value_width * compute_bytes(dtype)


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
    check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
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
    shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int
) -> int:
    p = precision.compute_bytes
    attention_norm = norm_saved_bytes_per_token(shape, precision, consuming_linears=3)
    mlp_norm = norm_saved_bytes_per_token(shape, precision, consuming_linears=2)
    attention = attention_saved_bytes_per_token(shape, p, attn_implementation, seq_len)
    mlp = 4 * p * shape.intermediate_size
    return attention_norm + attention + mlp_norm + mlp


def attention_saved_bytes_per_token(shape: ModelShape, p: int, attn_implementation: str, seq_len: int) -> int:
    """What the attention itself saves (rotated q, k, v, output and logsumexp; eager: probabilities)."""
    if attn_implementation == "eager":
        # Softmax runs in fp32 and is cast back to p; in pure fp32 the cast is the same tensor.
        probabilities_bytes = FP32_BYTES + (p if p != FP32_BYTES else 0)
        return p * 4 * shape.query_width + shape.num_attention_heads * seq_len * probabilities_bytes
    return p * (2 * shape.query_width + 2 * shape.key_value_width) + FP32_BYTES * shape.num_attention_heads


# What a LoRA adapter's input is, by the targeted Linear's name: the output of a norm (saved by no
# one else when the norm is frozen), the attention output (saved by the attention already) or the
# SwiGLU product (saved by no one else when down_proj's base is frozen).
ADAPTER_INPUTS = {"q_proj": "attention_norm", "k_proj": "attention_norm", "v_proj": "attention_norm",
                  "qkv_proj": "attention_norm", "o_proj": "attention_output", "gate_proj": "mlp_norm",
                  "up_proj": "mlp_norm", "gate_up_proj": "mlp_norm", "down_proj": "mlp_product"}


def lora_layers_activation_bytes_per_token(
    shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int, rank: int,
    target_modules, autocast: bool,
) -> int:
    """Bytes all decoder layers save for backward per token under LoRA (PEFT, frozen base).

    Measured tensor by tensor on CPU (tests/test_memory.py): frozen norms save only their fp32
    input and rsqrt (no normalized copy); frozen Linears save no input; the attention is unchanged;
    the MLP saves gate, silu(gate) and up. Each adapter's A saves its input and B saves A's output
    (rank values). PEFT casts the input to the adapter's fp32 and, under autocast, autocast casts it
    back: a copy per adapter (fp32 without autocast, the compute dtype with it). Only on an fp32 base
    without autocast is no copy made, and adapters reading the same tensor share it.
    """
    h, p = shape.hidden_size, precision.compute_bytes
    per_layer = (2 * (FP32_BYTES * h + FP32_BYTES) + attention_saved_bytes_per_token(shape, p, attn_implementation, seq_len)
                 + 3 * p * shape.intermediate_size)
    targets = lora_targets(shape, target_modules)
    copied = autocast or precision.residual_bytes != FP32_BYTES
    adapter_bytes = p if autocast else FP32_BYTES
    if copied:
        inputs = sum(layer.in_features * adapter_bytes for layer in targets)
    else:
        shared = {"attention_norm": FP32_BYTES * h, "mlp_norm": FP32_BYTES * h, "attention_output": 0,
                  "mlp_product": FP32_BYTES * shape.intermediate_size}
        distinct = {}
        for layer in targets:
            kind = ADAPTER_INPUTS.get(layer.name.rsplit(".", 1)[-1])
            key = (layer.name.rsplit(".", 2)[0] if kind else layer.name, kind)  # one tensor per layer and kind
            distinct[key] = shared[kind] if kind else FP32_BYTES * layer.in_features
        inputs = sum(distinct.values())
    return shape.num_layers * per_layer + inputs + len(targets) * rank * adapter_bytes


def norm_saved_bytes_per_token(
    shape: ModelShape, precision: Precision, consuming_linears: int
) -> int:
    """What one RMSNorm and the Linear layers reading its output save, per token."""
    h = shape.hidden_size
    fp32_input = FP32_BYTES * h
    normalized = precision.residual_bytes * h
    if precision.autocast_casts:  # autocast casts the input again for every Linear
        linear_inputs = consuming_linears * precision.compute_bytes * h
    else:
        linear_inputs = precision.residual_bytes * h
    return fp32_input + normalized + linear_inputs + FP32_BYTES  # + the rsqrt scalar



def weights_explanation(shape: ModelShape, dtype: str, share: float = 1.0) -> str:
    if dtype in QUANTIZED_DTYPES:
        how = (f"{shape.parameters:,} params: Linear weights at {BITS_PER_PARAMETER[dtype]} bits "
               "+ scales, embeddings/norms/lm_head in bf16 (bitsandbytes)")
    else:
        how = f"{shape.parameters:,} params x {BITS_PER_PARAMETER[dtype] // 8} B ({dtype})"
    return how + share_note(share)


def share_note(share: float) -> str:
    return f", this GPU's {share:.0%} of the layers" if share < 1 else ""
