"""The largest batch that fits on a GPU, and why: a memory plan read from the model's config.

Everything is in bytes and comes from the architecture alone (no GPU, no weights)::

    config = presets.load_config("llama-3.1-8b")
    plan = plan_generate(config, batch_size=32, prompt_len=512, new_tokens=2048,
                         gpu_memory_bytes=int(140.4 * GiB))
    plan.max_batch_size        # largest batch whose total stays under the budget
    plan.terms                 # weights, KV cache, activations, logits, overhead, each explained
    plan.to_dict()             # the same, for a metrics JSON

A plan is a list of ``Term`` s whose bytes add up to ``total_bytes``, the peak on one GPU. It fits
when ``total_bytes <= capacity_bytes * (1 - safety_margin)``. The formulas assume a Llama-style
decoder (the presets: Llama, Qwen2, Mistral): RMSNorm, rotary attention with grouped key/value
heads, a SwiGLU MLP and no dropout, run by transformers 5.x with its default DynamicCache. Every
formula lives in one function below, with its source; the activation formulas were checked
tensor by tensor against what autograd saves (tests/test_memory.py).

Conventions, so two readers get the same number:
- dtype names: fp32, bf16, fp16, int8, int4 (float32, bfloat16, float16 are accepted too).
  int8/int4 are weight formats only (bitsandbytes); activations and the KV cache are then bf16.
- "mixed precision" is torch autocast over fp32 master weights (the Hugging Face Trainer's
  ``bf16=True`` on a model loaded in fp32); ``mixed_precision=False`` keeps everything in
  ``dtype`` (a model loaded in bf16 and trained in bf16).
- The training peak is the sum of weights, gradients, optimizer states, activations and the loss
  buffers. In a real step gradients appear while activations are freed, so this is an upper bound
  by at most the gradient bytes; it is the convention of ZeRO (Rajbhandari et al. 2020, sec. 3) and
  Korthikanti et al. 2022, which count the two separately and add them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from transformers import PretrainedConfig

from workbook import presets

MiB = 2**20
GiB = 2**30

# Storage bits per weight, by the dtype name a user writes. int4 is NF4/FP4 (bitsandbytes).
BITS_PER_PARAMETER = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
QUANTIZED_DTYPES = ("int8", "int4")  # weights only: compute and KV cache run in bf16
ATTENTION_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
OPTIMIZERS = ("adamw", "adamw-8bit")
SHARDINGS = ("none", "fsdp")
DEFAULT_LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
)

# Priors, not measurements: the calibration notebook replaces them per GPU profile.
# The CUDA 12 context (lazy module loading) plus cuBLAS/cuDNN workspaces, what nvidia-smi shows for
# a process that has initialised torch and run a matmul: usually a few hundred MiB up to ~600.
DEFAULT_OVERHEAD_BYTES = 512 * MiB
# PyTorch's caching allocator rounds blocks up and cannot always reuse freed ones; reserved minus
# allocated bytes in a steady loop is often a few percent of the allocated bytes.
DEFAULT_FRAGMENTATION_FRACTION = 0.05
DEFAULT_SAFETY_MARGIN = 0.05  # keep 5% of the GPU free for whatever the plan does not model

FP32_BYTES = 4
INT64_BYTES = 8
# bitsandbytes quantization constants (its defaults): LLM.int8 keeps one fp32 scale per output row;
# NF4 keeps one fp32 absmax per block of 64 weights (bnb_4bit_use_double_quant=False);
# 8-bit Adam keeps one fp32 absmax per block of 256 values of each of its two states.
NF4_BLOCK_SIZE = 64
ADAM_8BIT_BLOCK_SIZE = 256
MAX_BATCH_SEARCH_LIMIT = 2**20  # max_batch_size never reports more than this


# ----------------------------------------------------------------------------------------------
# What a plan is made of.


@dataclass(frozen=True)
class Term:
    """One line of a memory plan: what it is, its bytes, and how they were computed."""

    name: str
    bytes: int
    explanation: str


@dataclass
class Plan:
    """The peak memory of one GPU for a generate or train run, and the largest batch that fits."""

    mode: str  # "generate" or "train"
    model: str
    params: int  # parameters of the whole model
    trainable_params: int  # 0 when generating
    dtype: str
    batch_size: int  # sequences per GPU (the micro-batch when training)
    lengths: dict[str, int]  # prompt_len and new_tokens, or seq_len (tokens)
    settings: dict  # everything else the plan depends on
    terms: list[Term]
    weights_bytes: int  # weights held by one GPU
    kv_cache_bytes_per_token: int | None  # generate only
    total_bytes: int  # sum of the terms: the peak on one GPU
    capacity_bytes: int  # memory of one GPU as the driver reports it
    gpu_count: int
    safety_margin: float  # fraction of capacity kept free
    fits: bool  # total_bytes <= budget_bytes
    max_batch_size: int  # largest batch that fits; 0 when not even batch 1 does
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int:
        """Bytes the plan may use on one GPU: capacity minus the safety margin."""
        return budget_bytes(self.capacity_bytes, self.safety_margin)

    def advice(self) -> str:
        """Empty when the plan fits; otherwise what to change, most effective first."""
        if self.fits:
            return ""
        need, have = self.total_bytes / GiB, self.budget_bytes / GiB
        if self.max_batch_size > 0:
            return (
                f"batch {self.batch_size} needs {need:.1f} GiB per GPU but {have:.1f} GiB is "
                f"available; the largest batch that fits is {self.max_batch_size}."
            )
        changes = _changes_that_save_memory(self)
        return (
            f"does not fit even at batch 1: batch {self.batch_size} needs {need:.1f} GiB per GPU "
            f"and {have:.1f} GiB is available "
            f"({self.capacity_bytes / GiB:.1f} GiB minus a {self.safety_margin:.0%} margin). "
            f"Try: {'; '.join(changes)}."
        )

    def require_fit(self) -> Plan:
        """This plan, or DoesNotFitError with the advice when it does not fit."""
        if not self.fits:
            raise DoesNotFitError(self.advice())
        return self

    def to_dict(self) -> dict:
        """A JSON-ready record; ``breakdown`` lists the terms in order."""
        record = asdict(self)
        record["breakdown"] = record.pop("terms")
        record["budget_bytes"] = self.budget_bytes
        return record


class DoesNotFitError(RuntimeError):
    """The plan exceeds the GPU's memory; the message says what to change."""


