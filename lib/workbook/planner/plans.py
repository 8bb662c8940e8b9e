"""What a plan is made of (``Term``, ``Plan``), the budget it must fit, and the search for the
largest batch that fits; shared by the generation and training plans.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from workbook.planner.shape import QUANTIZED_DTYPES, require_non_negative
from workbook.units import GiB, MiB, format_bytes

# The CUDA 12 context (lazy module loading) plus cuBLAS/cuDNN workspaces, what nvidia-smi shows for
# a process that has initialised torch and run a matmul: usually a few hundred MiB up to ~600.
DEFAULT_OVERHEAD_BYTES = 512 * MiB
# PyTorch's caching allocator rounds blocks up and cannot always reuse freed ones; reserved minus
# allocated bytes in a steady loop is often a few percent of the allocated bytes.
DEFAULT_FRAGMENTATION_FRACTION = 0.05
DEFAULT_SAFETY_MARGIN = 0.05  # keep 5% of the GPU free for whatever the plan does not model
MAX_BATCH_SEARCH_LIMIT = 2**20  # max_batch_size never reports more than this


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
    tensor_parallel_size: int = 1  # GPUs one copy of the model is sharded over (generate)
    data_parallel_size: int = 1  # copies of the model, each with its own batch (generate)
    # What crosses the network over several nodes (planner.network); empty when not asked.
    network: dict = field(default_factory=dict)
    in_ram: bool = False  # planned against this machine's RAM (a profile with no GPU), not one GPU

    @property
    def per_device(self) -> str:
        """How the plan's figures are meant: per GPU, or of the RAM on the cpu profile."""
        return "of this machine's RAM" if self.in_ram else "per GPU"

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
                f"batch {self.batch_size} needs {need:.1f} GiB {self.per_device} but {have:.1f} GiB is "
                f"available; the largest batch that fits is {self.max_batch_size}."
            )
        changes = _changes_that_save_memory(self)
        needs = f"batch {self.batch_size} needs {need:.1f} GiB {self.per_device}"
        return (
            f"does not fit even at batch 1: {needs} and " if self.batch_size == 1 else
            f"does not fit, not even at batch 1 ({needs}): "
        ) + (
            f"{have:.1f} GiB is available "
            f"({self.capacity_bytes / GiB:.1f} GiB minus a {self.safety_margin:.0%} margin). "
            f"Try: {'; '.join(changes)}."
        )

    def require_fit(self) -> Plan:
        """This plan, or DoesNotFitError with the advice when it does not fit."""
        if not self.fits:
            raise DoesNotFitError(self.advice(), self)
        return self

    def to_dict(self) -> dict:
        """A JSON-ready record; ``breakdown`` lists the terms in order."""
        record = asdict(self)
        record["breakdown"] = record.pop("terms")
        record["budget_bytes"] = self.budget_bytes
        return record


class DoesNotFitError(RuntimeError):
    """The plan exceeds the GPU's memory; the message says what to change, ``plan`` is the plan."""

    def __init__(self, message: str, plan: Plan | None = None):
        super().__init__(message)
        self.plan = plan


def budget_bytes(capacity_bytes: int, safety_margin: float) -> int:
    """The bytes a plan may use: ``capacity_bytes * (1 - safety_margin)``, rounded down."""
    return math.floor(capacity_bytes * (1 - safety_margin))



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


def make_plan(
    *, mode, shape, dtype, batch_size, lengths, settings, terms_for, weights, trainable,
    kv_per_token, gpu_memory_bytes, gpu_count, safety_margin, notes, tensor_parallel_size=1, data_parallel_size=1,
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
        tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
    )


def overhead_terms(
    terms: list[Term], overhead_bytes: int, fragmentation_fraction: float
) -> list[Term]:
    tensors = sum(term.bytes for term in terms)
    return [
        Term("cuda_context", overhead_bytes,
             f"CUDA context, kernels and library workspaces: {overhead_bytes / MiB:,.0f} MiB "
             "(profile constant; prior until calibrated)" if overhead_bytes else
             "none (the profile's cuda_overhead_gib is 0: no GPU, as on the cpu profile)"),
        Term("allocator_fragmentation", math.ceil(tensors * fragmentation_fraction),
             f"{fragmentation_fraction:.0%} of the {format_bytes(tensors)} of tensors "
             "(caching allocator rounding and unreusable blocks; prior until calibrated)"),
    ]


def _changes_that_save_memory(plan: Plan) -> list[str]:
    """Suggestions for a plan that does not fit at batch 1, the ones not already in use."""
    settings, changes = plan.settings, []
    if plan.mode == "generate":
        # int8/int4 weights need bitsandbytes on CUDA: on CPU only bf16 halves fp32.
        if plan.dtype == "fp32":
            changes.append("bf16 weights (dtype bf16)" if plan.in_ram else "a smaller weight dtype (bf16, int8 or int4)")
        elif plan.dtype in ("bf16", "fp16") and not plan.in_ram:
            changes.append("quantized weights (dtype int8 or int4)")
        changes.append("shorter prompt_len or new_tokens (the KV cache grows with both)")
        if plan.in_ram:
            return changes
        changes.append("tensor parallelism over more GPUs (tensor_parallel_size, or 'auto' on a multi-GPU "
                       "profile): each GPU then holds 1/T of the weights and KV cache")
        return changes
    if settings["lora_rank"] == 0:
        changes.append("LoRA (lora_rank=16) to train adapters only")
    elif plan.dtype not in QUANTIZED_DTYPES and not plan.in_ram:
        changes.append("a quantized frozen base (dtype int4: QLoRA)")
    if not settings["grad_checkpointing"]:
        changes.append("grad_checkpointing=True")
    if plan.in_ram:  # 8-bit Adam (bitsandbytes) and FSDP need GPUs
        changes.append("a shorter seq_len")
        return changes
    if settings["optimizer"] == "adamw":
        changes.append("optimizer 'adamw-8bit'")
    if settings["sharding"] == "none":
        changes.append("sharding 'fsdp' over several GPUs")
    else:
        changes.append(f"more GPUs than {plan.gpu_count} for FSDP to shard over")
    changes.append("a shorter seq_len")
    return changes



def check_overheads(
    overhead_bytes: int, fragmentation_fraction: float, safety_margin: float
) -> None:
    require_non_negative(overhead_bytes=overhead_bytes)
    if not 0 <= fragmentation_fraction < 1:
        raise ValueError(
            f"fragmentation_fraction must be in [0, 1), got {fragmentation_fraction!r}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
