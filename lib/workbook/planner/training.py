"""Peak memory of one training step per GPU (forward, backward, AdamW): full fine-tune, LoRA/QLoRA,
DDP replicas or FSDP shards.
"""

from __future__ import annotations

import math
from typing import Callable

from transformers import PretrainedConfig

from workbook.planner import quantized, step_moments
from workbook.planner.architectures import TRAINING_ATTENTIONS, attention_implementation_run, training_notes
from workbook.planner.formulas import (
    Precision, decoder_activation_bytes_per_token, layer_activation_bytes_per_token, lora_parameter_count,
    norm_saved_bytes_per_token, training_precision, weights_bytes, weights_explanation,
)
from workbook.planner.lora_activations import (
    frozen_norm_bytes_per_token, lora_decoder_bytes_per_token, lora_layer_bytes_per_token,
)
from workbook.planner.plans import (
    DEFAULT_FRAGMENTATION_FRACTION, DEFAULT_OVERHEAD_BYTES, DEFAULT_SAFETY_MARGIN, Plan, Term, check_overheads,
    make_plan, overhead_terms,
)
from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, DEFAULT_LORA_TARGET_MODULES, FP32_BYTES, INT64_BYTES, OPTIMIZERS,
    QUANTIZED_DTYPES, SHARDINGS, ModelShape, canonical_dtype, check_choice, compute_bytes, lora_target_choice,
    model_shape, positive_bytes, require_non_negative, require_positive,
)
from workbook.planner.step_moments import StepTensors
from workbook.units import format_bytes

