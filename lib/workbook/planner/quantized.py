"""What a 4-bit (bitsandbytes NF4) frozen base adds to a QLoRA training step, tensor by tensor.

The sources are bitsandbytes 0.50 (functional.py ``quantize_4bit``, ``quantize_blockwise``,
``dequantize_4bit``; autograd/_functions.py ``MatMul4Bit``; backends/cuda/ops.py ``gemm_4bit``) as
transformers loads a model with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=torch.bfloat16)``: every ``nn.Linear`` but the lm_head becomes a ``Linear4bit``.

Per 4-bit layer of n = in x out weights:
- the packed weight: two 4-bit values per uint8, ceil(n / 2) bytes;
- its quantization state: an fp32 absmax per block of 64 weights and the 16-value NF4 code (fp32); with
  double quantization (``bnb_4bit_use_double_quant=True``) the absmax is itself quantized to uint8 in
  blocks of 256, with a second-level fp32 absmax per 256 blocks, the absmaxes' fp32 mean (the offset)
  and the 256-value 8-bit dynamic code: 0.5 bits per weight become 0.127 (Dettmers et al. 2023,
  "QLoRA", sec. 3: 32/64 = 0.5; 8/64 + 32/(64 x 256) = 0.127);
- for backward, nothing but a reference to the packed weight and its state: ``MatMul4Bit.forward`` sets
  ``ctx.tensors = (None, B)`` (bitsandbytes 0.44 and later, PR #1270 "delete useless buffered activation").
  0.43 and older kept ``(A, B)``, every 4-bit layer's input (``legacy_saved_input_bytes_per_token``);
- a temporary: the whole weight dequantized to the compute dtype, one layer at a time. Backward
  always makes it (``dequantize_4bit(B, ctx.state)`` for the input's gradient); forward too past 1,536
  rows (``gemm_4bit``'s ``_dequant_linear_fallback``), where its fused kernel stops, and below that wherever
  its per-GPU heuristic prefers dequantizing (on an H100, past 16 to 64 rows for large layers). Double
  quantization first dequantizes the absmax to fp32 (and the fallback adds the offset into a second copy).
Embeddings, norms, biases and the lm_head stay bf16 (PEFT's ``prepare_model_for_kbit_training``, which
upcasts them to fp32, is not planned).
"""

from __future__ import annotations

import math
import re

from workbook.planner.formulas import NF4_BLOCK_SIZE
from workbook.planner.lora_activations import ADAPTER_INPUTS
from workbook.planner.plans import Term
from workbook.planner.shape import FP32_BYTES, LinearLayer, ModelShape

# bitsandbytes quantize_4bit(compress_statistics=True) quantizes the absmax with quantize_blockwise(blocksize=256).
DOUBLE_QUANT_BLOCK_SIZE = 256
NF4_CODE_VALUES = 16  # get_4bit_type("nf4"): a fresh fp32 tensor of 16 values per quantized layer
DYNAMIC_CODE_VALUES = 256  # create_dynamic_map(): the 8-bit code, copied into each layer's state2
BF16_BYTES = 2
# gemm_4bit (backends/cuda/ops.py): above this many rows forward dequantizes the weight and calls F.linear.
FUSED_KERNEL_MAX_ROWS = 1536

CANNOT_RUN = ("planning a run the workbook cannot make (QLoRA needs bitsandbytes on CUDA; workbook train loads "
              "no 4-bit base)")


def four_bit_layers(shape: ModelShape) -> list[LinearLayer]:
    """The layers bitsandbytes quantizes: every nn.Linear but the lm_head (transformers' replace_with_bnb_linear
    skips the output embedding; mixture-of-experts experts are 3-D tensors, no nn.Linear, and stay bf16)."""
    return [layer for layer in shape.linear_layers if not layer.is_output_embedding]


def absmax_blocks(layer: LinearLayer) -> int:
    return math.ceil(layer.in_features * layer.out_features / NF4_BLOCK_SIZE)


def packed_weight_bytes(layer: LinearLayer) -> int:
    """quantize_4bit's ``out``: (n + 1) // 2 uint8 values, two 4-bit codes each."""
    return (layer.in_features * layer.out_features + 1) // 2


