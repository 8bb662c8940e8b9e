"""What a run measured, as one JSON-ready result and a few lines a person reads.

- tokens/s: non-padding input tokens of all processes per second of training steps (data loading
  included, evaluation excluded), after the first TIMING_WARMUP_STEPS steps (compilation and
  allocator warm-up), as nanoGPT's bench.py does; the overall figure is reported beside it.
- MFU, torchtitan's convention: per example of n tokens, 6 x N x n + 12 x layers x heads x head_dim
  x n^2 FLOPs (the second term is attention; N counts every matmul weight: all parameters except
  the input embedding table, whose lookup costs nothing, but with the output projection even when
  tied to it, because its matmul runs), against the profile's dense peak x processes. LoRA: 4 x N
  (no weight gradients for the frozen base). Recomputation by gradient checkpointing is not model
  work and is not counted. On CPU, or without a peak for the dtype, MFU is "n/a", never invented.
- peak memory: torch.cuda's reserved peak plus the memory outside PyTorch's allocator (CUDA context,
  NCCL, workspaces), beside the planner's prediction for the same settings. On CPU torch keeps no
  peak of tensor memory (and the process's resident memory also holds Python and its libraries): not measured.
"""

from __future__ import annotations

import math
import statistics

import torch

from workbook import gpu, runtime
from workbook.units import format_bytes
from workbook.training.checkpoints import latest_checkpoint
from workbook.training.config import MAX_GRAD_NORM, TIMING_WARMUP_STEPS, accelerate_mixed_precision
from workbook.training.chunked_loss import loss_description
from workbook.training.run_plan import MIN_LR_FRACTION, memory_plan


def measured_peak_memory(device, accelerator) -> dict:
    """The peak over every process since the loop started (``runtime.peak_memory``), and rank 0's."""
    measured = runtime.peak_memory(device)
    if measured is None:
        return {"peak_bytes": None, "note": runtime.NOT_MEASURED_ON_CPU}
    local = torch.tensor([measured.total_bytes, measured.allocated_bytes], device=device, dtype=torch.float64)
    peak, allocated = local.tolist()
    gathered = accelerator.reduce(local, "max").tolist()
    return {"peak_bytes": int(gathered[0]), "peak_allocated_bytes": int(gathered[1]),
            "rank0_peak_bytes": int(peak), "rank0_peak_allocated_bytes": int(allocated),
            "note": "max over processes of torch.cuda.max_memory_reserved + memory outside PyTorch's allocator"}


def throughput(steps: list[dict], config, processes: int, on_gpu: bool) -> dict:
    """Tokens/s and MFU of these steps (records with ``tokens``, ``seconds`` and ``flops``), the
    first TIMING_WARMUP_STEPS left out of the steady-state figures; any loop's steps are counted so."""
    warm = steps[TIMING_WARMUP_STEPS:] if len(steps) > TIMING_WARMUP_STEPS else steps
    seconds = sum(r["seconds"] for r in warm)
    tokens_per_second = sum(r["tokens"] for r in warm) / seconds if seconds else None
    all_seconds = sum(r["seconds"] for r in steps)
    overall = sum(r["tokens"] for r in steps) / all_seconds if all_seconds else None
    achieved_tflops = sum(r["flops"] for r in warm) / seconds / 1e12 if seconds else None
    rates = [r["tokens"] / r["seconds"] for r in warm if r["seconds"]]
    median_step = statistics.median(rates) if rates else None
    peak = gpu.dense_peak_tflops(config, config.dtype)
    if not on_gpu:
        mfu, mfu_note = None, "n/a: CPU run (no GPU peak to measure against)"
    elif not peak:
        mfu, mfu_note = None, f"n/a: profile {config.profile} has no dense {config.dtype} peak (fp32 runs have none)"
    else:
        mfu = gpu.mfu(sum(r["flops"] for r in warm), seconds, peak, processes)
        mfu_note = f"against {peak:g} dense {config.dtype} TFLOP/s x {processes} GPU(s) (profile {config.profile})"
    return {
        "tokens_per_second": tokens_per_second, "tokens_per_second_overall": overall,
        "tokens_per_second_per_process": tokens_per_second / processes if tokens_per_second else None,
        "what": "non-padding tokens of all processes per second of training steps, " + (
            f"first {TIMING_WARMUP_STEPS} step(s) of this invocation left out of the steady-state figure"
            if len(steps) > TIMING_WARMUP_STEPS else
            f"all {len(steps)} step(s) counted, the first (compilation, allocator warm-up) among them: too few "
            f"steps to leave out the first {TIMING_WARMUP_STEPS}, so not a steady state"),
        "tokens_per_second_median_step": median_step, "stalls": stall_note(warm, median_step),
        "achieved_tflops": achieved_tflops, "mfu": mfu, "mfu_note": mfu_note,
        "flops_convention": "torchtitan: 6 x matmul params x n + 12 x layers x heads x head_dim x n^2 per example "
                            "of n tokens (LoRA: 4 x params); recomputation not counted",
    }


