"""Peak memory of ``model.generate`` per GPU: prefill or the last decode step, whichever is larger."""

from __future__ import annotations

from transformers import PretrainedConfig

from workbook.planner.formulas import kv_bytes_per_token_per_layer, kv_cache_bytes, kv_cache_bytes_per_token, \
    weights_bytes, weights_explanation
from workbook.planner.layout import LayoutError, check_tensor_parallel_size, per_rank, sharded_weights_bytes
from workbook.planner.plans import (
    DEFAULT_FRAGMENTATION_FRACTION, DEFAULT_OVERHEAD_BYTES, DEFAULT_SAFETY_MARGIN, Plan, Term, check_overheads,
    make_plan, overhead_terms,
)
from workbook.units import MiB
from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, BITS_PER_PARAMETER, FP32_BYTES, ModelShape, canonical_dtype, check_choice, compute_bytes, has_window,
    model_shape, positive_bytes, require_positive,
)


def plan_generate(
    model: PretrainedConfig | ModelShape | str,
    *,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    gpu_memory_bytes: int,
    dtype: str = "bf16",
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    attn_implementation: str = "sdpa",
    logits_last_position_only: bool = True,
    static_cache: bool = False,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    fragmentation_fraction: float = DEFAULT_FRAGMENTATION_FRACTION,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Plan:
    """Peak memory per GPU of ``model.generate`` for ``batch_size`` prompts of ``prompt_len``
    tokens, each continued by ``new_tokens`` tokens, and the largest batch that fits.

    The peak is the larger of two phases: prefill (the prompt's KV cache, one layer's activations,
    the prompt's logits) and the last decode step (the full KV cache plus the copy ``torch.cat``
    makes while appending). With ``tensor_parallel_size`` T > 1 the model is sharded as
    transformers' ``tp_plan="auto"`` shards it (``layout.sharded_weights_bytes``): each GPU holds
    1/T of the projections and the embedding, whole norms, 1/T of the key/value heads' cache, 1/T of
    the heads and MLP width in its activations, the full hidden state and the gathered logits, and
    the all-reduce buffers. ``data_parallel_size`` groups of T GPUs each run their own batch: it
    changes the GPU count, not the bytes per GPU.
    ``logits_last_position_only`` mirrors generate(), which passes ``logits_to_keep=1``
    (transformers 5.x generation/utils.py); False plans a forward pass that returns all logits.
    ``static_cache`` (the static-compiled backend): transformers' StaticCache, allocated for
    prompt_len + new_tokens tokens (a sliding layer for its window) at the first forward and written
    in place, so prefill already holds all of it; otherwise the DynamicCache, which grows by torch.cat.
    """
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    require_positive(
        batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
        tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
    )
    gpu_memory_bytes = positive_bytes("gpu_memory_bytes", gpu_memory_bytes)
    check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
    check_overheads(overhead_bytes, fragmentation_fraction, safety_margin)

    tp = tensor_parallel_size
    check_tensor_parallel_size(tp, shape.num_key_value_heads, model=shape.name)
    if tp == 1:
        weights, how = weights_bytes(shape, dtype), weights_explanation(shape, dtype)
    elif isinstance(model, ModelShape):
        raise LayoutError("a tensor-parallel plan reads the model's sharding plan from its config: pass the "
                          "config or the preset name, not a ModelShape")
    else:
        weights = sharded_weights_bytes(model, dtype, tp)
        how = (f"{weights // (BITS_PER_PARAMETER[dtype] // 8):,} of {shape.parameters:,} params x "
               f"{BITS_PER_PARAMETER[dtype] // 8} B on each of {tp} GPUs (projections and embedding split "
               "over T as transformers' tp_plan 'auto' splits them, norms whole)")

    def terms_for(batch: int) -> list[Term]:
        phase = _generate_peak_phase(
            shape, dtype, batch, prompt_len, new_tokens, attn_implementation,
            logits_last_position_only, tp, static_cache,
        )
        terms = [Term("weights", weights, how), *phase]
        return terms + overhead_terms(terms, overhead_bytes, fragmentation_fraction)

    notes = []
    total_tokens = prompt_len + new_tokens
    if shape.max_position_embeddings and total_tokens > shape.max_position_embeddings:
        notes.append(
            f"prompt_len + new_tokens = {total_tokens} exceeds the model's "
            f"max_position_embeddings ({shape.max_position_embeddings}); quality may degrade"
        )
    if any(window is not None for window in shape.attention_windows):
        notes.append("sliding-window layers hold at most window tokens of KV cache")
    return make_plan(
        mode="generate", shape=shape, dtype=dtype, batch_size=batch_size,
        lengths={"prompt_len": prompt_len, "new_tokens": new_tokens},
        settings={
            "attn_implementation": attn_implementation,
            "logits_last_position_only": logits_last_position_only,
            "static_cache": static_cache,
            "overhead_bytes": overhead_bytes,
            "fragmentation_fraction": fragmentation_fraction,
        },
        terms_for=terms_for, weights=weights, trainable=0,
        kv_per_token=kv_cache_bytes_per_token(shape, dtype) // tp,
        gpu_memory_bytes=gpu_memory_bytes, gpu_count=tp * data_parallel_size, safety_margin=safety_margin,
        notes=notes, tensor_parallel_size=tp, data_parallel_size=data_parallel_size,
    )


def _generate_peak_phase(
    shape, dtype, batch, prompt_len, new_tokens, attn_implementation,
    logits_last_position_only, tp, static_cache=False,
) -> list[Term]:
    """The terms of the larger phase: prefill, or the last decode step."""
    static_tokens = prompt_len + new_tokens if static_cache else 0
    prefill = _prefill_terms(
        shape, dtype, batch, prompt_len, attn_implementation, logits_last_position_only, tp, static_tokens,
    )
    if new_tokens == 1:  # the prefill's logits give the only new token
        return prefill
    decode = _last_decode_terms(
        shape, dtype, batch, prompt_len + new_tokens - 1, attn_implementation, tp, static_tokens,
    )
    return max(prefill, decode, key=lambda terms: sum(term.bytes for term in terms))


def _prefill_terms(
    shape, dtype, batch, prompt_len, attn_implementation, logits_last_position_only, tp, static_tokens=0,
) -> list[Term]:
    p = compute_bytes(dtype)
    kv = kv_cache_bytes(shape, dtype, batch_size=batch, tokens=prompt_len,
                        last_step_tokens=prompt_len)
    logit_positions = 1 if logits_last_position_only else prompt_len
    kv_term = Term("kv_cache", kv // tp,
                   f"prefill: {batch} x {prompt_len} prompt tokens x "
                   f"{kv_cache_bytes_per_token(shape, dtype) // tp:,} B/token "
                   f"(layers x {shape.architecture.kv_cache_explanation} x {p} B{_over_tp(tp, 'kv_heads')})")
    return [
        _static_cache_term(shape, dtype, batch, static_tokens, tp, "prefill") if static_tokens else kv_term,
        Term("activations",
             _inference_layer_peak_bytes(shape, p, batch, prompt_len, prompt_len,
                                         attn_implementation, tp)
             + _forward_held_bytes(shape, p, batch, prompt_len, static_tokens or prompt_len, attn_implementation),
             f"prefill: largest transient inside one layer for {batch} x {prompt_len} tokens "
             f"(MLP or {attn_implementation} attention, whichever is larger{_over_tp(tp, 'heads and MLP width')}), "
             "+ what the forward holds across its layers (the embeddings, the layer's input, rotary cos/sin, the "
             "padding mask)"),
        _generate_logits_term(shape, p, batch, logit_positions, "prefill", tp),
        *_communication_terms(shape, p, batch * prompt_len, tp, "prefill"),
    ]


def _last_decode_terms(
    shape, dtype, batch, cached_tokens, attn_implementation, tp, static_tokens=0,
) -> list[Term]:
    # generate() feeds back every new token but the last, so the cache ends at
    # prompt_len + new_tokens - 1 tokens (``cached_tokens``).
    p = compute_bytes(dtype)
    kv = kv_cache_bytes(shape, dtype, batch_size=batch, tokens=cached_tokens)
    # DynamicLayer.update builds the longer tensor with torch.cat before dropping the old one.
    one_layer_old_copy = batch * kv_bytes_per_token_per_layer(shape, dtype) // tp * max(
        cached_tokens if window is None else min(cached_tokens, window)
        for window in shape.attention_windows
    )
    capped = ", sliding layers capped at their window" if has_window(shape) else ""
    kv_term = Term("kv_cache", kv // tp + one_layer_old_copy,
                   f"last decode step: {batch} x {cached_tokens} tokens (prompt + new - 1: the last "
                   f"token is never fed back) x {kv_cache_bytes_per_token(shape, dtype) // tp:,} B/token"
                   f"{capped}{_over_tp(tp, 'kv_heads')}, + one layer's old copy while torch.cat appends")
    return [
        _static_cache_term(shape, dtype, batch, static_tokens, tp, "last decode step", cached_tokens)
        if static_tokens else kv_term,
        Term("activations",
             _inference_layer_peak_bytes(shape, p, batch, 1, cached_tokens, attn_implementation, tp)
             + _forward_held_bytes(shape, p, batch, 1, static_tokens or cached_tokens + 1, attn_implementation),
             f"last decode step: largest transient inside one layer for {batch} x 1 token, + what the forward "
             "holds across its layers"),
        _generate_logits_term(shape, p, batch, 1, "last decode step", tp),
        *_communication_terms(shape, p, batch, tp, "last decode step"),
    ]