# 8-bit Adam (bitsandbytes) keeps one fp32 absmax per block of 256 values of each of its two states.
ADAM_8BIT_BLOCK_SIZE = 256


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
    loss_chunk_tokens: int = 0,
    offload_activations: bool = False,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    fragmentation_fraction: float = DEFAULT_FRAGMENTATION_FRACTION,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    double_quant: bool = False,
    gradient_accumulation_steps: int = 1,
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
    ``loss_chunk_tokens`` > 0: the loss runs over chunks of that many positions, so only one
    chunk's logits (and their gradient) exist at a time (``training.chunked_loss``).
    ``offload_activations``: what autograd saves moves to host memory in forward
    (``training.offload``); the GPU holds what backward unpacks, at most one layer's saved tensors.
    ``gradient_accumulation_steps`` > 1: the earlier micro-batches' gradients stay alive under the
    next one's activations.

    The total is a moment, not a sum of everything (``step_moments``): the largest of the start of
    backward (activations, weight copies and the loss's tensors alive, no gradient yet), a
    checkpointed layer recomputed in backward, the end of backward and the optimizer step (every
    gradient, no activation). The terms are those alive at that moment; a term not alive then shows
    0 bytes and says when it is. ``settings["moments"]`` holds every moment's total.
    ``double_quant``: int4 only, bitsandbytes' double quantization of the NF4 absmax (``quantized``).
    """
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    require_positive(micro_batch_size=micro_batch_size, seq_len=seq_len, gpu_count=gpu_count,
                     gradient_accumulation_steps=gradient_accumulation_steps)
    gpu_memory_bytes = positive_bytes("gpu_memory_bytes", gpu_memory_bytes)
    require_non_negative(lora_rank=lora_rank, loss_chunk_tokens=loss_chunk_tokens)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("sharding", sharding, SHARDINGS)
    check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS + TRAINING_ATTENTIONS)
    check_overheads(overhead_bytes, fragmentation_fraction, safety_margin)
    lora = lora_rank > 0
    if dtype in QUANTIZED_DTYPES and not lora:
        raise ValueError(
            f"dtype={dtype!r} stores frozen weights and cannot be trained directly: set "
            "lora_rank > 0 to train LoRA adapters on a quantized base (QLoRA), or use dtype "
            "'bf16' or 'fp32'"
        )
    mixed_precision = mixed_precision and dtype != "fp32"  # fp32 is full precision already
    precision = training_precision(dtype, mixed_precision, lora=lora)
    shards = gpu_count if sharding == "fsdp" else 1

    state_terms, weights, trainable = _training_state_terms(
        shape, dtype, mixed_precision, optimizer, lora_rank, lora_target_modules, shards,
        replicas=gpu_count if sharding == "none" else 1, double_quant=double_quant,
    )
    if dtype == "int4":  # the weight one 4-bit layer dequantizes for its matmul (planner/quantized.py)
        state_terms.append(quantized.dequantized_weight_term(shape, precision.compute_bytes, double_quant))
    if sharding == "fsdp":
        state_terms.append(_fsdp_gather_term(shape, precision))

    def step_for(batch: int) -> StepTensors:
        return _step_tensors(shape, precision, state_terms, batch, seq_len, grad_checkpointing, attn_implementation,
                             lora_rank, lora_target_modules, mixed_precision, offload_activations, loss_chunk_tokens,
                             gradient_accumulation_steps,
                             fused_optimizer=sharding != "fsdp" or optimizer != "adamw")

    def terms_for(batch: int) -> list[Term]:
        terms = step_moments.peak_terms(state_terms, step_for(batch))
        return terms + overhead_terms(terms, overhead_bytes, fragmentation_fraction)

    notes, host = [], 0
    if offload_activations:
        saved, _ = _training_activations_term(shape, precision, micro_batch_size, seq_len, grad_checkpointing,
                                              attn_implementation, lora_rank, lora_target_modules, mixed_precision)
        # Every saved tensor but the parameters and autocast's weight copies (backward casts the
        # parameter again): the activations and the loss's fp32 log-softmax output. A checkpointed layer
        # recomputed in backward saves its tensors again outside the offloading, on the GPU.
        log_softmax = 0 if loss_chunk_tokens else micro_batch_size * seq_len * shape.vocab_size * FP32_BYTES
        host = saved.bytes + log_softmax
        notes.append(f"offload_activations: {host:,} bytes of saved activations in pinned host memory per "
                     "micro-batch (not GPU memory); each step copies them over PCIe twice")
    if shape.max_position_embeddings and seq_len > shape.max_position_embeddings:
        notes.append(
            f"seq_len {seq_len} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings})"
        )
    notes += training_notes(shape.architecture)
    if dtype == "int4":
        notes += quantized.qlora_notes(shape, precision.compute_bytes, micro_batch_size * seq_len, grad_checkpointing)
    elif dtype in QUANTIZED_DTYPES:
        notes.append(f"dtype {dtype} with LoRA (QLoRA): workbook train does not run a {dtype} base (bitsandbytes "
                     "4/8-bit layers), so this plans a run the workbook cannot make; nor can a trace check it (no CPU "
                     "kernels): the adapters' terms are counted as on a bf16 base, the base's backward as bf16 layers'")
    if attention_implementation_run(shape.architecture.sdpa_supported, attn_implementation) != attn_implementation:
        notes.append(f"{shape.name} refuses {attn_implementation} (transformers: _supports_sdpa = False); "
                     "planned with the eager attention it runs")
    if lora:
        notes.append(f"LoRA targets: {', '.join(lora_target_choice(shape, lora_target_modules).names)}")
        notes += [f"lora target {name!r} matches no Linear layer of {shape.name}"
                  for name in lora_target_choice(shape, lora_target_modules).unmatched]
    planned_step = step_for(micro_batch_size)
    peak_moment, moments = step_moments.peak(state_terms, planned_step)
    notes.insert(0, f"the peak is a moment of the step, the {peak_moment.name}; the tensors alive in each: "
                    + ", ".join(f"{moment.name} {format_bytes(moment.total)}" for moment in moments))
    return make_plan(
        mode="train", shape=shape, dtype=dtype, batch_size=micro_batch_size,
        lengths={"seq_len": seq_len},
        settings={
            "mixed_precision": mixed_precision,
            "optimizer": optimizer,
            "grad_checkpointing": grad_checkpointing,
            "lora_rank": lora_rank,
            "lora_target_modules": list(lora_target_choice(shape, lora_target_modules).names) if lora else [],
            "sharding": sharding,
            "attn_implementation": attn_implementation,
            "loss_chunk_tokens": loss_chunk_tokens,
            "offload_activations": offload_activations,
            "offloaded_activation_bytes": host,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "peak_moment": peak_moment.name,
            "moments": {moment.name: moment.total for moment in moments},
            "bytes_when_alive": step_moments.bytes_when_alive(moments),
            "saved_activation_bytes": planned_step.activations.bytes,  # at the start of backward
            "recomputed_layer_bytes": planned_step.recomputed_layer,  # checkpointing: one layer, made again
            **({"double_quant": double_quant, "workbook_can_run": False} if dtype == "int4" else {}),
            "overhead_bytes": overhead_bytes,
            "fragmentation_fraction": fragmentation_fraction,
        },
        terms_for=terms_for, weights=weights, trainable=trainable, kv_per_token=None,
        gpu_memory_bytes=gpu_memory_bytes, gpu_count=gpu_count, safety_margin=safety_margin,
        notes=notes,
    )


def _training_state_terms(
    shape, dtype, mixed_precision, optimizer, lora_rank, lora_target_modules, shards, replicas, double_quant=False,
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
        base_terms = (quantized.four_bit_base_terms(shape, double_quant, shards) if dtype == "int4" else
                      [Term("weights", per_gpu(weights_bytes(shape, dtype)),
                            f"frozen base: {weights_explanation(shape, dtype)}{shard_note}")])
        adapters = per_gpu(trainable * FP32_BYTES)
        weights = sum(term.bytes for term in base_terms) + adapters
        terms += base_terms + [
            Term("lora_adapters", adapters,
                 f"{trainable:,} adapter params (rank {lora_rank} x (in + out) per target) "
                 f"x 4 B fp32{shard_note}"),
        ]
        gradient_bytes = FP32_BYTES
        state_bytes = optimizer_bytes_per_parameter(FP32_BYTES)
        casts = trainable * 2 if mixed_precision else 0  # autocast's bf16 copies of the adapters
    else:
        trainable = shape.parameters
        weight_dtype_bytes = FP32_BYTES if mixed_precision else compute_bytes(dtype)
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
        casts = linear_parameters * compute_bytes(dtype) if mixed_precision and shards == 1 else 0
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


def _fsdp_gather_term(shape: ModelShape, precision: Precision) -> Term:
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
    lora_rank, lora_target_modules, mixed_precision, offload: bool = False,
) -> tuple[Term, int]:
    """What the forward saves, alive at the start of backward, and (checkpointing) the bytes one layer saves
    again when backward recomputes it."""
    tokens = batch * seq_len
    h = shape.hidden_size
    if lora_rank > 0:
        adapters = (lora_rank, lora_target_modules, mixed_precision)
        all_layers = tokens * lora_decoder_bytes_per_token(shape, precision, attn_implementation, seq_len, *adapters)
        one_layer = tokens * lora_layer_bytes_per_token(shape, precision, attn_implementation, seq_len, *adapters)
        # Frozen embedding and lm_head save no ids and no input; the frozen final norm saves its
        # fp32 input and rsqrt, as the first layer's norm would if its input needed a gradient.
        outside = tokens * (INT64_BYTES + (frozen_norm_bytes_per_token(h) if grad_checkpointing else 0))
    else:
        one_layer = tokens * layer_activation_bytes_per_token(shape, precision, attn_implementation, seq_len)
        all_layers = tokens * decoder_activation_bytes_per_token(shape, precision, attn_implementation, seq_len)
        # Outside the layers: the final norm and the lm_head's input, plus token ids and labels.
        outside = tokens * (norm_saved_bytes_per_token(shape, precision, consuming_linears=1) + 2 * INT64_BYTES)
    # The rotary cos and sin of every position (the trainer passes position ids per row), in the
    # residual dtype, shared by all layers.
    rotary = tokens * 2 * shape.head_dim * precision.residual_bytes
    lora = f", LoRA rank {lora_rank} (frozen norms, adapter inputs and rank-wide outputs)" if lora_rank > 0 else ""
    recomputed = 0
    if grad_checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time (Chen et al.
        # 2016, "Training Deep Nets with Sublinear Memory Cost"; transformers checkpoints each
        # decoder layer). On an fp32 residual stream the recomputed layer's first norm saves that
        # same input (its cast to fp32 is a no-op): counted once.
        boundaries = shape.num_layers * tokens * h * precision.residual_bytes
        shared_input = tokens * h * FP32_BYTES if precision.residual_bytes == FP32_BYTES else 0
        recomputed = one_layer - shared_input
        saved = boundaries + outside + rotary
        how = (f"checkpointed: {shape.num_layers} layer inputs ({tokens:,} tokens x {h} x {precision.residual_bytes} "
               f"B){lora} + final norm, token ids and rotary cos/sin; backward recomputes one layer at a time "
               f"({recomputed:,} B, alive in that layer's backward)")
    else:
        saved = all_layers + outside + rotary
        how = (f"{shape.num_layers} layers x {all_layers // shape.num_layers:,} B saved for backward "
               f"({tokens:,} tokens, {attn_implementation}){lora} + final norm, token ids and rotary cos/sin")
    if offload:
        # training.offload: every saved tensor goes to the host in forward; backward unpacks one
        # node's at a time, within one layer's (an upper bound); checkpointing recomputes one layer.
        return Term("activations", one_layer, f"offloaded to host memory ({saved:,} B there, see notes); on the "
                                              f"GPU at most one layer's saved tensors in backward ({one_layer:,} B){lora}"
                    ), 0
    return Term("activations", saved, how), recomputed


def _training_logits_term(
    shape: ModelShape, precision: Precision, batch: int, seq_len: int, loss_chunk_tokens: int = 0,
    head_bytes: int = 2,
) -> Term:
    """The loss's backward, the first of backward: what it holds at its largest.

    transformers' ForCausalLMLoss upcasts the logits to fp32 and runs cross_entropy; log_softmax saves its fp32
    output, and its backward holds that, the incoming fp32 gradient and the outgoing one at once. The model's own
    logits (compute dtype) and their fp32 copy are freed when the forward returns: nothing saves them. The chunked
    loss (``training.chunked_loss``) saves the head's input and the loss positions' int64 index (every position
    counted: an upper bound where prompts carry no loss); its backward makes the head weight's gradient whole
    (``head_bytes`` per value, even for a frozen head) and the hidden state's, and per chunk of positions the
    logits again (compute dtype, then fp32), their softmax, its cast, and the chunk's share of the weight gradient;
    the previous chunk's fp32 logits and gradient are still alive while the next chunk's logits are made."""
    p, r = precision.compute_bytes, precision.residual_bytes
    tokens, vocab, h = batch * seq_len, shape.vocab_size, shape.hidden_size
    # Gemma-2 soft-caps the logits (cap x tanh(logits / cap)): tanh keeps its output for backward.
    softcap = shape.architecture.final_logit_softcapping
    if loss_chunk_tokens <= 0:
        capped = p if softcap else 0
        per_logit = ("3 x 4 B: fp32 log-softmax output and its gradient in and out"
                     + (f" + {p} B soft-capping's tanh output" if softcap else ""))
        return Term("logits_and_loss", tokens * vocab * (3 * FP32_BYTES + capped),
                    f"the loss's backward: {batch} x {seq_len} tokens x {vocab:,} vocab x ({per_logit})")
    chunk = min(tokens, loss_chunk_tokens)
    chunks = math.ceil(tokens / chunk)
    per_chunk_logit = max(
        (2 * FP32_BYTES + 2 * p) if chunks > 1 else (2 * FP32_BYTES + p),  # fp32 logits, softmax, casts, overlap
        4 * FP32_BYTES if softcap else 0,  # soft-capping's derivative: 1 - (x / cap)^2 over the fp32 logits
    )
    weight_gradient_step = chunk * vocab * (FP32_BYTES + p) + vocab * h * p  # the chunk's share of it, in p
    one_chunk = max(chunk * vocab * per_chunk_logit, weight_gradient_step) + chunk * h * p
    whole = vocab * h * head_bytes + tokens * h * r
    index = tokens * INT64_BYTES
    return Term(
        "logits_and_loss", whole + one_chunk + index,
        f"the chunked loss's backward (loss_chunk_tokens {loss_chunk_tokens}, {chunks} chunk(s) of {chunk}): the head "
        f"weight's gradient ({vocab:,} x {h:,} x {head_bytes} B) and the hidden state's ({tokens:,} x {h:,} x {r} B), "
        f"one chunk's logits and their gradients ({one_chunk:,} B), and the {tokens:,} loss positions' int64 index",
    )


def _step_tensors(
    shape, precision, state_terms, batch, seq_len, grad_checkpointing, attn_implementation, lora_rank,
    lora_target_modules, mixed_precision, offload_activations, loss_chunk_tokens, gradient_accumulation_steps,
    fused_optimizer: bool,
) -> StepTensors:
    """What one micro-batch makes beside the state terms, and the sizes the step's moments need
    (``step_moments``)."""
    state = {term.name: term.bytes for term in state_terms}
    lora = lora_rank > 0
    tokens, h, p, r = batch * seq_len, shape.hidden_size, precision.compute_bytes, precision.residual_bytes
    activations, recomputed = _training_activations_term(
        shape, precision, batch, seq_len, grad_checkpointing, attn_implementation, lora_rank, lora_target_modules,
        mixed_precision, offload_activations)
    full_fine_tune_master = mixed_precision and not lora
    loss = _training_logits_term(shape, precision, batch, seq_len, loss_chunk_tokens,
                                 head_bytes=FP32_BYTES if full_fine_tune_master else p)
    gradients, copies = state.get("gradients", 0), state.get("autocast_weight_copies", 0)
    head = next((layer for layer in shape.linear_layers if layer.is_output_embedding), None)
    head_parameters = head.parameters if head is not None else 0
    tied = shape.non_decoder_parameters < 2 * shape.vocab_size * h
    if lora:
        head_gradients = untied_embedding = 0
        layer_gradients = gradients // shape.num_layers
        head_copy, layer_copies = 0, copies // shape.num_layers
    else:
        trainable_bytes = gradients / shape.parameters  # a parameter's gradient bytes on this GPU (FSDP: a share)
        head_gradients = math.ceil(head_parameters * trainable_bytes)
        layer_gradients = math.ceil(shape.decoder_layer_parameters * trainable_bytes)
        untied_embedding = 0 if tied else math.ceil(shape.vocab_size * h * trainable_bytes)
        head_copy = head_parameters * p if copies else 0
        layer_copies = (copies - head_copy) // shape.num_layers if copies else 0
    # The end of backward: the gradient reaching the input embedding, which makes the embedding's gradient. A tied
    # embedding is one parameter used twice: autograd holds the head's gradient in its input buffer until the
    # embedding's arrives, then sums the two into a third before accumulating it (head, new and sum at once).
    tied_gradient = 0 if lora or not tied else math.ceil(shape.vocab_size * h * gradients / shape.parameters)
    end = max(tokens * h * r, 2 * tied_gradient)
    end_how = (f"the tied embedding's gradient from the input side and the sum of it with the head's "
               f"({tied_gradient:,} B each; the head's own is counted in gradients)" if tied_gradient else
               f"the gradient reaching the input embedding ({tokens:,} tokens x {h:,} x {r} B)")
    # AdamW: fused (one kernel per parameter group, in place) where the trainer runs on one GPU or DDP, and
    # bitsandbytes' 8-bit AdamW updates in place too; foreach AdamW (FSDP) makes sqrt(exp_avg_sq) for every
    # parameter at once (torch.optim.adamw._multi_tensor_adamw).
    optimizer_temporaries = 0 if fused_optimizer else state.get("optimizer_states", 0) // 2
    optimizer_how = ("fused AdamW updates in place" if fused_optimizer else
                     "foreach AdamW's sqrt of the second moments, for every parameter at once")
    return StepTensors(
        activations=activations, loss=loss, checkpointing=grad_checkpointing and not offload_activations,
        accumulating=gradient_accumulation_steps > 1, recomputed_layer=recomputed, layer_input=tokens * h * r,
        head_weight_copy=head_copy, layer_weight_copies=layer_copies, head_gradients=head_gradients,
        layer_gradients=layer_gradients, untied_embedding_gradients=untied_embedding, end_temporaries=end,
        end_explanation=end_how, optimizer_temporaries=optimizer_temporaries, optimizer_explanation=optimizer_how,
    )