STALL_FACTOR = 3  # a step this many times slower per token than the median step stalled


def stall_note(steps: list[dict], median_rate: float | None) -> str:
    """'' or what stalled steps did to the steady-state figure: a few steps of a short run (a busy
    machine, a garbage collection) can hold most of its seconds, and the sum's rate with them."""
    stalled = [r for r in steps if median_rate and r["seconds"] and r["tokens"] / r["seconds"] * STALL_FACTOR < median_rate]
    if not stalled:
        return ""
    share = sum(r["seconds"] for r in stalled) / sum(r["seconds"] for r in steps)
    which = ", ".join(f"step {r.get('step', '?')} ({r['seconds']:.2f} s)" for r in stalled[:3])
    return (f"{len(stalled)} step(s) ran under 1/{STALL_FACTOR} of the median step's rate ({which}; a busy machine?), "
            f"{share:.0%} of the steady-state seconds: the median step ran at {median_rate:,.0f} tokens/s")


def result(config, prepared, run, accelerator, history, eval_history, start_step, step, finished,
           model_description, total_parameters, trainable_parameters, optimizer_description, tf32_applied,
           memory_measured, accuracy_before, accuracy_after, wall_seconds, final_dir, fsdp) -> dict:
    """Everything a run measured and how, JSON-ready (``training_result.json``, notebook 03's metrics)."""
    processes = accelerator.num_processes
    on_gpu = accelerator.device.type == "cuda"
    this_run = history[start_step:] if len(history) > start_step else []
    all_seconds = sum(r["seconds"] for r in this_run)
    try:
        predicted = memory_plan(config, run.micro_batch_size, prepared.max_seq_length,
                                sharding="fsdp" if fsdp else "none").total_bytes
    except ValueError as error:  # e.g. a model the planner does not support
        predicted = None
        memory_measured["prediction_error"] = str(error)
    gpus = processes if on_gpu else 0
    gpu_hours = wall_seconds * gpus / 3600
    # The same examples come back every epoch, so per-epoch means compare like with like; one step's
    # loss mostly says which examples it drew.
    epoch_losses = [[r["loss"] for r in history[e * run.steps_per_epoch:(e + 1) * run.steps_per_epoch]]
                    for e in range(math.ceil(len(history) / run.steps_per_epoch))]
    eval_before = next((e["eval_loss"] for e in eval_history if e["step"] == 0), None)
    return {
        "status": "finished" if finished else f"stopped at step {step} of {run.total_steps} (stop_after_steps)",
        "model": config.model, "model_description": model_description,
        "parameters": total_parameters, "trainable_parameters": trainable_parameters,
        "data": prepared.summary(),
        "plan": run.to_dict(),
        "settings": {
            "dtype": config.dtype,
            # 'mixed' is autocast over fp32 weights: accelerate's mixed_precision says whether it applied (fp32: no).
            "precision": {"requested": config.precision, "applied": "fp32 (no autocast: dtype fp32)"
                          if config.dtype == "fp32" else config.precision},
            "mixed_precision": accelerate_mixed_precision(config),
            "offload_activations": {"requested": config.offload_activations,
                                    "applied": config.offload_activations and on_gpu},
            "tf32": {"requested": config.tf32, "applied": tf32_applied},
            "grad_checkpointing": config.grad_checkpointing, "torch_compile": config.torch_compile,
            "attn_implementation": config.attn_implementation, "padding": config.padding,
            "report_to": config.report_to,
            "loss": loss_description(config.loss_chunk_tokens, "cuda" if on_gpu else "cpu"),
            "dataloader_workers": config.dataloader_workers,
            "pin_memory": {"requested": config.pin_memory, "applied": config.pin_memory and on_gpu},
            "prefetch_factor": {"requested": config.prefetch_factor,
                                "applied": config.prefetch_factor if config.dataloader_workers else "none (no workers)"},
            "micro_batch_size": run.micro_batch_size, "gradient_accumulation_steps": run.gradient_accumulation_steps,
            "processes": processes, "distributed_type": accelerator.distributed_type.value,
            "optimizer": optimizer_description, "weight_decay": config.weight_decay,
            "learning_rate": run.learning_rate, "learning_rate_rule": run.learning_rate_rule,
            "warmup_steps": config.warmup_steps, "lora_rank": config.lora_rank, "max_grad_norm": MAX_GRAD_NORM,
            "schedule": f"linear warmup, cosine to {MIN_LR_FRACTION:g} x peak", "seed": config.seed,
        },
        "steps": {"total": run.total_steps, "resumed_from": start_step, "reached": step},
        "loss": {"first_step": history[0]["loss"] if history else None,
                 "last_step": history[-1]["loss"] if history else None,
                 "epoch_means": [sum(losses) / len(losses) for losses in epoch_losses],
                 "eval_before": eval_before, "eval_after": eval_history[-1]["eval_loss"] if eval_history else None},
        "accuracy": {"before": accuracy_before, "after": accuracy_after,
                     "note": f"greedy answers to {accuracy_after['of']} scored against the arithmetic task's true answers"
                     if accuracy_after else "n/a: the validation inputs are not the arithmetic task's questions"
                     + (" (or FSDP: generation skipped)" if fsdp else "")},
        "throughput": throughput(this_run, config, processes, on_gpu),
        "memory": {"measured": memory_measured, "predicted_peak_bytes": predicted,
                   "prediction": f"planner at micro-batch {run.micro_batch_size}, {prepared.max_seq_length} tokens"},
        "time": {"wall_seconds": wall_seconds, "training_seconds": all_seconds, "gpus": gpus,
                 "gpu_hours": gpu_hours, "usd_per_gpu_hour": config.usd_per_gpu_hour,
                 "cost_usd": gpu_hours * config.usd_per_gpu_hour},
        "history": history, "eval_history": eval_history,
        "output": {"output_dir": config.output_dir, "final_model_dir": final_dir,
                   "checkpoint": str(latest_checkpoint(config.output_dir) or "") or None},
        "versions": gpu.software_versions(),
    }