def _static_cache_term(shape, dtype, batch, static_tokens, tp, phase, cached_tokens=0) -> Term:
    """transformers' StaticCache: every layer's keys and values for ``static_tokens`` (a sliding layer for its
    window), allocated at the first forward and written in place; a sliding layer already full rolls its window
    into a new tensor before copying it back (cache_utils.py StaticSlidingWindowLayer.update)."""
    per_layer = batch * kv_bytes_per_token_per_layer(shape, dtype) // tp
    held = sum(static_tokens if window is None else min(window, static_tokens) for window in shape.attention_windows)
    full_windows = [window for window in shape.attention_windows if window is not None and cached_tokens >= window]
    rolled = per_layer * max(full_windows) if full_windows else 0  # new keys and values, one layer
    return Term("kv_cache", per_layer * held + rolled,
                f"{phase}: the static cache, {batch} x {static_tokens} tokens (prompt + new) allocated at once "
                f"x {kv_cache_bytes_per_token(shape, dtype) // tp:,} B/token"
                + (", sliding layers capped at their window" if has_window(shape) else "")
                + (", + a full sliding layer's rolled copy" if rolled else ""))


def _inference_layer_peak_bytes(
    shape: ModelShape, p: int, batch: int, query_len: int, key_len: int, attn_implementation: str,
    tp: int = 1,
) -> int:
    """The largest set of tensors alive at once inside one layer without autograd.

    Per query token: the residual input and the norm output (2 p h) plus the larger of the MLP
    (silu(gate), up and their product: 3 p intermediate, gate itself is freed first) and attention
    (q, k, v, rotated q and k, the output: p (3 q_width + 3 kv_width)). eager attention adds the
    scores (p), their fp32 softmax and its p copy per head and key, and keys and values repeated
    to all heads for the whole cache. Under tensor parallelism (``tp`` > 1) each GPU computes its
    1/tp of the heads and of the MLP width; the residual stream stays whole.
    """
    h, i = shape.hidden_size, per_rank(shape.intermediate_size, tp)
    query_width, key_value_width = shape.query_width // tp, shape.key_value_width // tp
    mlp = 3 * p * i
    attention = p * (3 * query_width + 3 * key_value_width)
    eager_extra = 0
    if attn_implementation == "eager":
        scores_bytes = p + FP32_BYTES + (p if p != FP32_BYTES else 0)
        eager_extra = shape.num_attention_heads // tp * key_len * scores_bytes * query_len
        if shape.num_key_value_heads < shape.num_attention_heads:
            eager_extra += 2 * p * query_width * key_len
    tokens = batch * query_len
    return tokens * (2 * p * h + max(mlp, attention)) + batch * eager_extra