def budget_bytes(capacity_bytes: int, safety_margin: float) -> int:
    """The bytes a plan may use: ``capacity_bytes * (1 - safety_margin)``, rounded down."""
    return math.floor(capacity_bytes * (1 - safety_margin))


# ----------------------------------------------------------------------------------------------
# The model's sizes, read once from its config and its meta-device model.


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of the model: its qualified name and shape."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int
    has_bias: bool
    is_output_embedding: bool  # the lm_head: bitsandbytes leaves it unquantized

    @property
    def parameters(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.has_bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The sizes every formula needs. Build it with ``model_shape(config)``."""

    name: str
    parameters: int
    decoder_layer_parameters: int  # the largest decoder layer
    decoder_parameters: int  # all decoder layers together
    linear_layers: tuple[LinearLayer, ...]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    attention_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full

    @property
    def query_width(self) -> int:
        """Query (and attention output) features per token: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def key_value_width(self) -> int:
        """Key (or value) features per token: key/value heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def non_decoder_parameters(self) -> int:
        """Embeddings, final norm and (untied) lm_head."""
        return self.parameters - self.decoder_parameters


def model_shape(model: PretrainedConfig | ModelShape | str) -> ModelShape:
    """The sizes of ``model``: a config, a preset name or local directory, or a ModelShape."""
    if isinstance(model, ModelShape):
        return model
    config = presets.load_config(model) if isinstance(model, str) else model
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [name for name in _REQUIRED_CONFIG_FIELDS if getattr(text, name, None) is None]
    if missing:
        raise ValueError(
            f"the {config.model_type!r} config has no {', '.join(missing)}: the memory planner "
            "supports Llama-style decoders (Llama, Qwen2, Mistral and alike)"
        )
    meta_model = presets.build_on_meta_device(config)
    layers = _decoder_layers(meta_model, text.num_hidden_layers)
    layer_parameters = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    output_embedding = meta_model.get_output_embeddings()
    linear_layers = tuple(
        LinearLayer(
            name=name,
            in_features=module.in_features,
            out_features=module.out_features,
            has_bias=module.bias is not None,
            is_output_embedding=module is output_embedding,
        )
        for name, module in meta_model.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    num_attention_heads = text.num_attention_heads
    return ModelShape(
        name=_model_name(model, config),
        parameters=presets.count_parameters(config),
        decoder_layer_parameters=max(layer_parameters),
        decoder_parameters=sum(layer_parameters),
        linear_layers=linear_layers,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_attention_heads,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        attention_windows=_attention_windows(text),
    )


_REQUIRED_CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"
)


def _decoder_layers(meta_model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    for module in meta_model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(
        f"could not find the {num_layers} decoder layers in {type(meta_model).__name__}; the "
        "memory planner supports decoder-only models whose layers sit in one ModuleList"
    )


def _attention_windows(text_config: PretrainedConfig) -> tuple[int | None, ...]:
    """Per layer, how many past tokens attention sees (None: all), as transformers' cache reads it.

    Mirrors ``transformers.cache_utils.get_layer_types_and_kwargs``: explicit ``layer_types`` win;
    without them a set ``sliding_window`` makes every layer sliding (Mistral).
    """
    layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    sliding_window = getattr(text_config, "sliding_window", None)
    if layer_types is None:
        return (sliding_window,) * layers
    windows = {
        "sliding_attention": sliding_window,
        "chunked_attention": getattr(text_config, "attention_chunk_size", None),
    }
    return tuple(windows.get(layer_type) for layer_type in layer_types)


def _model_name(model, config: PretrainedConfig) -> str:
    if isinstance(model, str):
        return model
    return getattr(config, "name_or_path", "") or config.model_type


# ----------------------------------------------------------------------------------------------
# One formula each: weights, KV cache, LoRA adapters, activations.


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
    return shape.num_layers * _kv_bytes_per_token_per_layer(shape, dtype)


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
    _require_positive(batch_size=batch_size, tokens=tokens, last_step_tokens=last_step_tokens)
    if last_step_tokens > tokens:
        raise ValueError(f"last_step_tokens ({last_step_tokens}) cannot exceed tokens ({tokens})")
    per_layer = _kv_bytes_per_token_per_layer(shape, dtype)
    held_tokens = sum(
        tokens if window is None else min(tokens, window - 1 + last_step_tokens)
        for window in shape.attention_windows
    )
    return batch_size * held_tokens * per_layer


def _kv_bytes_per_token_per_layer(shape: ModelShape, dtype: str) -> int:
    return 2 * shape.key_value_width * _compute_bytes(dtype)


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
    _require_non_negative(lora_rank=rank)
    targeted = _lora_targets(shape, target_modules)
    return sum(rank * (layer.in_features + layer.out_features) for layer in targeted)


def _lora_targets(shape: ModelShape, target_modules) -> list[LinearLayer]:
    if isinstance(target_modules, str):
        target_modules = [name.strip() for name in target_modules.split(",") if name.strip()]
    targeted = [
        layer
        for layer in shape.linear_layers
        if any(layer.name == t or layer.name.endswith("." + t) for t in target_modules)
    ]
    if not targeted:
        available = sorted({layer.name.rsplit(".", 1)[-1] for layer in shape.linear_layers})
        raise ValueError(
            f"lora_target_modules {list(target_modules)} match no Linear layer of {shape.name}; "
            f"its Linear layers are named: {', '.join(available)}"
        )
    return targeted


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
    precision = _training_precision(dtype, mixed_precision, lora=False)
    _require_positive(batch_size=batch_size, seq_len=seq_len)
    _check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
    per_token = _layer_activation_bytes_per_token(shape, precision, attn_implementation, seq_len)
    return batch_size * seq_len * per_token


@dataclass(frozen=True)
class _Precision:
    """Byte sizes a training run uses. autocast_casts: fp32 weights cast per op (autocast)."""

    compute_bytes: int  # matmul inputs/outputs, attention, MLP
    residual_bytes: int  # the residual stream between layers (the model's own dtype)
    autocast_casts: bool


def _training_precision(dtype: str, mixed_precision: bool, *, lora: bool) -> _Precision:
    dtype = canonical_dtype(dtype)
    compute = _compute_bytes(dtype)
    if lora:  # the frozen base runs in its own dtype; quantized bases dequantize to bf16
        residual = FP32_BYTES if dtype == "fp32" else 2
        return _Precision(compute, residual, autocast_casts=False)
    autocast = mixed_precision and compute < FP32_BYTES
    return _Precision(compute, FP32_BYTES if autocast else compute, autocast_casts=autocast)


def _layer_activation_bytes_per_token(
    shape: ModelShape, precision: _Precision, attn_implementation: str, seq_len: int
) -> int:
    p = precision.compute_bytes
    attention_norm = _norm_saved_bytes_per_token(shape, precision, consuming_linears=3)
    mlp_norm = _norm_saved_bytes_per_token(shape, precision, consuming_linears=2)
    if attn_implementation == "eager":
        # Softmax runs in fp32 and is cast back to p; in pure fp32 the cast is the same tensor.
        probabilities_bytes = FP32_BYTES + (p if p != FP32_BYTES else 0)
        attention = (
            p * 4 * shape.query_width
            + shape.num_attention_heads * seq_len * probabilities_bytes
        )
    else:
        attention = p * (2 * shape.query_width + 2 * shape.key_value_width)
        attention += FP32_BYTES * shape.num_attention_heads  # logsumexp kept for backward
    mlp = 4 * p * shape.intermediate_size
    return attention_norm + attention + mlp_norm + mlp


def _norm_saved_bytes_per_token(
    shape: ModelShape, precision: _Precision, consuming_linears: int
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


# ----------------------------------------------------------------------------------------------
# Generation.


def plan_generate(
    model: PretrainedConfig | ModelShape | str,
    *,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    gpu_memory_bytes: int,
    dtype: str = "bf16",
    gpu_count: int = 1,
    attn_implementation: str = "sdpa",
    logits_last_position_only: bool = True,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    fragmentation_fraction: float = DEFAULT_FRAGMENTATION_FRACTION,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Plan:
    """Peak memory per GPU of ``model.generate`` for ``batch_size`` prompts of ``prompt_len``
    tokens, each continued by ``new_tokens`` tokens, and the largest batch that fits.

    The peak is the larger of two phases: prefill (the prompt's KV cache, one layer's activations,
    the prompt's logits) and the last decode step (the full KV cache plus the copy ``torch.cat``
    makes while appending). With ``gpu_count`` > 1 the layers are split across GPUs like
    ``device_map="auto"`` (weights and KV cache of ceil(layers / gpus) layers per GPU); the
    activations, logits and overhead are counted in full on each GPU.
    ``logits_last_position_only`` mirrors generate(), which passes ``logits_to_keep=1``
    (transformers 5.x generation/utils.py); False plans a forward pass that returns all logits.
    """
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    _require_positive(
        batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens, gpu_count=gpu_count
    )
    gpu_memory_bytes = _positive_bytes("gpu_memory_bytes", gpu_memory_bytes)
    _check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
    _check_overheads(overhead_bytes, fragmentation_fraction, safety_margin)

    layer_share = math.ceil(shape.num_layers / gpu_count) / shape.num_layers
    weights = math.ceil(weights_bytes(shape, dtype) * layer_share)

    def terms_for(batch: int) -> list[Term]:
        phase = _generate_peak_phase(
            shape, dtype, batch, prompt_len, new_tokens, attn_implementation,
            logits_last_position_only, layer_share,
        )
        terms = [
            Term("weights", weights, _weights_explanation(shape, dtype, layer_share)),
            *phase,
        ]
        return terms + _overhead_terms(terms, overhead_bytes, fragmentation_fraction)

    notes = []
    total_tokens = prompt_len + new_tokens
    if shape.max_position_embeddings and total_tokens > shape.max_position_embeddings:
        notes.append(
            f"prompt_len + new_tokens = {total_tokens} exceeds the model's "
            f"max_position_embeddings ({shape.max_position_embeddings}); quality may degrade"
        )
    if any(window is not None for window in shape.attention_windows):
        notes.append("sliding-window layers hold at most window tokens of KV cache")
    return _make_plan(
        mode="generate", shape=shape, dtype=dtype, batch_size=batch_size,
        lengths={"prompt_len": prompt_len, "new_tokens": new_tokens},
        settings={
            "attn_implementation": attn_implementation,
            "logits_last_position_only": logits_last_position_only,
            "overhead_bytes": overhead_bytes,
            "fragmentation_fraction": fragmentation_fraction,
        },
        terms_for=terms_for, weights=weights, trainable=0,
        kv_per_token=kv_cache_bytes_per_token(shape, dtype),
        gpu_memory_bytes=gpu_memory_bytes, gpu_count=gpu_count, safety_margin=safety_margin,
        notes=notes,
    )


def _generate_peak_phase(
    shape, dtype, batch, prompt_len, new_tokens, attn_implementation,
    logits_last_position_only, layer_share,
) -> list[Term]:
    """The terms of the larger phase: prefill, or the last decode step."""
    prefill = _prefill_terms(
        shape, dtype, batch, prompt_len, attn_implementation, logits_last_position_only,
        layer_share,
    )
    if new_tokens == 1:  # the prefill's logits give the only new token
        return prefill
    decode = _last_decode_terms(
        shape, dtype, batch, prompt_len + new_tokens - 1, attn_implementation, layer_share
    )
    return max(prefill, decode, key=lambda terms: sum(term.bytes for term in terms))


def _prefill_terms(
    shape, dtype, batch, prompt_len, attn_implementation, logits_last_position_only, layer_share
) -> list[Term]:
    p = _compute_bytes(dtype)
    kv = kv_cache_bytes(shape, dtype, batch_size=batch, tokens=prompt_len,
                        last_step_tokens=prompt_len)
    logit_positions = 1 if logits_last_position_only else prompt_len
    return [
        Term("kv_cache", math.ceil(kv * layer_share),
             f"prefill: {batch} x {prompt_len} prompt tokens x "
             f"{kv_cache_bytes_per_token(shape, dtype):,} B/token "
             f"(2 x layers x kv_heads x head_dim x {p} B){_share_note(layer_share)}"),
        Term("activations",
             _inference_layer_peak_bytes(shape, p, batch, prompt_len, prompt_len,
                                         attn_implementation),
             f"prefill: largest transient inside one layer for {batch} x {prompt_len} tokens "
             f"(MLP or {attn_implementation} attention, whichever is larger)"),
        _generate_logits_term(shape, p, batch, logit_positions, "prefill"),
    ]


def _last_decode_terms(
    shape, dtype, batch, cached_tokens, attn_implementation, layer_share
) -> list[Term]:
    # generate() feeds back every new token but the last, so the cache ends at
    # prompt_len + new_tokens - 1 tokens (``cached_tokens``).
    p = _compute_bytes(dtype)
    kv = kv_cache_bytes(shape, dtype, batch_size=batch, tokens=cached_tokens)
    # DynamicLayer.update builds the longer tensor with torch.cat before dropping the old one.
    one_layer_old_copy = batch * _kv_bytes_per_token_per_layer(shape, dtype) * max(
        cached_tokens if window is None else min(cached_tokens, window)
        for window in shape.attention_windows
    )
    capped = ", sliding layers capped at their window" if _has_window(shape) else ""
    return [
        Term("kv_cache", math.ceil(kv * layer_share) + one_layer_old_copy,
             f"last decode step: {batch} x {cached_tokens} tokens (prompt + new - 1: the last "
             f"token is never fed back) x {kv_cache_bytes_per_token(shape, dtype):,} B/token"
             f"{capped}{_share_note(layer_share)}, + one layer's old copy while torch.cat appends"),
        Term("activations",
             _inference_layer_peak_bytes(shape, p, batch, 1, cached_tokens, attn_implementation),
             f"last decode step: largest transient inside one layer for {batch} x 1 token"),
        _generate_logits_term(shape, p, batch, 1, "last decode step"),
    ]


def _inference_layer_peak_bytes(
    shape: ModelShape, p: int, batch: int, query_len: int, key_len: int, attn_implementation: str
) -> int:
    """The largest set of tensors alive at once inside one layer without autograd.

    Per query token: the residual input and the norm output (2 p h) plus the larger of the MLP
    (silu(gate), up and their product: 3 p intermediate, gate itself is freed first) and attention
    (q, k, v, rotated q and k, the output: p (3 q_width + 3 kv_width)). eager attention adds the
    scores (p), their fp32 softmax and its p copy per head and key, and keys and values repeated
    to all heads for the whole cache.
    """
    h, i = shape.hidden_size, shape.intermediate_size
    mlp = 3 * p * i
    attention = p * (3 * shape.query_width + 3 * shape.key_value_width)
    eager_extra = 0
    if attn_implementation == "eager":
        scores_bytes = p + FP32_BYTES + (p if p != FP32_BYTES else 0)
        eager_extra = shape.num_attention_heads * key_len * scores_bytes * query_len
        if shape.num_key_value_heads < shape.num_attention_heads:
            eager_extra += 2 * p * shape.query_width * key_len
    tokens = batch * query_len
    return tokens * (2 * p * h + max(mlp, attention)) + batch * eager_extra


def _generate_logits_term(
    shape: ModelShape, p: int, batch: int, positions: int, phase: str
) -> Term:
    # The lm_head writes logits in the compute dtype for the kept positions; generate() then
    # copies the last position to fp32 to pick the next token (generation/utils.py, _sample).
    logits = batch * positions * shape.vocab_size * p
    fp32_copy = batch * shape.vocab_size * FP32_BYTES
    return Term(
        "logits", logits + fp32_copy,
        f"{phase}: {batch} x {positions} position(s) x {shape.vocab_size:,} vocab x {p} B, "
        f"+ fp32 copy of the last position ({batch} x {shape.vocab_size:,} x 4 B)",
    )


# ----------------------------------------------------------------------------------------------
# Training.


def plan_train(
    model: PretrainedConfig | ModelShape | str,
    *,
    micro_batch_size: int,
    seq_len: int,
    gpu_memory_bytes: int,
    dtype: str = "bf16",
    mixed_precision: bool = True,
    optimizer: str = "adamw",
    grad_checkpointing: bool = False,
    lora_rank: int = 0,
    lora_target_modules: tuple[str, ...] | list[str] | str = DEFAULT_LORA_TARGET_MODULES,
    sharding: str = "none",
    gpu_count: int = 1,
    attn_implementation: str = "sdpa",
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    fragmentation_fraction: float = DEFAULT_FRAGMENTATION_FRACTION,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Plan:
    """Peak memory per GPU of one training step (forward, backward, AdamW) and the largest
    micro-batch that fits.

    Full fine-tuning (``lora_rank=0``), bytes per parameter:
    - ``mixed_precision=True`` (autocast, fp32 master weights): weights 4 + gradients 4 + AdamW
      8 (two fp32 moments) = 16, the same total as ZeRO's 2 + 2 + 12 (Rajbhandari et al. 2020,
      sec. 3.1) arranged differently; plus 2 for the bf16 copies autocast caches of every Linear
      weight, alive from forward until backward uses them (torch autocast weight-cast cache);
    - ``mixed_precision=False``: weights, gradients and both moments all in ``dtype``
      (torch.optim.AdamW creates its moments with ``zeros_like(param)``): 8 for bf16, 16 for fp32;
    - ``optimizer="adamw-8bit"`` (bitsandbytes): 2 bytes of state plus an fp32 absmax per 256.
    LoRA (``lora_rank`` > 0): the base is frozen in ``dtype`` (int8/int4: QLoRA), with no gradients
    or optimizer state; adapters are fp32 (PEFT's ``autocast_adapter_dtype``) with fp32 gradients
    and optimizer states. ``sharding="fsdp"`` (FSDP / ZeRO-3) divides weights, gradients and
    optimizer states by ``gpu_count`` and adds the all-gathered layers; activations are never
    sharded. Without sharding every GPU holds a full replica (DDP) plus its gradient buckets.
    """
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    _require_positive(micro_batch_size=micro_batch_size, seq_len=seq_len, gpu_count=gpu_count)
    gpu_memory_bytes = _positive_bytes("gpu_memory_bytes", gpu_memory_bytes)
    _require_non_negative(lora_rank=lora_rank)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("sharding", sharding, SHARDINGS)
    _check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
    _check_overheads(overhead_bytes, fragmentation_fraction, safety_margin)
    lora = lora_rank > 0
    if dtype in QUANTIZED_DTYPES and not lora:
        raise ValueError(
            f"dtype={dtype!r} stores frozen weights and cannot be trained directly: set "
            "lora_rank > 0 to train LoRA adapters on a quantized base (QLoRA), or use dtype "
            "'bf16' or 'fp32'"
        )
    mixed_precision = mixed_precision and dtype != "fp32"  # fp32 is full precision already
    precision = _training_precision(dtype, mixed_precision, lora=lora)
    shards = gpu_count if sharding == "fsdp" else 1

    state_terms, weights, trainable = _training_state_terms(
        shape, dtype, mixed_precision, optimizer, lora_rank, lora_target_modules, shards,
        replicas=gpu_count if sharding == "none" else 1,
    )
    if sharding == "fsdp":
        state_terms.append(_fsdp_gather_term(shape, precision))

    def terms_for(batch: int) -> list[Term]:
        terms = state_terms + [
            _training_activations_term(
                shape, precision, batch, seq_len, grad_checkpointing, attn_implementation,
                lora_rank, lora_target_modules, mixed_precision,
            ),
            _training_logits_term(shape, precision, batch, seq_len),
        ]
        return terms + _overhead_terms(terms, overhead_bytes, fragmentation_fraction)

    notes = []
    if shape.max_position_embeddings and seq_len > shape.max_position_embeddings:
        notes.append(
            f"seq_len {seq_len} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings})"
        )
    if lora:
        notes.append("LoRA activations add each adapter's saved input to the full fine-tune "
                     "formula: an upper bound, not measured against PEFT")
    return _make_plan(
        mode="train", shape=shape, dtype=dtype, batch_size=micro_batch_size,
        lengths={"seq_len": seq_len},
        settings={
            "mixed_precision": mixed_precision,
            "optimizer": optimizer,
            "grad_checkpointing": grad_checkpointing,
            "lora_rank": lora_rank,
            "lora_target_modules": list(_target_names(lora_target_modules)) if lora else [],
            "sharding": sharding,
            "attn_implementation": attn_implementation,
            "overhead_bytes": overhead_bytes,
            "fragmentation_fraction": fragmentation_fraction,
        },
        terms_for=terms_for, weights=weights, trainable=trainable, kv_per_token=None,
        gpu_memory_bytes=gpu_memory_bytes, gpu_count=gpu_count, safety_margin=safety_margin,
        notes=notes,
    )


def _training_state_terms(
    shape, dtype, mixed_precision, optimizer, lora_rank, lora_target_modules, shards, replicas,
) -> tuple[list[Term], int, int]:
    """Weights, gradients, optimizer states (and autocast copies, DDP buckets): batch-independent.

    Returns the terms, the weight bytes on one GPU and the trainable parameter count.
    """

    def per_gpu(total_bytes: float) -> int:
        return math.ceil(total_bytes / shards)

    shard_note = f" / {shards} GPUs (FSDP)" if shards > 1 else ""
    optimizer_bytes_per_parameter = _optimizer_state_bytes_per_parameter(optimizer)
    terms = []
    if lora_rank > 0:
        trainable = lora_parameter_count(shape, lora_rank, lora_target_modules)
        base = per_gpu(weights_bytes(shape, dtype))
        adapters = per_gpu(trainable * FP32_BYTES)
        weights = base + adapters
        terms += [
            Term("weights", base, f"frozen base: {_weights_explanation(shape, dtype)}{shard_note}"),
            Term("lora_adapters", adapters,
                 f"{trainable:,} adapter params (rank {lora_rank} x (in + out) per target) "
                 f"x 4 B fp32{shard_note}"),
        ]
        gradient_bytes = FP32_BYTES
        state_bytes = optimizer_bytes_per_parameter(FP32_BYTES)
        casts = trainable * 2 if mixed_precision else 0  # autocast's bf16 copies of the adapters
    else:
        trainable = shape.parameters
        weight_dtype_bytes = FP32_BYTES if mixed_precision else _compute_bytes(dtype)
        weights = per_gpu(trainable * weight_dtype_bytes)
        master = " (fp32 master weights under autocast)" if mixed_precision else ""
        terms.append(Term("weights", weights,
                          f"{trainable:,} params x {weight_dtype_bytes} B{master}{shard_note}"))
        gradient_bytes = weight_dtype_bytes
        state_bytes = optimizer_bytes_per_parameter(weight_dtype_bytes)
        # Autocast casts each Linear's weight (and bias) to bf16 once per forward and keeps the
        # copy until backward; norms and the input embedding are not cast. FSDP gathers bf16
        # shards instead, counted in its own term.
        linear_parameters = sum(layer.parameters for layer in shape.linear_layers)
        casts = linear_parameters * _compute_bytes(dtype) if mixed_precision and shards == 1 else 0
    terms.append(Term("gradients", per_gpu(trainable * gradient_bytes),
                      f"{trainable:,} trainable params x {gradient_bytes} B{shard_note}"))
    terms.append(Term("optimizer_states", per_gpu(math.ceil(trainable * state_bytes)),
                      f"{trainable:,} trainable params x {state_bytes:g} B ({optimizer}: "
                      f"{_optimizer_note(optimizer, gradient_bytes)}){shard_note}"))
    if casts:
        terms.append(Term("autocast_weight_copies", casts,
                          "bf16 copies of the trainable Linear weights that autocast caches "
                          "from forward until backward (2 B each)"))
    if replicas > 1:
        # DDP copies gradients into its all-reduce buckets unless gradient_as_bucket_view=True
        # (torch.nn.parallel.DistributedDataParallel docs: saves "the total gradients size").
        terms.append(Term("ddp_gradient_buckets", trainable * gradient_bytes,
                          f"DDP all-reduce buckets: a second copy of the gradients on each of "
                          f"{replicas} replicas"))
    return terms, weights, trainable


def _optimizer_state_bytes_per_parameter(optimizer: str) -> Callable[[int], float]:
    """Bytes of optimizer state per trainable parameter, given the parameter's own byte size."""
    if optimizer == "adamw-8bit":
        return lambda _: 2 + 2 * FP32_BYTES / ADAM_8BIT_BLOCK_SIZE
    return lambda parameter_bytes: 2 * parameter_bytes  # exp_avg and exp_avg_sq, like the param


def _optimizer_note(optimizer: str, parameter_bytes: int) -> str:
    if optimizer == "adamw-8bit":
        return "two uint8 moments + fp32 absmax per 256 values, bitsandbytes"
    return f"two moments in the parameter dtype, {parameter_bytes} B each"


def _fsdp_gather_term(shape: ModelShape, precision: _Precision) -> Term:
    # FSDP all-gathers one unit (decoder layer) at a time in the compute dtype and prefetches the
    # next one; the root unit (embeddings, final norm, lm_head) stays gathered between forward and
    # backward; a layer's full gradient exists until it is reduce-scattered
    # (PyTorch FSDP docs: backward_prefetch, MixedPrecision param_dtype).
    p = precision.compute_bytes
    gathered = shape.non_decoder_parameters + 2 * shape.decoder_layer_parameters
    unsharded_gradient = max(shape.non_decoder_parameters, shape.decoder_layer_parameters)
    return Term(
        "fsdp_gathered_parameters", (gathered + unsharded_gradient) * p,
        f"root unit ({shape.non_decoder_parameters:,} params) + 2 decoder layers "
        f"({shape.decoder_layer_parameters:,} each) all-gathered, + one unit's gradient "
        f"before reduce-scatter, x {p} B",
    )


def _training_activations_term(
    shape, precision, batch, seq_len, grad_checkpointing, attn_implementation,
    lora_rank, lora_target_modules, mixed_precision,
) -> Term:
    tokens = batch * seq_len
    per_layer = tokens * _layer_activation_bytes_per_token(
        shape, precision, attn_implementation, seq_len
    )
    # Outside the layers: the final norm and the lm_head's input, plus token ids and labels.
    outside = tokens * (
        _norm_saved_bytes_per_token(shape, precision, consuming_linears=1) + 2 * INT64_BYTES
    )
    lora_extra = 0
    if lora_rank > 0:
        # Each adapter's A saves its input and B saves A's output (rank values), in bf16 under
        # autocast, else in the adapter's fp32 (PEFT casts the input to the adapter dtype).
        adapter_bytes = precision.compute_bytes if mixed_precision else FP32_BYTES
        per_model = sum(
            (layer.in_features + lora_rank) * adapter_bytes
            for layer in _lora_targets(shape, lora_target_modules)
        )
        lora_extra = tokens * per_model // shape.num_layers  # targets are spread over the layers
    if grad_checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time (Chen et al.
        # 2016, "Training Deep Nets with Sublinear Memory Cost"; transformers checkpoints each
        # decoder layer).
        boundaries = shape.num_layers * tokens * shape.hidden_size * precision.residual_bytes
        total = boundaries + per_layer + lora_extra + outside
        how = (f"checkpointed: {shape.num_layers} layer inputs ({tokens:,} tokens x "
               f"{shape.hidden_size} x {precision.residual_bytes} B) + one layer recomputed "
               f"({per_layer:,} B)")
    else:
        total = shape.num_layers * (per_layer + lora_extra) + outside
        how = (f"{shape.num_layers} layers x {per_layer + lora_extra:,} B saved for backward "
               f"({tokens:,} tokens, {attn_implementation})")
    return Term("activations", total, how + " + final norm and token ids")


def _training_logits_term(
    shape: ModelShape, precision: _Precision, batch: int, seq_len: int
) -> Term:
    # transformers' ForCausalLMLoss upcasts the logits to fp32 and runs cross_entropy; backward of
    # its log_softmax holds the saved fp32 output, the incoming fp32 gradient and the outgoing
    # one at once, while the model output keeps the logits in the compute dtype.
    p = precision.compute_bytes
    logits = batch * seq_len * shape.vocab_size
    return Term(
        "logits_and_loss", logits * (p + 3 * FP32_BYTES),
        f"{batch} x {seq_len} tokens x {shape.vocab_size:,} vocab x ({p} B logits + 3 x 4 B: "
        "fp32 log-softmax output and its gradient in and out)",
    )


# ----------------------------------------------------------------------------------------------
# Shared by both plans.


def max_batch_size(
    total_bytes_for_batch: Callable[[int], int],
    budget: int,
    *,
    limit: int = MAX_BATCH_SEARCH_LIMIT,
) -> int:
    """The largest batch in 1..limit whose total bytes are <= ``budget``; 0 if batch 1 is over.

    Memory grows with the batch, so the answer is found by doubling, then bisecting.
    """
    if total_bytes_for_batch(1) > budget:
        return 0
    fits = 1
    while fits < limit:
        candidate = min(2 * fits, limit)
        if total_bytes_for_batch(candidate) > budget:
            return _bisect(total_bytes_for_batch, budget, fits, candidate)
        fits = candidate
    return limit


def _bisect(total_bytes_for_batch, budget: int, fits: int, too_big: int) -> int:
    """The largest batch in [fits, too_big) that fits; ``fits`` fits and ``too_big`` does not."""
    while too_big - fits > 1:
        middle = (fits + too_big) // 2
        if total_bytes_for_batch(middle) <= budget:
            fits = middle
        else:
            too_big = middle
    return fits


def _make_plan(
    *, mode, shape, dtype, batch_size, lengths, settings, terms_for, weights, trainable,
    kv_per_token, gpu_memory_bytes, gpu_count, safety_margin, notes,
) -> Plan:
    terms = terms_for(batch_size)
    total = sum(term.bytes for term in terms)
    budget = budget_bytes(gpu_memory_bytes, safety_margin)

    def total_for(batch: int) -> int:
        return sum(term.bytes for term in terms_for(batch))

    return Plan(
        mode=mode, model=shape.name, params=shape.parameters, trainable_params=trainable,
        dtype=dtype, batch_size=batch_size, lengths=lengths, settings=settings, terms=terms,
        weights_bytes=weights, kv_cache_bytes_per_token=kv_per_token, total_bytes=total,
        capacity_bytes=gpu_memory_bytes, gpu_count=gpu_count, safety_margin=safety_margin,
        fits=total <= budget, max_batch_size=max_batch_size(total_for, budget), notes=notes,
    )


def _overhead_terms(
    terms: list[Term], overhead_bytes: int, fragmentation_fraction: float
) -> list[Term]:
    tensors = sum(term.bytes for term in terms)
    return [
        Term("cuda_context", overhead_bytes,
             f"CUDA context, kernels and library workspaces: {overhead_bytes / MiB:,.0f} MiB "
             "(profile constant; prior until calibrated)"),
        Term("allocator_fragmentation", math.ceil(tensors * fragmentation_fraction),
             f"{fragmentation_fraction:.0%} of the {tensors / GiB:,.2f} GiB of tensors "
             "(caching allocator rounding and unreusable blocks; prior until calibrated)"),
    ]


def _changes_that_save_memory(plan: Plan) -> list[str]:
    """Suggestions for a plan that does not fit at batch 1, the ones not already in use."""
    settings, changes = plan.settings, []
    if plan.mode == "generate":
        if plan.dtype in ("fp32", "bf16", "fp16"):
            changes.append("a smaller weight dtype (bf16, int8 or int4)" if plan.dtype == "fp32"
                           else "quantized weights (dtype int8 or int4)")
        changes.append("shorter prompt_len or new_tokens (the KV cache grows with both)")
        changes.append("more GPUs (gpu_count) to split the layers")
        return changes
    if settings["lora_rank"] == 0:
        changes.append("LoRA (lora_rank=16) to train adapters only")
    elif plan.dtype not in QUANTIZED_DTYPES:
        changes.append("a quantized frozen base (dtype int4: QLoRA)")
    if not settings["grad_checkpointing"]:
        changes.append("grad_checkpointing=True")
    if settings["optimizer"] == "adamw":
        changes.append("optimizer 'adamw-8bit'")
    if settings["sharding"] == "none":
        changes.append("sharding 'fsdp' over several GPUs")
    else:
        changes.append(f"more GPUs than {plan.gpu_count} for FSDP to shard over")
    changes.append("a shorter seq_len")
    return changes


def _weights_explanation(shape: ModelShape, dtype: str, share: float = 1.0) -> str:
    if dtype in QUANTIZED_DTYPES:
        how = (f"{shape.parameters:,} params: Linear weights at {BITS_PER_PARAMETER[dtype]} bits "
               "+ scales, embeddings/norms/lm_head in bf16 (bitsandbytes)")
    else:
        how = f"{shape.parameters:,} params x {BITS_PER_PARAMETER[dtype] // 8} B ({dtype})"
    return how + _share_note(share)


def _share_note(share: float) -> str:
    return f", this GPU's {share:.0%} of the layers" if share < 1 else ""


def _has_window(shape: ModelShape) -> bool:
    return any(window is not None for window in shape.attention_windows)


def _target_names(target_modules) -> tuple[str, ...]:
    if isinstance(target_modules, str):
        return tuple(name.strip() for name in target_modules.split(",") if name.strip())
    return tuple(target_modules)


# ----------------------------------------------------------------------------------------------
# Validation: errors name the argument and the allowed values.


def canonical_dtype(dtype: str) -> str:
    """'bf16' for 'bf16' or 'bfloat16', and so on; ValueError naming the allowed values."""
    name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in BITS_PER_PARAMETER:
        allowed = ", ".join([*BITS_PER_PARAMETER, *DTYPE_ALIASES])
        raise ValueError(f"dtype {dtype!r} is not supported; use one of: {allowed}")
    return name


def _compute_bytes(dtype: str) -> int:
    """Bytes per value of activations and KV cache: quantized weights compute in bf16."""
    dtype = canonical_dtype(dtype)
    return 2 if dtype in QUANTIZED_DTYPES else BITS_PER_PARAMETER[dtype] // 8


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer (1 or more), got {value!r}")


def _positive_bytes(name: str, value: float) -> int:
    """A byte count given as int or float (e.g. ``140.4 * GiB``), rounded down."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return int(value)


def _require_non_negative(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 disables it), got {value!r}")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not supported; use one of: {', '.join(allowed)}")


def _check_overheads(
    overhead_bytes: int, fragmentation_fraction: float, safety_margin: float
) -> None:
    _require_non_negative(overhead_bytes=overhead_bytes)
    if not 0 <= fragmentation_fraction < 1:
        raise ValueError(
            f"fragmentation_fraction must be in [0, 1), got {fragmentation_fraction!r}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
