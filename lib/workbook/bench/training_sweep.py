"""The training sweep: ``training.train`` on each point, one factor at a time around each micro-batch
(checkpointing, compile, length grouping instead of packing); tokens/s, MFU, peak memory vs prediction.
With ``bench_train_baselines: hf-trainer,trl-sft`` each micro-batch's plain point is trained again by the
Hugging Face Trainer (``trainer_baseline``) and by TRL's SFTTrainer (``trl_baseline``), and the workbook's
figures are set over each."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from workbook import models, runtime, training
from workbook.bench.budget import NO_BUDGET, TimeBudget
from workbook.bench.counting import BenchError, cost_figures, parse_int_list, run_dtype
from workbook.bench.sampler import NvmlSampler
from workbook.bench.settings import BenchSettings
from workbook.hardware import Hardware
from workbook.params import AUTO
from workbook.planner import DoesNotFitError
from workbook.planner.finder import error_summary
from workbook.planner.profile import Budget
from workbook.training.config import TIMING_WARMUP_STEPS

SWEEP_RECOMPILE_LIMIT = 64


# bench_train_settings: each names one more point per micro-batch, the plain point with this change.
MEMORY_SETTINGS = {
    "loss_chunk_tokens": {"loss_chunk_tokens": 1024},
    "precision_bf16": {"precision": "bf16"},  # needs dtype bf16 (the GPU profiles')
    "offload_activations": {"offload_activations": True},
    "sdpa_block_mask": {"attn_implementation": "sdpa_block_mask"},  # packing through the 4D-mask fallback
    # The two that cost no recomputation, together: the plan's best candidate for a larger micro-batch at
    # no loss of tokens/s (Llama-3.2-1B at 2048 tokens on the h100 profile: 17 rows against the plain 6).
    "chunked_loss_bf16": {"loss_chunk_tokens": 1024, "precision": "bf16"},
}


SETTING_KEYS = ("loss_chunk_tokens", "precision", "offload_activations", "attn_implementation")
PLAIN = {"grad_checkpointing": False, "torch_compile": False, "padding": "packing"}  # each micro-batch's first point


def training_setting(point: dict, short: bool = False) -> str:
    """The memory settings a training point adds to its micro-batch, in words ('' for none); ``short``
    for a figure's axis."""
    words = [(f"loss in chunks of {point['loss_chunk_tokens']}", "chunked loss") if point.get("loss_chunk_tokens")
             else None,
             ("pure bf16 weights and states", "pure bf16") if point.get("precision") == "bf16" else None,
             ("activations offloaded to host", "offload") if point.get("offload_activations") else None,
             ("4D block mask (sdpa)", "4D mask") if point.get("attn_implementation") == "sdpa_block_mask" else None]
    return ", ".join(pair[short] for pair in words if pair)


def training_label(point: dict) -> str:
    """A training point in a few words: loop, micro-batch and every factor that differs from plain."""
    loop = point.get("loop", "workbook")
    words = [loop.split(" (")[0]] if loop != "workbook" else []  # 'HF Trainer', 'TRL SFTTrainer'
    words += [f"mb {point['micro_batch_size']}" + (" (planned)" if point.get("micro_batch_rule") else "")]
    words += [word for flag, word in ((point["grad_checkpointing"], "+ckpt"), (point["torch_compile"], "+compile"),
                                      (point["padding"] != "packing", "grouped")) if flag]
    setting = training_setting(point, short=True)
    return " ".join(words + ([f"+{setting}"] if setting else []))


def memory_setting_names(settings: BenchSettings) -> list[str]:
    """The names in ``bench_train_settings``; a BenchError naming any unknown one (checked before the
    generation sweep, not after its minutes)."""
    names = [name.strip() for name in settings.bench_train_settings.split(",") if name.strip()]
    unknown = [name for name in names if name not in MEMORY_SETTINGS]
    if unknown:
        raise BenchError(f"bench_train_settings: unknown {', '.join(unknown)}; expected some of "
                         f"{', '.join(MEMORY_SETTINGS)}")
    return names