def summary_lines(result: dict) -> list[str]:
    """A few lines a person reads after a run (CLI and notebook)."""
    throughput, loss, time_ = result["throughput"], result["loss"], result["time"]
    tokens = throughput["tokens_per_second"]
    lines = [f"{result['status']}: {result['steps']['reached']} of {result['steps']['total']} steps, "
             f"{result['model_description']}",
             "training loss by epoch (mean per response token): "
             + " -> ".join(f"{value:.4f}" for value in loss["epoch_means"]) if loss["epoch_means"] else "no step ran",
             f"tokens/s {tokens:,.0f} (non-padding, steady state); MFU "
             + (f"{throughput['mfu']:.1%}" if throughput["mfu"] is not None else throughput["mfu_note"])
             + (f"; {throughput['stalls']}" if throughput.get("stalls") else "")
             if tokens else "tokens/s: not measured",
             f"wall {time_['wall_seconds']:.1f} s, cost {cost_text(time_)}"]
    if loss["eval_before"] is not None:
        lines.append(f"validation loss {loss['eval_before']:.4f} -> {loss['eval_after']:.4f}")
    accuracy = result["accuracy"]
    if accuracy["after"]:
        lines.append(f"arithmetic accuracy on {accuracy['after']['records']} {accuracy['after']['of']}: "
                     f"{accuracy['before']['accuracy']:.1%} before -> {accuracy['after']['accuracy']:.1%} after"
                     if accuracy["before"] else f"accuracy after: {accuracy['after']['accuracy']:.1%}")
    if result["output"]["final_model_dir"]:
        lines.append(f"final model: {result['output']['final_model_dir']}")
    return lines


