"""What the decoder layers save for backward under LoRA (PEFT adapters on a frozen base), per token.

A frozen base changes the full fine-tune's terms (``formulas``) in three ways, each measured tensor by
tensor with autograd's saved-tensor hooks on CPU (tests/test_memory.py, tests/test_architectures.py):
- a frozen norm saves only its fp32 input and its rsqrt: the normalized copy exists for the weight's
  gradient alone (per-head q/k norms likewise);
- a frozen Linear saves no input: the MLP keeps gate, act(gate) and up, not their product, and the
  attention keeps what its own backward needs (``formulas.attention_core_bytes_per_token``);
- each adapter's A saves its input and B saves A's rank-wide output. PEFT casts the input to the adapter's
  fp32 and, under autocast, autocast casts it back: a copy per adapter (fp32 without autocast, the compute
  dtype with it). Only on an fp32 base without autocast is no copy made, and adapters reading the same
  tensor share it with the other savers of that tensor.
Frozen mixture-of-experts layers (grouped_mm experts are no nn.Linear: LoRA never adapts them) keep
their gathered input, gate|up and act(gate), not the product nor the output. DeepSeek's latent
attention keeps its core and its frozen norms' inputs (``formulas``); its adapters' inputs are counted as any.
"""

from __future__ import annotations

import re

from workbook.planner.architectures import DOCUMENT_SDPA
from workbook.planner.formulas import (
    Precision, _kinds, _masked, attention_core_bytes_per_token, experts_saved_bytes_per_token,
    latent_norms_bytes_per_token,
)
from workbook.planner.shape import FP32_BYTES, ModelShape, lora_targets

# What a LoRA adapter's input is, by the targeted Linear's name: the output of a norm (saved by no
# one else when the norm is frozen), the attention output (saved by the attention already) or the
# SwiGLU product (saved by no one else when down_proj's base is frozen).
ADAPTER_INPUTS = {"q_proj": "attention_norm", "k_proj": "attention_norm", "v_proj": "attention_norm",
                  "qkv_proj": "attention_norm", "q_a_proj": "attention_norm", "kv_a_proj_with_mqa": "attention_norm",
                  "o_proj": "attention_output", "gate_proj": "mlp_norm",
                  "up_proj": "mlp_norm", "gate_up_proj": "mlp_norm", "down_proj": "mlp_product",
                  "shared_expert_gate": "mlp_norm"}


def lora_decoder_bytes_per_token(shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int,
                                 rank: int, target_modules, autocast: bool) -> int:
    """All decoder layers together, per token: each layer's frozen part at its own kind, plus every adapter."""
    moe_layers = shape.architecture.moe_layers
    attention = sum(_frozen_attention_bytes_per_token(shape, precision, attn_implementation, seq_len,
                                                      windowed=_masked(window, seq_len))
                    for window in shape.attention_windows)
    mlp = sum(count * _frozen_mlp_bytes_per_token(shape, precision, routed=routed)
              for routed, count in ((True, moe_layers), (False, shape.num_layers - moe_layers)) if count)
    return attention + mlp + adapter_bytes_per_token(shape, precision, rank, target_modules, autocast,
                                                      attn_implementation)


def lora_layer_bytes_per_token(shape: ModelShape, precision: Precision, attn_implementation: str, seq_len: int,
                               rank: int, target_modules, autocast: bool) -> int:
    """The largest decoder layer under LoRA (what one checkpointed layer holds while it is recomputed): its
    frozen part at the larger of the model's kinds plus one layer's share of the adapters."""
    windowed_kinds = _kinds(sum(_masked(window, seq_len) for window in shape.attention_windows), shape.num_layers)
    routed_kinds = _kinds(shape.architecture.moe_layers, shape.num_layers)
    frozen = (max(_frozen_attention_bytes_per_token(shape, precision, attn_implementation, seq_len, windowed=kind)
                  for kind in windowed_kinds)
              + max(_frozen_mlp_bytes_per_token(shape, precision, routed=kind) for kind in routed_kinds))
    adapters = adapter_bytes_per_token(shape, precision, rank, target_modules, autocast, attn_implementation)
    return frozen + adapters // shape.num_layers


