"""When a training setting does not fit: the single changes that would make it fit, each planned,
cheapest in throughput first (``workbook plan``, notebook 01, the widget tuner)::

    for option in ways_to_fit(params, batch_size=16, seq_len=2048):
        print(option["change"], option["fits"], option["peak_bytes"], option["throughput_cost"])

The order is by the extra work each change costs per token, from the formulas (logits recomputed,
one more forward when checkpointing), then by what it gives up that is not speed (precision,
method, more GPUs). The costs are estimates from FLOPs, not measurements.
"""

from __future__ import annotations

from workbook import presets
from workbook.planner.plans import DoesNotFitError, Plan
from workbook.planner.profile import Budget, PlanSettings, plan
from workbook.planner.shape import model_shape
from workbook.units import format_bytes

LOSS_CHUNK_TOKENS = 1024  # the chunk the suggestion plans with (torchtune uses 8 chunks of the sequence)
LORA_RANK = 16
FSDP_GPUS = (2, 4, 8)  # GPU counts of the profile's kind the FSDP suggestion tries, fewest first


def ways_to_fit(params, *, batch_size: int | None = None, **overrides) -> list[dict]:
    """Single changes to the profile's training settings (plus ``overrides``), in the order to try
    them; each with its plan at ``batch_size`` (the profile's micro-batch by default): whether it
    fits, its predicted peak and the largest micro-batch it allows. Changes already in effect are
    left out."""
    profile = {**params, **overrides}
    settings, gpu_count = PlanSettings.from_params(profile), Budget.from_params(profile).gpu_count
    wanted = batch_size or settings.micro_batch_size
    batch = 1 if wanted == "auto" else int(wanted)  # 'auto' that fits nothing: what would fit batch 1
    current = plan(params, mode="train", batch_size=batch, **overrides)
    flops_share = _output_projection_share(settings.model)
    candidates, on_gpu = [], gpu_count > 0  # 8-bit Adam, offloading and FSDP need GPUs
    if settings.dtype == "bf16" and settings.precision == "mixed" and not settings.lora_rank:
        candidates.append(("precision bf16", {"precision": "bf16"},
                           "none in FLOPs; pure bf16 AdamW can round small updates away"))
    if settings.optimizer == "adamw" and on_gpu:
        candidates.append(("optimizer adamw-8bit", {"optimizer": "adamw-8bit"},
                           "optimizer step only; needs bitsandbytes (CUDA)"))
    if not settings.loss_chunk_tokens:
        candidates.append((f"loss_chunk_tokens {LOSS_CHUNK_TOKENS}", {"loss_chunk_tokens": LOSS_CHUNK_TOKENS},
                           f"+{flops_share:.0%} FLOPs where every token carries loss (the output projection "
                           "runs again in backward); fewer where prompts carry none (their logits are skipped)"))
    if current.max_batch_size and current.max_batch_size < batch:
        candidates.append((f"micro_batch_size {current.max_batch_size}", {"batch_size": current.max_batch_size},
                           "same FLOPs per token, smaller matmuls; raise gradient_accumulation_steps to keep "
                           "the effective batch"))
    if not settings.grad_checkpointing:
        candidates.append(("grad_checkpointing true", {"grad_checkpointing": True},
                           "+~33% FLOPs (each layer's forward runs again in backward)"))
    if not settings.offload_activations and on_gpu:
        candidates.append(("offload_activations true", {"offload_activations": True},
                           "every step waits on PCIe copies of the activations (not overlapped here)"))
    if not settings.lora_rank:
        candidates.append((f"lora_rank {LORA_RANK}", {"lora_rank": LORA_RANK},
                           "fewer FLOPs, but trains adapters instead of every weight"))
    if settings.sharding == "none" and on_gpu:
        for gpus in FSDP_GPUS:
            if gpus > max(gpu_count, 1):
                candidates.append((f"FSDP over {gpus} GPUs", {"sharding": "fsdp", "gpu_count": gpus},
                                   f"needs {gpus} GPUs of this kind; all-gathers every layer each step"))
                break
    options = []
    for change, values, cost in candidates:
        values = dict(values)
        option_batch = values.pop("batch_size", batch)
        changed = plan(params, mode="train", batch_size=option_batch, **{**overrides, **values})
        options.append(_option(change, cost, changed))
    return options


def ways_to_fit_lines(options: list[dict]) -> list[str]:
    """The options as lines for the CLI and the notebook."""
    lines = ["changes that would make it fit, one at a time, cheapest in throughput first:" if
             any(option["fits"] for option in options) else
             "single changes, cheapest in throughput first (none fits alone: combine them, or use more memory):"]
    for option in options:
        verdict = "fits" if option["fits"] else "does not fit"
        lines.append(f"  {option['change']:<28} {verdict:<13} peak {format_bytes(option['peak_bytes']):>10}, "
                     f"largest micro-batch {option['max_batch_size']}; cost: {option['throughput_cost']}")
    return lines


def lines_for_unfit_run(params, error: DoesNotFitError) -> list[str]:
    """For a training run that does not fit even at micro-batch 1: the single changes that would make
    it fit, each with its predicted peak, planned at the run's own sequence length ([] otherwise)."""
    planned = error.plan
    if planned is None or planned.mode != "train" or planned.max_batch_size:
        return []
    options = ways_to_fit(params, batch_size=1, seq_len=planned.lengths["seq_len"])
    return ways_to_fit_lines(options) if options else []


def _option(change: str, cost: str, changed: Plan) -> dict:
    return {"change": change, "fits": changed.fits, "peak_bytes": changed.total_bytes,
            "max_batch_size": changed.max_batch_size, "throughput_cost": cost}


def _output_projection_share(model: str) -> float:
    """The output projection's forward (2 x vocab x hidden FLOPs per token) against a full
    fine-tune step's 6 x parameters per token: what recomputing it in backward adds."""
    shape = model_shape(presets.load_config(model))
    head = sum(layer.parameters for layer in shape.linear_layers if layer.is_output_embedding)
    return 2 * head / (6 * shape.parameters)
