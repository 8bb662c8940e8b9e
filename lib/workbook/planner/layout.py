"""Tensor x data parallel layouts for generation: what one GPU holds when a model is sharded over T
GPUs with transformers' own tensor parallelism, which T a profile needs, and the refusals the engine
makes before it loads anything.

A job on ``gpu_count`` = T x D GPUs runs D groups of T processes: each group holds one copy of the
model split over its T GPUs (``DistributedConfig(tp_plan="auto")``), and the groups share the
prompts as data parallel does. The planner plans only what the engine runs: no layer split.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch
from transformers import PretrainedConfig

from workbook import presets
from workbook.planner.plans import Plan
from workbook.planner.shape import BITS_PER_PARAMETER, QUANTIZED_DTYPES, canonical_dtype

# Below this many sequences per GPU a decode step mostly waits on reading the weights (memory
# bound): a layout that only fits fewer wastes its GPUs, so 'auto' takes the next larger T.
USEFUL_BATCH_SIZE = 16

# Which dimension of each parameter transformers' tensor-parallel styles shard (None: replicated),
# read from transformers 5.x distributed/tensor_parallel.py (ColwiseParallel, RowwiseParallel,
# EmbeddingParallel); the same names and meanings as the integrations module of 5.17.
SHARDED_DIMENSION = {
    "colwise": {"weight": 0, "bias": 0},  # output features split: q, k, v, gate, up
    "colwise_gather_output": {"weight": 0, "bias": 0},  # lm_head: vocab split, logits gathered
    "rowwise": {"weight": -1, "bias": None},  # input features split: o, down; bias added once
    "embedding_rowwise": {"weight": 0},  # vocab rows split; each rank looks up its own ids
}


class LayoutError(ValueError):
    """A tensor-parallel size the model or the process count cannot take; says what to use."""


def check_tensor_parallel_size(tensor_parallel_size: int, key_value_heads: int | None,
                               processes: int | None = None, *, model: str = "the model") -> None:
    """Refuse a T that does not divide the key/value heads (transformers would fail deep in a
    reshape) or that does not divide the number of processes (each group needs T of them); None
    skips a check."""
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise LayoutError(f"tensor_parallel_size is {tensor_parallel_size!r}; expected an integer >= 1 or 'auto'")
    if key_value_heads is not None and key_value_heads % tensor_parallel_size:
        choices = ", ".join(str(t) for t in divisors(key_value_heads))
        raise LayoutError(f"tensor_parallel_size {tensor_parallel_size} does not divide the {key_value_heads} "
                          f"key/value heads of {model}: each GPU must hold whole heads; use one of {choices}.")
    if processes is not None and processes % tensor_parallel_size:
        raise LayoutError(f"{processes} GPU(s) (processes) are not a multiple of tensor_parallel_size "
                          f"{tensor_parallel_size}: every group of {tensor_parallel_size} holds one copy of the model; "
                          f"start a multiple of {tensor_parallel_size} processes or change tensor_parallel_size.")


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def sharded_parameters(config: PretrainedConfig | str, tensor_parallel_size: int) -> int:
    """Parameters the first GPU of a tensor-parallel group holds (the most: an uneven split gives
    the first ranks one row more, as torch.chunk does). Tied weights count once. The rules are the
    model's own tensor-parallel plan as transformers applies it with ``tp_plan="auto"`` (the
    config's base plan under the base model's prefix, plus the head's)."""
    config = presets.load_config(config) if isinstance(config, str) else config
    meta_model = presets.build_on_meta_device(config)
    rules = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
             for pattern, style in (meta_model._tp_plan or {}).items()]
    total = 0
    for name, parameter in meta_model.named_parameters():  # named_parameters skips tied duplicates
        module_name, _, kind = name.rpartition(".")
        style = next((style for pattern, style in rules if pattern.match(module_name)), None)
        if style is not None and style not in SHARDED_DIMENSION:
            raise LayoutError(f"{name}: tensor-parallel style {style!r} is not one the planner knows "
                              f"({', '.join(SHARDED_DIMENSION)}); plan this model with tensor_parallel_size 1.")
        dimension = SHARDED_DIMENSION.get(style, {}).get(kind)
        shape = list(parameter.shape)
        if dimension is not None and tensor_parallel_size > 1:
            shape[dimension] = math.ceil(shape[dimension] / tensor_parallel_size)
        total += math.prod(shape)
    return total


def sharded_weights_bytes(config: PretrainedConfig | str, dtype: str, tensor_parallel_size: int) -> int:
    """Weight bytes on one GPU of a tensor-parallel group (fp32, bf16, fp16)."""
    dtype = canonical_dtype(dtype)
    if dtype in QUANTIZED_DTYPES and tensor_parallel_size > 1:
        raise LayoutError(f"dtype {dtype} with tensor_parallel_size {tensor_parallel_size}: transformers shards "
                          "fp32/bf16/fp16 weights only; use bf16 with tensor parallelism, or tensor_parallel_size 1.")
    return sharded_parameters(config, tensor_parallel_size) * BITS_PER_PARAMETER[dtype] // 8


def choose_tensor_parallel_size(make: Callable[[int], Plan], key_value_heads: int,
                                gpu_count: int) -> tuple[int, str]:
    """The smallest T (a divisor of the key/value heads and of ``gpu_count``) whose plan fits a
    useful batch per GPU, data parallel over the rest, and why. ``make(T)`` plans batch 1 at T.
    When no T reaches the useful batch, the one with the largest batch; T = 1 on one GPU or none."""
    candidates = [t for t in divisors(max(gpu_count, 1)) if key_value_heads % t == 0]
    tried, best, chosen, unplanned = [], None, None, None
    for tensor_parallel_size in candidates:
        try:
            plan = make(tensor_parallel_size)
        except LayoutError as error:  # e.g. experts sharded in a style the planner does not model: no larger T
            tried.append(f"T={tensor_parallel_size}: not planned ({error})")
            unplanned = tensor_parallel_size
            break
        tried.append(f"T={tensor_parallel_size}: largest batch {plan.max_batch_size}")
        if best is None or plan.max_batch_size > best[1]:
            best = (tensor_parallel_size, plan.max_batch_size)
        if plan.max_batch_size >= USEFUL_BATCH_SIZE:
            chosen, why = tensor_parallel_size, (f"the smallest T at which the largest batch per GPU reaches "
                                                 f"{USEFUL_BATCH_SIZE}")
            break
    if chosen is None:
        chosen = best[0]
        why = (f"no T planned reaches a batch of {USEFUL_BATCH_SIZE} per GPU; T={chosen} has the largest" if best[1] > 0
               else f"no T planned fits even batch 1; T={chosen} comes closest")
        if unplanned:  # a T the planner cannot plan is not a T that does not fit
            why += f"; the planner cannot plan T >= {unplanned} for this model, where it may fit"
    data_parallel_size = max(gpu_count, 1) // chosen
    return chosen, (f"layout T={chosen} x D={data_parallel_size} (tensor_parallel_size auto): {why} "
                    f"({'; '.join(tried)}; T divides the {key_value_heads} key/value heads and "
                    f"gpu_count {max(gpu_count, 1)})")


def per_rank(count: int, tensor_parallel_size: int) -> int:
    """One GPU's share of ``count`` values split over T (the first ranks take the remainder)."""
    return math.ceil(count / tensor_parallel_size)


def measured_rank_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds: a DTensor counts its local shard (the check of
    ``sharded_weights_bytes`` against a model transformers sharded)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total