def quant_state_bytes(layer: LinearLayer, double_quant: bool) -> int:
    """One layer's QuantState: absmax (fp32, or uint8 + state2 with double quantization) and its codes."""
    blocks = absmax_blocks(layer)
    code = NF4_CODE_VALUES * FP32_BYTES
    if not double_quant:
        return blocks * FP32_BYTES + code
    second_level = math.ceil(blocks / DOUBLE_QUANT_BLOCK_SIZE) * FP32_BYTES
    offset = FP32_BYTES  # _absmax.mean(), a 0-d fp32 tensor
    return blocks + second_level + offset + DYNAMIC_CODE_VALUES * FP32_BYTES + code


def four_bit_base_terms(shape: ModelShape, double_quant: bool, shards: int = 1) -> list[Term]:
    """The frozen base on one GPU: packed 4-bit weights with the bf16 rest, and the quantization state."""
    layers = four_bit_layers(shape)
    quantized = sum(layer.in_features * layer.out_features for layer in layers)
    packed = sum(packed_weight_bytes(layer) for layer in layers)
    state = sum(quant_state_bytes(layer, double_quant) for layer in layers)
    kept = (shape.parameters - quantized) * BF16_BYTES
    shard_note = f" / {shards} GPUs (FSDP)" if shards > 1 else ""
    experts = ", mixture-of-experts experts" if shape.architecture.moe is not None else ""
    how_state = ("double quantization: uint8 absmax per 64 weights + fp32 absmax per 256 blocks, the offset and "
                 "the 256-value 8-bit code" if double_quant else
                 "fp32 absmax per 64 weights (no double quantization)")
    return [
        Term("weights", math.ceil((packed + kept) / shards),
             f"frozen base: {quantized:,} Linear weights at 4 bits ({len(layers)} bitsandbytes Linear4bit) + "
             f"{shape.parameters - quantized:,} params in bf16 (embeddings, norms, biases, lm_head{experts}){shard_note}"),
        Term("quant_state", math.ceil(state / shards),
             f"NF4 quantization state of {len(layers)} layers: {how_state}, + the 16-value NF4 code each "
             f"({8 * state / quantized:.3f} bits per 4-bit weight){shard_note}"),
    ]


def dequantized_weight_term(shape: ModelShape, compute_bytes: int, double_quant: bool) -> Term:
    """The largest 4-bit layer's weight dequantized to the compute dtype: a temporary of one layer at a time."""
    largest = max(four_bit_layers(shape), key=lambda layer: layer.in_features * layer.out_features)
    weight = largest.in_features * largest.out_features * compute_bytes
    absmax = 2 * absmax_blocks(largest) * FP32_BYTES if double_quant else 0
    how = (f"{largest.name.rsplit('.', 1)[-1]} ({largest.in_features:,} x {largest.out_features:,}) dequantized to "
           f"{compute_bytes} B values for its matmul, one layer at a time (backward; forward past "
           f"{FUSED_KERNEL_MAX_ROWS:,} rows)")
    if absmax:
        how += f" + its absmax dequantized to fp32 (two copies, {absmax:,} B)"
    return Term("dequantized_weight", weight + absmax, how)


def legacy_saved_input_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """What bitsandbytes 0.43 and older kept per token, all layers: each 4-bit layer's input in the compute
    dtype (layers reading one tensor, q/k/v or gate/up, share it). A frozen bf16 Linear keeps none."""
    distinct: dict[tuple[str, str], int] = {}
    for layer in four_bit_layers(shape):
        kind = ADAPTER_INPUTS.get(layer.name.rsplit(".", 1)[-1])
        found = re.match(r"(.*?layers\.\d+)\.", layer.name)
        key = (found.group(1) if found and kind else layer.name, kind or "")
        distinct[key] = layer.in_features * compute_bytes
    return sum(distinct.values())


def qlora_notes(shape: ModelShape, compute_bytes: int, tokens: int, grad_checkpointing: bool) -> list[str]:
    """What the plan of a 4-bit base says besides its terms: the run it plans is not the workbook's, and what
    an older bitsandbytes would keep."""
    legacy = legacy_saved_input_bytes_per_token(shape, compute_bytes) * tokens
    if grad_checkpointing:
        legacy //= shape.num_layers  # one recomputed layer's at a time
    return [
        f"dtype int4 with LoRA (QLoRA): {CANNOT_RUN}; nor can a trace check it (no CPU kernels)",
        "4-bit layers keep no input for backward (bitsandbytes >= 0.44 MatMul4Bit saves only a reference to the "
        f"packed weight); bitsandbytes 0.43 and older kept every 4-bit layer's input: {legacy:,} B more here",
    ]