def cost_text(time_: dict) -> str:
    """The run's cost at the profile's price, or n/a where there is no GPU or no price (not $0.00)."""
    if not time_["gpus"] or not time_["usd_per_gpu_hour"]:
        return "n/a: " + ("a CPU run (no GPU-hours)" if not time_["gpus"] else "the profile has no price per GPU-hour")
    return f"${time_['cost_usd']:.2f} ({time_['gpus']} GPU(s) x ${time_['usd_per_gpu_hour']:g}/GPU-hour)"


def measurement_rows(result: dict) -> list[dict]:
    """Notebook 03's table: throughput (steady state, every step, the median step), MFU, peak memory
    measured beside the plan, time and cost."""
    throughput, memory, time_ = result["throughput"], result["memory"], result["time"]
    measured_peak = memory["measured"].get("peak_bytes")
    per = "per GPU" if time_["gpus"] else "(CPU RAM)"

    def rate(key: str) -> str:
        return f"{throughput[key]:,.0f}" if throughput.get(key) else "n/a"
    rows = (
        ("tokens/s (steady state)", rate("tokens_per_second")),
        ("tokens/s (every step)", rate("tokens_per_second_overall")),
        ("tokens/s (the median step)", rate("tokens_per_second_median_step")
         + (f"; {throughput['stalls']}" if throughput.get("stalls") else "")),
        ("achieved TFLOP/s", f"{throughput['achieved_tflops']:.4g}" if throughput["achieved_tflops"] else "n/a"),
        ("MFU", f"{throughput['mfu']:.1%}" if throughput["mfu"] is not None else throughput["mfu_note"]),
        (f"peak memory {per} (measured)", format_bytes(measured_peak) if measured_peak else memory["measured"]["note"]),
        (f"peak memory {per} (planner)",
         format_bytes(memory["predicted_peak_bytes"]) if memory["predicted_peak_bytes"] else "n/a"),
        ("wall time", f"{time_['wall_seconds']:.1f} s ({time_['training_seconds']:.1f} s in training steps)"),
        ("cost", cost_text(time_)),
    )
    return [{"measurement": key, "value": value} for key, value in rows]


def settings_rows(result: dict) -> list[dict]:
    """The settings the run used; a setting the machine decides shows what was requested and applied."""
    def text(value) -> str:
        if isinstance(value, dict):  # {"requested": ..., "applied": ...}
            return ", ".join(f"{key} {item}" for key, item in value.items())
        return str(value)
    return [{"setting": key, "value": text(value)} for key, value in result["settings"].items()]


def before_after_rows(result: dict) -> list[dict]:
    """Notebook 03's comparison: the training loss's first epoch against its last (both measured while
    training), the validation loss and the arithmetic accuracy before training and after it."""
    accuracy, loss = result["accuracy"], result["loss"]

    def figure(value, pattern: str = "{:.4f}") -> str:
        return "n/a" if value is None else pattern.format(value)
    means = loss["epoch_means"]
    rows = [{"measure": "training loss, mean over an epoch (measured while training, same examples): the first epoch "
                        "-> the last", "start": figure(means[0] if means else None),
             "end": figure(means[-1] if means else None)},
            {"measure": "validation loss, before training -> after", "start": figure(loss["eval_before"]),
             "end": figure(loss["eval_after"])}]
    if accuracy["after"]:
        rows.append({"measure": f"arithmetic accuracy ({accuracy['after']['records']} {accuracy['after']['of']}, "
                                "greedy), before training -> after",
                     "start": figure(accuracy["before"] and accuracy["before"]["accuracy"], "{:.1%}"),
                     "end": figure(accuracy["after"]["accuracy"], "{:.1%}")})
    return rows