def frozen_norm_bytes_per_token(width: int) -> int:
    """A frozen RMSNorm over ``width`` values: its fp32 input and the rsqrt, no normalized copy."""
    return FP32_BYTES * width + FP32_BYTES


def _frozen_attention_bytes_per_token(shape: ModelShape, precision: Precision, attn_implementation: str,
                                      seq_len: int, *, windowed: bool) -> int:
    architecture, p = shape.architecture, precision.compute_bytes
    norms = (architecture.norms_per_layer // 2) * frozen_norm_bytes_per_token(shape.hidden_size)  # Gemma: 2 here
    extra = 0
    if architecture.per_head_qk_norm:  # frozen q/k norms: their fp32 input and an rsqrt per head
        extra += FP32_BYTES * (shape.query_width + shape.key_value_width)
        extra += FP32_BYTES * (shape.num_attention_heads + shape.num_key_value_heads)
    if architecture.fused_qkv:  # the value is a view of qkv_proj's output: it keeps q and k's part alive too
        extra += p * (shape.query_width + shape.key_value_width)
    if architecture.latent_attention is not None:
        extra += latent_norms_bytes_per_token(architecture.latent_attention, p, frozen=True)
    if attn_implementation == DOCUMENT_SDPA:  # the joined output is o_proj's input: its adapter's alone here
        extra -= p * shape.query_width
    return norms + attention_core_bytes_per_token(shape, p, attn_implementation, seq_len, windowed=windowed) + extra


def _frozen_mlp_bytes_per_token(shape: ModelShape, precision: Precision, *, routed: bool) -> int:
    norms = (shape.architecture.norms_per_layer // 2) * frozen_norm_bytes_per_token(shape.hidden_size)
    if routed:
        return norms + experts_saved_bytes_per_token(shape, precision, frozen=True)
    return norms + 3 * precision.compute_bytes * shape.intermediate_size  # gate, act(gate), up


def adapter_bytes_per_token(shape: ModelShape, precision: Precision, rank: int, target_modules,
                            autocast: bool, attn_implementation: str = "sdpa") -> int:
    """Every adapter's saved input (where it is a copy, or where no one else saves it) and rank-wide output."""
    h, p = shape.hidden_size, precision.compute_bytes
    targets = lora_targets(shape, target_modules)
    copied = autocast or precision.residual_bytes != FP32_BYTES
    adapter_bytes = p if autocast else FP32_BYTES
    if copied:
        inputs = sum(layer.in_features * adapter_bytes for layer in targets)
    else:
        # The attention output is the one the attention saves, unless the family copies it head-major for
        # o_proj (Phi-3, DeepSeek: rotary by concatenation) or document_sdpa joins it from each example's:
        # then the adapter alone keeps that copy.
        own_copy = shape.architecture.rotary_by_concatenation or attn_implementation == DOCUMENT_SDPA
        attention_output = FP32_BYTES * shape.query_width if own_copy else 0
        shared = {"attention_norm": FP32_BYTES * h, "mlp_norm": FP32_BYTES * h, "attention_output": attention_output}
        distinct = {}
        for layer in targets:
            kind = ADAPTER_INPUTS.get(layer.name.rsplit(".", 1)[-1])
            key = (_decoder_layer(layer.name) if kind else layer.name, kind)  # one tensor per layer and kind
            # Any other input at its own width: down_proj's product is n_shared x moe_intermediate wide in
            # DeepSeek's shared experts, intermediate_size in its dense layers.
            distinct[key] = shared.get(kind, FP32_BYTES * layer.in_features)
        inputs = sum(distinct.values())
    return inputs + len(targets) * rank * adapter_bytes


def _decoder_layer(name: str) -> str:
    """'model.layers.3.mlp.shared_expert.down_proj' -> 'model.layers.3': the decoder layer a Linear is in."""
    found = re.match(r"(.*?layers\.\d+)\.", name)
    return found.group(1) if found else name
