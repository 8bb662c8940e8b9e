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

Where each part lives: ``counting`` (bytes and FLOPs per step, rooflines, peaks, cost), ``sampler``
(NVML), ``generation_sweep``, ``hf_pipeline`` (the pipeline strategy), ``training_sweep``,
``trainer_baseline`` (the HF Trainer beside the loop), ``claims`` (the seeds' claims and the goals),
``report`` (the whole benchmark, its tables, ``workbook bench``), ``engine_overhead`` (the engine against a bare ``generate`` loop) and
``review`` (every run side by side, notebook 05).
"""

from workbook.bench.claims import GOALS, claims_table, goals_table
from workbook.bench.counting import (
    BASELINE, HF_PIPELINE, NA, NOT_MEASURED, STRATEGIES, BenchError, PassCost, StepCost, cost_figures,
    decode_step_cost, noise_note, parse_int_list, parse_strategies, pass_cost, pass_figures, run_dtype,
)
from workbook.bench.generation_sweep import (
    GenerationSetup, generation_point, generation_setup, generation_sweep, mixed_prompts, planner_batch,
    same_greedy_tokens, sweep_points,
)
from workbook.bench.report import (
    PARAMS_USED, POINTS_FILE, baseline_note, cli_main, failed_points, generation_rows, gpu_capacity_bytes, hardware_text, nvml_rows,
    partial_record, pipeline_comparison_lines, run_benchmark, training_rows,
)
from workbook.bench.sampler import NvmlSampler
from workbook.bench.training_sweep import training_point, training_points, training_sweep

__all__ = [
    "BASELINE", "GOALS", "HF_PIPELINE", "NA", "NOT_MEASURED", "PARAMS_USED", "POINTS_FILE", "STRATEGIES", "BenchError",
    "GenerationSetup", "NvmlSampler", "PassCost", "StepCost", "baseline_note", "claims_table", "cli_main", "cost_figures",
    "decode_step_cost", "generation_point", "generation_rows", "generation_setup",
    "generation_sweep", "goals_table", "gpu_capacity_bytes", "hardware_text", "mixed_prompts", "noise_note", "nvml_rows",
    "failed_points", "parse_int_list", "parse_strategies", "partial_record", "pass_cost", "pass_figures", "pipeline_comparison_lines", "planner_batch",
    "run_benchmark", "run_dtype", "same_greedy_tokens", "sweep_points",
    "training_point", "training_points", "training_rows", "training_sweep",
]