def _forward_held_bytes(shape: ModelShape, p: int, batch: int, query_len: int, key_len: int,
                        attn_implementation: str) -> int:
    """What the model's forward holds beside one layer's own tensors (transformers 5.x LlamaModel.forward and its
    kin): the embeddings' output, kept to the forward's end, and the layer's input, which the loop over the layers
    holds while the layer makes its residual sum (2 p h per token); the rotary cos and sin of every position (p
    each, batch-wide: generate() passes position ids per row); and the attention mask of a padded batch (a batch
    of unequal prompts is left-padded): bool for sdpa, in the compute dtype for eager, none for flash attention,
    one for the full layers and one for the sliding ones, over the cache's whole length (a static cache's too)."""
    tokens = batch * query_len
    hidden = tokens * 2 * p * shape.hidden_size
    rotary = tokens * 2 * p * shape.head_dim
    if attn_implementation.startswith("flash"):
        return hidden + rotary
    masks = len({window is None for window in shape.attention_windows})  # full, sliding or both
    mask = masks * tokens * key_len * (p if attn_implementation == "eager" else 1)
    return hidden + rotary + mask


def _generate_logits_term(
    shape: ModelShape, p: int, batch: int, positions: int, phase: str, tp: int = 1
) -> Term:
    # The lm_head writes logits in the compute dtype for the kept positions; generate() then
    # copies the last position to fp32 to pick the next token (generation/utils.py, _sample).
    # Under tensor parallelism (colwise_gather_output) each GPU writes its 1/tp of the vocab, then
    # all-gathers the whole: both are alive at once.
    logits = batch * positions * shape.vocab_size * p
    local = batch * positions * per_rank(shape.vocab_size, tp) * p if tp > 1 else 0
    fp32_copy = batch * shape.vocab_size * FP32_BYTES
    gathered = f", + this GPU's 1/{tp} of the vocab before the all-gather" if tp > 1 else ""
    return Term(
        "logits", logits + local + fp32_copy,
        f"{phase}: {batch} x {positions} position(s) x {shape.vocab_size:,} vocab x {p} B{gathered}, "
        f"+ fp32 copy of the last position ({batch} x {shape.vocab_size:,} x 4 B)",
    )


# NCCL's communicator buffers per GPU (NCCL_BUFFSIZE 4 MiB per channel and peer, plus its proxy
# state): a prior of the same standing as the CUDA context until calibrated on a multi-GPU machine.
TP_COMMUNICATOR_BYTES = 256 * MiB


def _communication_terms(shape: ModelShape, p: int, tokens: int, tp: int, phase: str) -> list[Term]:
    """Tensor parallelism's buffers: the all-reduce that sums the row-split projections' partial
    outputs writes a new tensor of the full hidden size, and the communicator keeps its own."""
    if tp == 1:
        return []
    all_reduce = tokens * shape.hidden_size * p
    return [Term("tp_communication", all_reduce + TP_COMMUNICATOR_BYTES,
                 f"{phase}: all-reduce output of {tokens:,} tokens x {shape.hidden_size:,} hidden x {p} B, + "
                 f"NCCL communicator buffers {TP_COMMUNICATOR_BYTES // MiB} MiB (prior until calibrated)")]


def _over_tp(tp: int, what: str) -> str:
    return f"; {what} split over {tp} GPUs" if tp > 1 else ""