def training_points(settings: BenchSettings, device: torch.device) -> list[dict]:
    """One factor at a time around each micro-batch: the plain point, then checkpointing, length
    grouping instead of packing, and each of ``bench_train_settings`` (a full grid would cost 8 runs
    per micro-batch); the compile points of every micro-batch come last, as each compiles for a minute
    or more on a GPU: a sweep stopped by a time budget keeps the others."""
    names = memory_setting_names(settings)
    dtype = run_dtype(settings.dtype, device)
    points = []
    for micro in parse_int_list(settings.bench_train_micro_batches, "bench_train_micro_batches", auto=AUTO):
        base = {"micro_batch_size": micro, **PLAIN}
        changes = [{}, {"grad_checkpointing": True}, {"padding": "length_grouped"}]
        for change in changes + [MEMORY_SETTINGS[name] for name in names]:
            point = {**base, **change}
            if point.get("precision") == "bf16" and dtype != "bf16":
                point["skipped"] = (f"skipped: precision bf16 needs dtype bf16, and this sweep runs "
                                    f"{dtype} (CPU: fp32)")
            elif micro == AUTO:
                point = planned_micro_batch(settings, point)
            if _settings(point) not in map(_settings, points):  # 'auto' may land on a micro-batch the list names
                points.append(point)
    compiled = [{**point, "torch_compile": True} for point in points if _is_plain(point)]
    if device.type != "cuda":
        for point in compiled:
            point["skipped"] = ("skipped on CPU: compiling takes longer than the whole CPU sweep; "
                                "measured on a GPU session")
    return points + compiled


def planned_micro_batch(settings: BenchSettings, point: dict) -> dict:
    """``point`` ('auto' micro-batch) at the planner's largest micro-batch for its own settings: each memory
    setting measured at the batch it makes fit, the question it answers. The run's own 'auto' rule
    (``training.plan_run``): a preset's synthetic rows are made to match, a dataset caps it at one step."""
    config = point_config(settings, {**point, "micro_batch_size": 1}, Path(tempfile.gettempdir()))
    # A preset trains on rows of exactly seq_len tokens; a dataset's length comes from its data.
    prepared = None if isinstance(config.max_seq_length, int) else training.prepare_data(config, log=lambda line: None)
    seq_len = prepared.max_seq_length if prepared else config.max_seq_length
    try:
        fits, why = training.largest_micro_batch(config, seq_len)
    except DoesNotFitError as error:
        return {**point, "skipped": f"skipped: not even micro-batch 1 fits the plan ({error})"}
    micro, rule = fits, f"auto: {why}"
    if prepared is not None:
        run = training.plan_run(dataclasses.replace(config, micro_batch_size=AUTO), prepared)
        micro, rule = run.micro_batch_size, run.micro_batch_rule
    # A dataset smaller than what memory holds caps it (the run's own rule): then memory did not choose it.
    return {**point, "micro_batch_size": micro, "micro_batch_rule": rule, "micro_batch_capped": micro < fits}


def point_config(settings: BenchSettings, point: dict, output_dir: Path) -> training.TrainConfig:
    """The training run of one point: the sweep's model and data, the point's settings, no warm-up
    of the learning rate, no validation split. The HF Trainer baseline trains from the same config."""
    device = runtime.default_device()
    model = settings.bench_train_model
    preset = models.is_preset(model)
    steps = settings.bench_train_steps
    hardware = settings.hardware
    return training.TrainConfig(
        model=model, data_path="", data_description="the shipped arithmetic sample" if not preset else "synthetic",
        output_dir=str(output_dir), use_chat_template=not preset,
        max_seq_length=settings.seq_len if preset else "auto", padding=point["padding"], validation_fraction=0.0,
        micro_batch_size=point["micro_batch_size"], max_steps=steps, warmup_steps=0, save_every_steps=0,
        learning_rate=settings.learning_rate,
        dtype=run_dtype(settings.dtype, device), tf32=device.type == "cuda",
        grad_checkpointing=point["grad_checkpointing"], torch_compile=point["torch_compile"],
        lora_rank=settings.lora_rank, lora_targets=settings.lora_targets, optimizer=settings.optimizer,
        # The profile's data loading, so a point's tokens/s is what the profile's training job would see.
        dataloader_workers=settings.dataloader_workers, pin_memory=settings.pin_memory,
        prefetch_factor=settings.prefetch_factor, profile=hardware.profile, peak_bf16_tflops=hardware.peak_bf16_tflops,
        peak_fp16_tflops=hardware.peak_fp16_tflops, usd_per_gpu_hour=hardware.usd_per_gpu_hour,
        budget=memory_budget(hardware),
        # The profile's attention (e.g. eager, if flex attention fails on a GPU), unless the point sets its own.
        **{"attn_implementation": settings.attn_implementation,
           **{key: point[key] for key in SETTING_KEYS if key in point}},
        synthetic_examples=max(64, point["micro_batch_size"] * steps + 8))


def memory_budget(hardware: Hardware) -> Budget:
    """The memory the planner plans a point against: one GPU of the profile (this machine's RAM on the cpu profile)."""
    return Budget(gpu_count=hardware.gpu_count, gpu_memory_gib=hardware.gpu_memory_gib,
                  cuda_overhead_gib=hardware.cuda_overhead_gib, safety_margin=hardware.safety_margin)


