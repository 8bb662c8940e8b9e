"""What ``accelerate estimate-memory`` says for a model, set beside the planner's answer.

``accelerate estimate-memory`` is the command a user already knows for "will it fit". It asks the
Hugging Face Hub for the model's metadata before anything else, so it cannot run on a local model
directory or on a machine without the Hub; this module makes the same calls it makes after that
lookup (accelerate 1.15, ``accelerate/commands/estimate.py``), offline, so its figures are exactly the
ones the command prints (a test checks that against the command's own ``gather_data``):

- the model built by ``AutoModel.from_config`` in fp32 on the meta device: the *base* model, so an
  untied output projection (``lm_head``) is not counted;
- ``Total Size``: those parameters and buffers, scaled to the dtype (bf16 counts as its ``float16``
  row: the same 2 bytes);
- ``Training using Adam``: the largest of its four terms (model, gradients, Adam states, step), not
  their sum, at batch 1, with no activations, logits, KV cache, CUDA context or allocator slack.

The planner counts every one of those; the ratio says how far apart the two answers are.
"""

from __future__ import annotations

import statistics

import torch
from accelerate.commands.estimate import estimate_training_usage
from accelerate import init_empty_weights
from accelerate.utils import calculate_maximum_sizes
from transformers import AutoModel, PretrainedConfig

from workbook import presets
from workbook.planner.shape import canonical_dtype
from workbook.units import format_bytes

# The planner's dtype -> the row of accelerate's table with the same bytes per parameter.
ACCELERATE_DTYPE = {"fp32": "float32", "bf16": "float16", "fp16": "float16", "int8": "int8", "int4": "int4"}
# estimate-memory's divisor of the fp32 size for each row (its gather_data).
_SIZE_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}

WHAT_IT_COUNTS = {
    "generate": "its Total Size: the base model's weights (an untied lm_head left out), no KV cache, "
                "activations, logits or CUDA context",
    "train": "its Training using Adam: the largest of its terms at batch 1 (float32: its 'step', 4x the weights = "
             "weights + gradients + Adam states; float16/bf16: the fp32 Adam states alone, master weights and gradients "
             "not added), no activations, logits, CUDA context or allocator slack; a full fine-tune, whatever the LoRA rank",
}


def estimate(model: str | PretrainedConfig, dtype: str) -> dict:
    """accelerate estimate-memory's row for ``model`` (a preset, a local directory or a config) at
    ``dtype`` (the planner's names: bf16, fp16, fp32, int8, int4), in bytes."""
    config = model if isinstance(model, PretrainedConfig) else presets.load_config(model)
    row = ACCELERATE_DTYPE[canonical_dtype(dtype)]
    with init_empty_weights():
        base_model = AutoModel.from_config(config, dtype=torch.float32)
    fp32_total, largest = calculate_maximum_sizes(base_model)
    training = estimate_training_usage(fp32_total, row)
    training_bytes = max(training.values())
    return {
        "command": f"accelerate estimate-memory <model> --dtypes {row}",
        "dtype_row": row,
        "largest_layer_bytes": largest[0] // _SIZE_DIVISOR[row],
        "load_bytes": fp32_total // _SIZE_DIVISOR[row],
        # -1 is the command's "N/A" (int8/int4: it has no training figure for them).
        "training_bytes": training_bytes if training_bytes != -1 else None,
    }


def beside_plan(plan, model: str | PretrainedConfig) -> dict:
    """The command's figure for ``plan``'s mode beside the plan's peak: what it counts and the ratio."""
    figures = estimate(model, plan.dtype)
    bytes_ = figures["load_bytes"] if plan.mode == "generate" else figures["training_bytes"]
    return {**figures, "mode": plan.mode, "bytes": bytes_, "counts": WHAT_IT_COUNTS[plan.mode],
            "planner_bytes": plan.total_bytes,
            "planner_over_accelerate": plan.total_bytes / bytes_ if bytes_ else None}


def comparison_line(compared: dict) -> str:
    """One line for ``workbook plan`` and notebook 01."""
    if compared["bytes"] is None:
        return (f"accelerate estimate-memory has no training figure for {compared['dtype_row']}; "
                "the planner's is above")
    return (f"accelerate estimate-memory ({compared['dtype_row']} row): {format_bytes(compared['bytes'])}, "
            f"{compared['counts']}; this plan is {compared['planner_over_accelerate']:.2f}x that")


def against_measured(plan, model: str | PretrainedConfig, measured_bytes: int) -> dict:
    """The command's figure for ``plan`` against a measured peak (``workbook calibrate``, per case)."""
    compared = beside_plan(plan, model)
    estimated = compared["bytes"]
    return {"accelerate_estimate_memory": compared, "accelerate_estimate_bytes": estimated,
            "accelerate_relative_error": None if estimated is None else (estimated - measured_bytes) / measured_bytes}


def summarize(records: list[dict]) -> dict:
    """Its errors over measured calibration records, signed: below 0 it said less than the process held,
    the side that runs out of memory."""
    errors = [record["accelerate_relative_error"] for record in records
              if record.get("accelerate_relative_error") is not None]
    return {"what": "accelerate estimate-memory's figure for each case (generate: its Total Size; train: its "
                    "Training using Adam) against the same measured peak",
            "median_abs_relative_error": statistics.median(abs(e) for e in errors) if errors else None,
            "max_abs_relative_error": max(abs(e) for e in errors) if errors else None,
            "cases_below_measured": sum(e < 0 for e in errors), "cases": len(errors)}
