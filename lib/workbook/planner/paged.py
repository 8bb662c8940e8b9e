"""Memory of the ``continuous`` backend: transformers' continuous batching with a paged KV cache.

The dense planner (``generation.plan_generate``) counts a KV cache that grows by ``torch.cat``; the
continuous backend instead allocates one paged cache up front. ``paged_layout`` sizes it for the
in-flight requests (the backend passes these numbers to transformers, so the library never guesses
from free memory), and ``plan_generate_paged`` counts what transformers allocates for that layout
(transformers 5.x ``continuous_batching/cache.py``, ``PagedAttentionMemoryHandler``), so that
``batch_size: auto`` means the largest in-flight limit that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from transformers import PretrainedConfig

from workbook.planner.formulas import kv_cache_bytes_per_token, weights_bytes, weights_explanation
from workbook.planner.generation import _generate_logits_term, _inference_layer_peak_bytes
from workbook.planner.plans import (
    DEFAULT_FRAGMENTATION_FRACTION, DEFAULT_OVERHEAD_BYTES, DEFAULT_SAFETY_MARGIN, Plan, Term, check_overheads,
    make_plan, overhead_terms,
)
from workbook.planner.shape import (
    ATTENTION_IMPLEMENTATIONS, INT64_BYTES, ModelShape, canonical_dtype, check_choice, compute_bytes, model_shape,
    positive_bytes, require_positive,
)

PAGE_SIZE = 256  # tokens per page: transformers' ContinuousBatchingConfig default
# Tokens one forward step may hold (a prefill longer than this is split over steps). transformers'
# default is 8192; its attention mask grows with it times the cache's tokens (sdpa/eager), so
# 2048 keeps the mask small while a step still prefills many prompts at once.
MAX_BATCH_TOKENS = 2048
TRASH_SECTORS = 2  # sectors transformers keeps at the start of the cache and never hands out


@dataclass(frozen=True)
class PagedLayout:
    """The paged cache for ``requests`` in flight, each up to ``sequence_tokens`` (prompt + new)."""

    requests: int  # in-flight limit (ContinuousBatchingConfig.max_requests_per_batch)
    sequence_tokens: int
    page_size: int
    blocks_per_request: int  # a request's last page is partly empty
    num_blocks: int  # every in-flight request at its full length (ContinuousBatchingConfig.num_blocks)
    max_batch_tokens: int

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.page_size


def paged_layout(requests: int, prompt_tokens: int, new_tokens: int, page_size: int = PAGE_SIZE) -> PagedLayout:
    """Blocks for ``requests`` requests of ``prompt_tokens`` + ``new_tokens``: the cache never has to
    evict or refuse a request in flight, and holds nothing more."""
    require_positive(requests=requests, prompt_tokens=prompt_tokens, new_tokens=new_tokens, page_size=page_size)
    blocks_per_request = math.ceil((prompt_tokens + new_tokens) / page_size)
    # A step holds every request's next token; at the start it prefills as many prompts as fit.
    max_batch_tokens = max(requests, min(requests * prompt_tokens, MAX_BATCH_TOKENS))
    return PagedLayout(requests, prompt_tokens + new_tokens, page_size, blocks_per_request,
                       requests * blocks_per_request, max_batch_tokens)


def default_page_size() -> int:
    """transformers' default page: ``ContinuousBatchingConfig.page_size`` (``block_size`` in 5.17 and before)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return PAGE_SIZE
    return getattr(ContinuousBatchingConfig, "page_size", None) or getattr(ContinuousBatchingConfig, "block_size",
                                                                            PAGE_SIZE)


