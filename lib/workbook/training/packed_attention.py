"""Packed rows without a seq x seq mask: each packed example attends only to itself.

Packing puts several examples in one row, their position ids restarting at 0 (``batches.Collator``).
Given no mask, transformers' sdpa path builds a block-causal 4D mask from those restarts (masking_utils):
a batch x seq x seq tensor that sdpa keeps per layer for backward, with keys/values repeated to every
head. The paths chosen here need none (``planner.architectures.packed_attention`` picks one):
- ``flex_attention`` on CUDA: transformers builds a BlockMask from the same restarts, O(seq) memory,
  one compiled kernel (torch's flex attention has no backward on CPU); registered again below to take
  its inputs in autocast's dtype, as sdpa does;
- ``document_sdpa`` elsewhere (registered below): sdpa with ``is_causal`` on each example's span, the
  same result with no mask at all, keys/values not repeated (``enable_gqa``); a loop over examples, which
  is the price on CPU.
"""

from __future__ import annotations

import contextlib

import torch

from workbook.planner.architectures import DOCUMENT_SDPA, FLEX_ATTENTION
from workbook import models
from workbook.planner.architectures import training_attention
from workbook.planner.shape import model_shape


def document_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """transformers' attention interface: (batch, heads, seq, head_dim) inputs -> (batch, seq, heads, head_dim).

    Examples are the runs of ``position_ids`` starting at 0; no position ids: each row is one sequence."""
    if attention_mask is not None:
        raise ValueError(f"{DOCUMENT_SDPA} attention takes packed rows marked by position ids, not an attention "
                         "mask; pass position_ids (and no attention_mask) or use attn_implementation sdpa")
    position_ids = kwargs.get("position_ids")
    batch, _, seq_len, _ = query.shape
    output = query.new_empty(batch, seq_len, query.shape[1], value.shape[-1])
    for row in range(batch):
        for start, end in _example_spans(position_ids, row, seq_len):
            span = slice(start, end)
            attended = torch.nn.functional.scaled_dot_product_attention(
                query[row:row + 1, :, span], key[row:row + 1, :, span], value[row:row + 1, :, span],
                dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1])
            output[row:row + 1, span] = attended.transpose(1, 2)
    return output, None


def _example_spans(position_ids: torch.Tensor | None, row: int, seq_len: int) -> list[tuple[int, int]]:
    if position_ids is None:
        return [(0, seq_len)]
    starts = (position_ids[row] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [seq_len]))


def register() -> None:
    """Make ``attn_implementation="document_sdpa"`` loadable (no mask is built for it), and flex
    attention run under autocast as sdpa does (``autocast_attention``)."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_attention)
    AttentionMaskInterface.register(DOCUMENT_SDPA, _no_mask)
    AttentionInterface.register(FLEX_ATTENTION, autocast_attention(flex_attention_forward))


def autocast_attention(attention):
    """``attention`` (transformers' interface) with query, key and value in autocast's dtype while
    autocast is on, as sdpa casts them. Mixed precision keeps fp32 weights, so the rotary embedding
    (cos and sin in the fp32 hidden states' dtype) turns the bf16 projections of query and key back
    into fp32 while value stays bf16; flex attention, which autocast does not cover in every torch
    release, then refuses the mixed dtypes or runs fp32 kernels."""
    def cast(module, query, key, value, *args, **kwargs):
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return attention(module, query, key, value, *args, **kwargs)

    return cast


@contextlib.contextmanager
def generation_attention(model):
    """``model`` with an attention that generation can use, then back to its training path. The packed
    paths cannot decode: ``document_sdpa`` takes no padding mask (left-padded prompts would attend to
    their padding) and runs a one-token step causal from its first key, and flex attention compiles a
    block mask per shape; generation (greedy accuracy checks) runs sdpa meanwhile."""
    current = model.config._attn_implementation
    if current not in (DOCUMENT_SDPA, FLEX_ATTENTION):
        yield model
        return
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(current)


def _no_mask(*args, **kwargs):
    return None


def training_attention_for(config, seq_len: int) -> str:
    """The attention a run of ``config`` (a TrainConfig) trains with at ``seq_len`` tokens per row, on this
    machine: what the trainer loads and the memory plan plans (``planner.architectures.training_attention``)."""
    shape = model_shape(models.model_source(config.model))
    # device_count reads NVML: is_available would start the CUDA driver before notebook_launcher forks.
    return training_attention(shape, config.attn_implementation, config.padding, seq_len,
                              on_gpu=torch.cuda.device_count() > 0)