def training_point(settings: BenchSettings, point: dict, work_dir: Path, log: Callable[[str], None] = print) -> dict:
    result = dict(point)
    if point.get("skipped"):
        return result
    measured = _measure(settings, point, work_dir, lambda config, output_dir: training.train(config), log)
    if "out_of_memory" in measured or "skipped" in measured:
        return {**result, **measured}
    throughput, memory_figures = measured["throughput"], measured["memory"]
    tokens_per_second = throughput["tokens_per_second"]
    result.update(
        steps=measured["steps"]["reached"], timed_steps=max(0, measured["steps"]["reached"] - TIMING_WARMUP_STEPS),
        max_seq_length=measured["data"]["max_seq_length"] if "max_seq_length" in measured["data"] else None,
        tokens_per_second=tokens_per_second, achieved_tflops=throughput["achieved_tflops"],
        # Each timed step's tokens/s: a point has one run, so its steps show whether the machine was quiet.
        timed_step_tokens_per_second=[step["tokens_per_second"] for step in measured["history"][TIMING_WARMUP_STEPS:]],
        mfu=throughput["mfu"], mfu_note=throughput["mfu_note"],
        peak_memory_bytes=memory_figures["measured"].get("peak_bytes"),
        peak_memory_note=memory_figures["measured"].get("note"),
        predicted_peak_bytes=memory_figures["predicted_peak_bytes"],
        padding_fraction=measured["plan"]["padding_fraction"],
        cost=_cost_per_million_tokens(settings, tokens_per_second),
        nvml=measured["nvml"], model=measured["model_description"], final_loss=measured["loss"]["last_step"],
        step_tokens=[record["tokens"] for record in measured["history"]],
        step_loss_tokens=[record["loss_tokens"] for record in measured["history"]],
        step_losses=[record["loss"] for record in measured["history"]],
    )
    extra = "".join(f", {key} {point[key]}" for key in SETTING_KEYS if key in point)
    log(f"train micro-batch {point['micro_batch_size']}, checkpointing {point['grad_checkpointing']}, "
        f"{point['padding']}{extra}: {tokens_per_second or 0:,.0f} tokens/s")
    return result


def _measure(settings: BenchSettings, point: dict, work_dir: Path, train: Callable[[training.TrainConfig, Path], dict],
             log: Callable[[str], None]) -> dict:
    """``train(config, output_dir)`` on ``point`` in a scratch folder, NVML sampled: what it measured
    with ``nvml``, or for a point the device could not hold, ``out_of_memory``'s record (the sweep goes
    on: one that probes memory settings near the limit must not lose its other points to one)."""
    output_dir = Path(tempfile.mkdtemp(dir=work_dir, prefix="train-"))
    config = point_config(settings, point, output_dir)
    failed = None
    try:
        with NvmlSampler() as sampler:
            measured = train(config, output_dir)
    except training.TrainingDiverged as error:  # a setting that diverges is a finding, not the sweep's end
        log(f"train micro-batch {point['micro_batch_size']}: {error}")
        return {"skipped": f"stopped: training diverged ({str(error).split(':')[0]})"}
    except Exception as error:
        if not should_reduce_batch_size(error):
            raise
        failed = error_summary(error)  # the traceback, and the model its frames hold, end with this block
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    if failed:
        return out_of_memory(config, failed, log)
    return {**measured, "nvml": sampler.summary()}


def out_of_memory(config: training.TrainConfig, error: str, log: Callable[[str], None]) -> dict:
    """An out-of-memory point beside the planner's verdict (a preset's sequence length is known
    before its data is prepared; the tiny model's 'auto' one is not)."""
    clear_device_cache(garbage_collection=True)
    record = {"out_of_memory": error, "predicted_peak_bytes": None, "planner_said": "no plan"}
    if isinstance(config.max_seq_length, int):
        plan = training.memory_plan(config, int(config.micro_batch_size), config.max_seq_length)
        record.update(predicted_peak_bytes=plan.total_bytes,
                      planner_said="does not fit" if not plan.fits else "fits (the planner was wrong)")
    log(f"train micro-batch {config.micro_batch_size}: out of memory; the planner said it "
        f"{record['planner_said']}")
    return record