def continuous_batching_config(options: dict):
    """transformers' ``ContinuousBatchingConfig`` from ``options`` (keyed as the current release names its fields:
    ``page_size`` is passed as ``block_size`` where the release still calls it that), keeping the fields this
    release has; None where transformers has no such class (releases that read the options from the generation
    config)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    names = {field.name for field in fields(ContinuousBatchingConfig)}
    if "page_size" not in names and "page_size" in options:  # 5.17 and before call the page a block
        options = {("block_size" if key == "page_size" else key): value for key, value in options.items()}
    return ContinuousBatchingConfig(**{key: value for key, value in options.items() if key in names})


def paged_kernel(attention):
    """The kernel continuous batching ran, as the reports and the planner name it: transformers 5.17 calls
    the paged kernels "paged|sdpa", "paged|flash_attention_2"; later releases name them plain."""
    return attention.removeprefix("paged|") if isinstance(attention, str) else attention


def continuous_attention(requested: str) -> str:
    """The attention transformers' continuous batching will run for ``requested`` (planned as
    ``ATTENTION_IMPLEMENTATIONS`` name it): it switches sdpa and eager to flash attention where
    flash-attn 3 or 2 is installed (its ``switch_to_cb_friendly_attn``), and without flash an sdpa
    step takes a dense mask and K/V repeated to every head, which flash needs neither of."""
    if requested.startswith("flash"):
        return requested
    try:
        from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available
    except ImportError:  # a release without the checks: planned as asked
        return requested
    return "flash_attention_2" if is_flash_attn_3_available() or is_flash_attn_2_available() else requested


def plan_generate_paged(
    model: PretrainedConfig | ModelShape | str,
    *,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    gpu_memory_bytes: int,
    dtype: str = "bf16",
    attn_implementation: str = "sdpa",
    page_size: int = PAGE_SIZE,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
    fragmentation_fraction: float = DEFAULT_FRAGMENTATION_FRACTION,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    data_parallel_size: int = 1,
) -> Plan:
    """Peak memory of one GPU running continuous batching with ``batch_size`` requests in flight,
    each a prompt of ``prompt_len`` tokens and ``new_tokens`` new ones, and the largest in-flight
    limit that fits. One replica per GPU (``data_parallel_size`` of them); the paged cache is allocated in full at
    the start, so the peak does not depend on how far the requests have got."""
    shape = model_shape(model)
    dtype = canonical_dtype(dtype)
    gpu_memory_bytes = positive_bytes("gpu_memory_bytes", gpu_memory_bytes)
    check_choice("attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS)
    check_overheads(overhead_bytes, fragmentation_fraction, safety_margin)
    weights = weights_bytes(shape, dtype)
    per_token = kv_cache_bytes_per_token(shape, dtype)

    def terms_for(batch: int) -> list[Term]:
        layout = paged_layout(batch, prompt_len, new_tokens, page_size)
        terms = [Term("weights", weights, weights_explanation(shape, dtype)),
                 *_paged_terms(shape, dtype, layout, attn_implementation, per_token)]
        return terms + overhead_terms(terms, overhead_bytes, fragmentation_fraction)

    return make_plan(
        mode="generate", shape=shape, dtype=dtype, batch_size=batch_size,
        lengths={"prompt_len": prompt_len, "new_tokens": new_tokens},
        settings={"backend": "continuous", "attn_implementation": attn_implementation, "page_size": page_size,
                  "overhead_bytes": overhead_bytes, "fragmentation_fraction": fragmentation_fraction},
        terms_for=terms_for, weights=weights, trainable=0, kv_per_token=per_token,
        gpu_memory_bytes=gpu_memory_bytes, gpu_count=data_parallel_size, safety_margin=safety_margin,
        data_parallel_size=data_parallel_size,
        notes=["continuous backend: paged KV cache sized for batch_size requests in flight at prompt_len + "
               "new_tokens (sliding-window layers planned as full attention)"],
    )


def _paged_terms(shape: ModelShape, dtype: str, layout: PagedLayout, attn_implementation: str,
                 per_token: int) -> list[Term]:
    p = compute_bytes(dtype)
    flash = attn_implementation.startswith("flash")
    cache_tokens = layout.cache_tokens
    steps = layout.max_batch_tokens
    # sdpa/eager read each layer's keys and values back repeated to every head (2 x heads + the
    # values' kv heads); flash reads the kv heads as stored. Plus one int64 read index per token.
    heads_read = 2 * shape.num_key_value_heads if flash else 2 * shape.num_attention_heads + shape.num_key_value_heads
    read_bytes = cache_tokens * (heads_read * shape.head_dim * p + INT64_BYTES)
    # sdpa/eager need a [steps, cache + steps] mask; with flash, transformers double-buffers its
    # inputs instead (async batching), which the step's term below counts twice.
    mask = 0 if flash else steps * (cache_tokens + steps) * p
    return [
        Term("kv_cache", (layout.num_blocks + TRASH_SECTORS) * layout.page_size * per_token,
             f"paged: {layout.requests} requests x {layout.blocks_per_request} blocks of {layout.page_size} tokens "
             f"(prompt + new = {layout.sequence_tokens}) + {TRASH_SECTORS} unused blocks, x {per_token:,} B/token"),
        Term("kv_read", read_bytes,
             f"one layer's keys and values read back from {cache_tokens:,} cache tokens "
             f"({heads_read} heads x {shape.head_dim} x {p} B) + an int64 index each"),
        Term("attention_mask", mask,
             "flash attention: none" if flash else f"{steps:,} step tokens x ({cache_tokens:,} + {steps:,}) x {p} B"),
        Term("activations", _inference_layer_peak_bytes(shape, p, 1, steps, 1, "sdpa") * (2 if flash else 1),
             f"largest transient inside one layer for a step of {steps:,} tokens (MLP or attention)"),
        _generate_logits_term(shape, p, layout.requests, 1, f"{layout.requests} requests' last positions"),
    ]
