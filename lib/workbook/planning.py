"""From a params profile to a memory plan: the memory to plan against, and 'auto' batch sizes.

`memory.py` answers for explicit numbers; this module reads them from a profile, so the CLI,
notebook 01, the widget tuner and the generation/training notebooks size batches the same way.
"""

from __future__ import annotations

import functools

from workbook import memory, presets
from workbook.params import AUTO
from workbook.units import GiB


def capacity_bytes(params) -> int:
    """Memory of one GPU of the profile; on the cpu profile, this machine's RAM."""
    if params["gpu_count"] > 0:
        return int(params["gpu_memory_gib"] * GiB)
    import psutil  # a dependency of accelerate
    return psutil.virtual_memory().total


def compute_dtype(params) -> str:
    return params["dtype"]


def plan(params, *, mode: str | None = None, model: str | None = None, batch_size: int | None = None,
         **overrides) -> memory.Plan:
    """The memory plan for the profile's settings; keyword overrides replace profile values.

    Generation plans one replica per GPU (data parallel: every GPU holds the whole model); only
    when the model does not fit one GPU of a multi-GPU profile are its layers split over all of
    them (as `device_map="auto"` does). Training plans data-parallel replicas over the profile's GPUs;
    mixed precision (fp32 master weights under autocast) whenever the dtype is 16-bit.
    A batch of 'auto' (or None with an 'auto' profile) plans at the largest batch that fits.
    """
    settings = {**params, **overrides}
    mode = mode or settings["plan_mode"]
    config = presets.load_config(model or settings["model"])
    common = dict(gpu_memory_bytes=capacity_bytes(settings), dtype=settings["dtype"],
                  overhead_bytes=int(settings["cuda_overhead_gib"] * GiB),
                  safety_margin=settings["safety_margin"])
    if mode == "generate":
        def make(batch: int, gpus: int = 1) -> memory.Plan:
            return memory.plan_generate(config, batch_size=batch, prompt_len=settings["prompt_len"],
                                        new_tokens=settings["max_new_tokens"], gpu_count=gpus, **common)
        if settings["gpu_count"] > 1 and make(1).max_batch_size == 0:
            make = functools.partial(make, gpus=settings["gpu_count"])
        wanted = batch_size or settings["batch_size"]
    elif mode == "train":
        def make(batch: int) -> memory.Plan:
            return memory.plan_train(config, micro_batch_size=batch, seq_len=settings["seq_len"],
                                     mixed_precision=settings["dtype"] != "fp32",
                                     grad_checkpointing=settings["grad_checkpointing"],
                                     lora_rank=settings["lora_rank"],
                                     optimizer=settings.get("optimizer", "adamw"),
                                     sharding=settings.get("sharding", "none"),
                                     gpu_count=max(settings["gpu_count"], 1), **common)
        wanted = batch_size or settings["micro_batch_size"]
    else:
        raise ValueError(f"mode {mode!r}: expected 'generate' or 'train'")
    if wanted == AUTO:
        largest = make(1).max_batch_size
        return make(max(largest, 1))
    return make(int(wanted))


def resolve_batch_size(params, mode: str, **overrides) -> int:
    """The batch to run with: the profile's number, or for 'auto' the planner's largest that fits.

    Raises memory.DoesNotFitError (with what to change) when not even batch 1 fits.
    """
    key = "batch_size" if mode == "generate" else "micro_batch_size"
    value = overrides.pop(key, params[key])
    if value != AUTO:
        return int(value)
    return plan(params, mode=mode, batch_size=1, **overrides).require_fit().max_batch_size


def max_batch_table(profiles: dict, models: list[str], mode: str, **overrides) -> list[dict]:
    """Largest batch per GPU profile x model, computed (the seeds' per-GPU tables, but planned).

    Each GPU profile's own dtype is used (fp16 on a V100); `overrides` (e.g. seq_len) apply to all.
    """
    rows = []
    for model in models:
        row = {"model": model}
        for name, params in profiles.items():
            if params["gpu_count"] == 0:
                continue
            result = plan(params, mode=mode, model=model, batch_size=1, **overrides)
            row[name] = result.max_batch_size
        rows.append(row)
    return rows
