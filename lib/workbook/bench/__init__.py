"""Benchmarks against the hardware's limits: the logic behind notebook 04 and ``workbook bench``.

    workbook bench --params cpu       # tiny model on this CPU, about a minute
    workbook bench --params h200      # 8B-shaped random bf16 model (generation), 1B-shaped (training)

Generation sweep (``generation_sweep``, which lists the strategies): the seeds' one-at-a-time
"before" and static-batch-32 "after", length-sorted static, static-compiled and continuous
batching, every strategy on the same prompts; beside them Hugging Face's
``pipeline("text-generation")`` (``hf-pipeline``), the tool users know, with the workbook's best
over it at each batch size.

Each point: one warm-up batch, then ``bench_repeats`` timed runs with the device synchronized; the
median counts and the spread (min, max) is kept. Reported per point: output tokens/s, examples/min,
time to first result, padding waste, peak memory beside the planner's prediction (CPU: "not
measured", never invented), and the fraction of the pass's roofline reached: the least time the same
tokens take with prefill at the compute peak and every decode step's bytes (weights, each row's KV
cache) at the bandwidth (``pass_cost``, counted from the model config; the datasheet's peaks from the
profile, 0 on the cpu profile: "n/a"; and this GPU's measured copy bandwidth and matmul).

Training sweep (``training.train`` on each point): micro-batch x gradient checkpointing x compile x
packing, one factor at a time around each micro-batch; tokens/s, MFU, peak memory vs prediction.
With ``bench_train_baselines: hf-trainer``, each micro-batch's plain point again under the Hugging
Face Trainer (``trainer_baseline``: same model, batches, precision and optimizer settings), and the
workbook's tokens/s and peak memory over the Trainer's.

An NVML sampler (a thread) records GPU utilization, memory used, power and SM clock during each point.
NVML's utilization is the share of time some kernel ran, not how much of the chip it used: it is
reported under that name, and efficiency is judged by the roofline fractions instead.

Where each part lives: ``settings`` (the params the benchmark reads, as one typed ``BenchSettings``),
``counting`` (bytes and FLOPs per step, rooflines, peaks, cost), ``sampler`` (NVML),
``generation_sweep``, ``hf_pipeline`` (the pipeline strategy), ``training_sweep``, ``trainer_baseline``
(the HF Trainer beside the loop), ``claims`` (the seeds' claims and the goals), ``report`` (the whole
benchmark, its tables, ``workbook bench``), ``engine_overhead`` (the engine against a bare ``generate``
loop) and ``review`` (every run side by side, notebook 05).
"""

import importlib

# What the package offers by name -> the module that defines it, imported on first use: job_keys reads
# the benchmark's keys from ``settings`` (torch-free) for ``--help``, which must not import the sweeps.
# ``generation_sweep`` and ``training_sweep`` name the modules (each holds a function of its own name).
EXPORTS = {
    "claims": ("GOALS", "claims_table", "goals_table"),
    "counting": ("BASELINE", "HF_PIPELINE", "NA", "NOT_MEASURED", "STRATEGIES", "BenchError", "PassCost", "StepCost",
                 "cost_figures", "decode_step_cost", "noise_note", "parse_int_list", "parse_strategies", "pass_cost",
                 "pass_figures", "run_dtype"),
    "generation_sweep": ("GenerationSetup", "generation_point", "generation_setup", "mixed_prompts", "planner_batch",
                         "same_greedy_tokens", "sweep_points"),
    "report": ("PARAMS_USED", "POINTS_FILE", "baseline_note", "cli_main", "failed_points", "generation_rows",
               "gpu_capacity_bytes", "hardware_text", "nvml_rows", "partial_record", "pipeline_comparison_lines",
               "run_benchmark", "training_rows"),
    "sampler": ("NvmlSampler",),
    "settings": ("BenchSettings",),
    "training_sweep": ("training_point", "training_points"),
}
_MODULE_OF = {name: module for module, names in EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    """``bench.<name>``: the name from the module that defines it, or one of the package's modules."""
    module = _MODULE_OF.get(name, name)
    try:
        found = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{module}":
            raise  # a module of the package that failed to import: its own error, not a missing name
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(found, name) if name in _MODULE_OF else found


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