def baseline_point(settings: BenchSettings, workbook_point: dict, work_dir: Path, log: Callable[[str], None] = print,
                   tool: str = "hf-trainer") -> dict:
    """``tool`` (a ``bench_train_baselines`` name: the HF Trainer or TRL's SFTTrainer) on ``workbook_point``'s
    settings (a measured plain point), with the workbook's tokens/s and peak memory over the tool's
    (``trainer_baseline.versus``)."""
    # Both import for seconds (transformers' Trainer, TRL and datasets): only when asked.
    from workbook.bench import trainer_baseline, trl_baseline
    point = {key: workbook_point[key] for key in ("micro_batch_size", *PLAIN)}
    if tool == trl_baseline.NAME:
        if reason := trl_baseline.missing():
            log(f"train micro-batch {point['micro_batch_size']}, {trl_baseline.label()}: {reason}")
            return {**point, "loop": trl_baseline.label(), "skipped": reason}
        name, run, mirrored = trl_baseline.label(), trl_baseline.sft_run, trl_baseline.SETTINGS
    else:
        name, run, mirrored = trainer_baseline.LABEL, trainer_baseline.trainer_run, trainer_baseline.SETTINGS
    try:
        measured = _measure(settings, point, work_dir, lambda config, output_dir: run(config, str(output_dir)), log)
    except Exception as error:  # another library's failure is a finding of the sweep, not the end of it
        traceback.print_exc()  # into the run's log, for whoever fixes it
        reason = f"not measured: it failed with {error_summary(error)}"
        log(f"train micro-batch {point['micro_batch_size']}, {name}: {reason}")
        return {**point, "loop": name, "skipped": reason}
    if "out_of_memory" in measured:
        return {**point, "loop": name, **measured}
    result = {**point, **measured, "cost": _cost_per_million_tokens(settings, measured["tokens_per_second"])}
    result["versus"] = trainer_baseline.versus(result, workbook_point, mirrored)
    ratio = result["versus"]["tokens_per_second_ratio"]
    log(f"train micro-batch {point['micro_batch_size']}, {measured['loop']}: {measured['tokens_per_second'] or 0:,.0f} "
        f"tokens/s" + (f" (the workbook's loop: {ratio:.2f}x)" if ratio else ""))
    return result


def _settings(point: dict) -> dict:
    return {key: value for key, value in point.items() if key not in ("micro_batch_rule", "micro_batch_capped")}


def _is_plain(point: dict) -> bool:
    return all(point[key] == value for key, value in PLAIN.items()) and not any(key in point for key in SETTING_KEYS)


def _cost_per_million_tokens(settings: BenchSettings, tokens_per_second: float | None) -> dict:
    """US dollars per million training tokens at the profile's price, one GPU (None on the cpu profile)."""
    cost = cost_figures(1e6 / tokens_per_second if tokens_per_second else 0, 0, 1_000_000,
                        settings.hardware.usd_per_gpu_hour)
    cost.pop("usd_per_1000_examples", None)
    return cost


def training_sweep(settings: BenchSettings, work_dir: Path, log: Callable[[str], None] = print,
                   on_point: Callable[[dict], None] = lambda point: None, budget: TimeBudget = NO_BUDGET) -> dict:
    """Every point but the compiled ones, each plain point followed by its baselines
    (``bench_train_baselines``: the comparison with the tools users know comes before the memory
    settings), then the compiled points: each compiles for a minute or more on a GPU, so a sweep
    stopped by ``budget`` loses them first (``on_point`` gets each point as it is measured)."""
    device = runtime.default_device()
    points, baselines = [], []
    planned = training_points(settings, device)
    # One process trains every point, where a job trains one: flex attention (packing on CUDA) compiles
    # again for each new batch shape and precision, and past dynamo's limit (8) it would run unfused,
    # holding the whole score matrix, without a word. The limit is raised for the sweep's many points.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SWEEP_RECOMPILE_LIMIT)
    tools = [tool.strip() for tool in settings.bench_train_baselines.split(",") if tool.strip() not in ("", "none")]
    for point in [p for p in planned if not p["torch_compile"]]:
        measured = budget.measure(point, lambda: training_point(settings, point, work_dir, log))
        points.append(measured)
        on_point(measured)
        if not (_is_plain(measured) and "tokens_per_second" in measured):
            continue
        skeleton = {key: measured[key] for key in ("micro_batch_size", *PLAIN)}
        for tool in tools:
            baselines.append(budget.measure({**skeleton, "loop": tool},
                                            lambda: baseline_point(settings, measured, work_dir, log, tool)))
            on_point(baselines[-1])
    for point in [p for p in planned if p["torch_compile"]]:
        # Compiled as a fresh job compiles it: after an earlier point's other micro-batch, dynamo would make
        # the batch dimension dynamic and measure other (slower) kernels than a job gets.
        torch._dynamo.reset()
        points.append(budget.measure(point, lambda: training_point(settings, point, work_dir, log)))
        on_point(points[-1])
    return {"model": settings.bench_train_model, "lora_rank": settings.lora_rank, "device": str(device),
            "steps_per_point": settings.bench_train_steps,
            "repeats": 1, "what": f"tokens/s over the steps after the first {TIMING_WARMUP_STEPS} (warm-up) "
            "of each point, one run per point", "points": points, "baselines": baselines}
