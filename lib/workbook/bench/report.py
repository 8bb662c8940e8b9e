"""The whole benchmark (notebook 04, ``workbook bench``): both sweeps, the claims and the goals, with
the params, versions and hardware, as one JSON-ready report; its tables for the notebook and the CLI.

    workbook bench --params cpu       # tiny model on this CPU, about a minute
    workbook bench --params h200      # 8B-shaped random bf16 model (generation), 1B-shaped (training)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from workbook import gpu, job_keys, notebook, params as params_module, runner, runtime
from workbook.bench import published
from workbook.bench.budget import NO_BUDGET, TimeBudget
from workbook.bench.claims import claims_table, goals_table, tf32_matmul_speedup
from workbook.bench.counting import HF_PIPELINE, NA, NOT_MEASURED, BenchError, noise_note, run_dtype
from workbook.bench.generation_sweep import generation_sweep
from workbook.bench.settings import BenchSettings
from workbook.bench.training_sweep import (
    memory_budget, memory_setting_names, training_label, training_setting, training_sweep,
)
from workbook.generation import GenerationError
from workbook.jsonl import DataError
from workbook.planner import DoesNotFitError
from workbook.units import GiB, format_bytes
from workbook import presets, tiny_model
from workbook.planner import weights_bytes

PARAMS_USED = job_keys.BENCH


def run_benchmark(settings: BenchSettings, work_dir: Path, log: Callable[[str], None] = print,
                  on_point: Callable[[str, dict], None] = lambda sweep, point: None,
                  budget: TimeBudget = NO_BUDGET) -> dict:
    """Both sweeps, the claims and the context (settings, versions, hardware), as one JSON-ready dict.
    ``settings``: ``BenchSettings.from_params`` of the run's params, built once at its entry (the command,
    notebook 04). ``on_point(sweep, point)`` gets each point ("generation" or "training") as soon as it is
    measured; the points ``budget`` leaves no time for are marked so, and the report is written all the same."""
    check_names(settings)
    device = runtime.default_device()
    settings = without_absent_peaks(settings, device, log)
    refuse_models_over_ram(settings, device)
    began, load_before, started_at = time.perf_counter(), os.getloadavg(), runner.now()
    generation = generation_sweep(settings, log, on_point=lambda point: on_point("generation", point), budget=budget)
    runtime.reset_peak_memory(device)  # the generation model is gone: training measures its own memory only
    training = (training_sweep(settings, Path(work_dir), log, on_point=lambda point: on_point("training", point),
                               budget=budget)
                if settings.bench_train_steps else None)
    matmul = tf32_matmul_speedup(device)
    dtype = run_dtype(settings.dtype, device)
    hardware = settings.hardware
    return {
        "what": "generation and training sweeps against the profile's bandwidth and compute peaks",
        "profile": hardware.profile,
        # When and from what code: a reference folder keeps this file without a run's manifest.
        "started_at": started_at, "git": runner.git_state(),
        "params": settings.as_params(),
        "peaks": {"memory_bandwidth_gbs": hardware.memory_bandwidth_gbs,
                  "dense_tflops": gpu.dense_peak_tflops(hardware, dtype),
                  "dtype": dtype, "usd_per_gpu_hour": hardware.usd_per_gpu_hour,
                  "note": "from the profile; 0 means none to measure against (n/a)"},
        "versions": gpu.software_versions(),
        "hardware": gpu.detect(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        # Other processes share the host's cores: how busy it was says how far to trust the timings.
        "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "generation": generation,
        "training": training,
        "matmul": matmul,
        "claims": claims_table(generation, training, matmul, device.type == "cuda"),
        "goals": goals_table(generation, training),
        "seconds": time.perf_counter() - began,
    }


def check_names(settings: BenchSettings) -> None:
    """The sweeps' models and memory settings exist: a BenchError naming the key now, not a traceback
    after minutes of measuring."""
    memory_setting_names(settings)
    for key in ("bench_generate_model", "bench_train_model"):
        name = getattr(settings, key)
        if name != tiny_model.TINY_MODEL_NAME and not Path(name).expanduser().is_dir():
            try:
                presets.load_config(name)
            except ValueError as error:
                raise BenchError(f"{key}: {error}") from None


# A GPU profile's figures that would judge a run on another device (0: none to measure against).
GPU_FIGURES = ("memory_bandwidth_gbs", "peak_bf16_tflops", "peak_fp16_tflops", "usd_per_gpu_hour")


def without_absent_peaks(settings: BenchSettings, device: torch.device, log: Callable[[str], None]) -> BenchSettings:
    """``settings``, or on a machine without the profile's GPU, with its peaks and price set to 0: a CPU run
    of the h100 profile must not read as 0.1% of an H100's bandwidth or cost H100 dollars."""
    if device.type == "cuda" or settings.hardware.gpu_count == 0:
        return settings
    log(f"warning: profile {settings.hardware.profile} describes a GPU and this run is on {device}: its bandwidth, "
        "compute peaks and price are not applied (n/a); its memory plans still are")
    return settings.replace(**{key: 0.0 for key in GPU_FIGURES})


def refuse_models_over_ram(settings: BenchSettings, device: torch.device) -> None:
    """On a CPU the sweeps run fp32: a GPU profile's 8B there would fill the RAM, and past it the kernel
    kills the process without a word. BenchError first, naming the model, when its fp32 weights (for
    the training sweep: weights, gradients and AdamW states, 16 B per parameter) exceed the RAM free."""
    if device.type != "cpu":
        return
    import psutil
    available = psutil.virtual_memory().available
    swept = [("bench_generate_model", 1, "fp32 weights")]
    if settings.bench_train_steps:
        swept.append(("bench_train_model", 4, "fp32 weights, gradients and AdamW states"))
    for key, copies, held in swept:
        name = getattr(settings, key)
        try:
            weights = weights_bytes(name, "fp32")
        except (ValueError, OSError):  # a model the planner cannot read: the sweep's own loading says why
            continue
        if weights * copies > available:
            raise BenchError(f"{key} {name}: its {held} ({format_bytes(weights * copies)}) are over the "
                             f"{format_bytes(available)} of RAM free on this CPU (the sweeps run fp32 there); run "
                             f"profile {settings.hardware.profile} on its GPU, or set {key}=tiny")


# ----------------------------------------------------------------------------------------------
# Tables for the notebook and the CLI.


def _noise(values: list[float]) -> str:
    """A point's noise warning (``counting.noise_note``), set after its figure; '' when its runs agree."""
    note = noise_note(values)
    return f" ({note})" if note else ""


def _runs(generation: dict, strategy: str, batch_size: int) -> list[float]:
    return next((p["output_tokens_per_second"]["runs"] for p in generation["points"]
                 if p["strategy"] == strategy and p["batch_size"] == batch_size and "output_tokens_per_second" in p), [])


def _format(value, pattern: str = "{:,.1f}", missing: str = NA) -> str:
    return missing if value is None else pattern.format(value)


def generation_rows(report: dict) -> list[dict]:
    """One row per point; with hf-pipeline points, each row's tokens/s over the pipeline's at its batch size."""
    pipeline = {p["batch_size"]: p["output_tokens_per_second"]["median"] for p in report["generation"]["points"]
                if p["strategy"] == HF_PIPELINE and "output_tokens_per_second" in p}
    rows = []
    for p in report["generation"]["points"]:
        batch = f"{p['batch_size']}" + (" (planner)" if p.get("planner_batch") else "")
        if p.get("skipped"):
            rows.append({"strategy": p["strategy"], "batch": batch, "output tok/s (median, min-max)": p["skipped"]})
            continue
        tps = p["output_tokens_per_second"]
        rows.append({
            "strategy": p["strategy"], "batch": batch,
            "output tok/s (median, min-max)": f"{tps['median']:,.1f} ({tps['min']:,.1f}-{tps['max']:,.1f})"
                                              + _noise(tps["runs"]),
            "examples/min": f"{p['examples_per_minute']:,.1f}",
            "first result s": _format(p["time_to_first_result_seconds"], "{:.3f}"),
            "padding waste": _format(p["padding_waste"], "{:.1%}"),
            "peak memory": format_bytes(p["peak_memory_bytes"]) if p["peak_memory_bytes"] else NOT_MEASURED,
            "planner": format_bytes(p["predicted_peak_bytes"]) if p["predicted_peak_bytes"] else NA,
            "of roofline": _format(p["fraction_of_roofline"]["datasheet"], "{:.1%}"),
            "of roofline, measured ceilings": _format(p["fraction_of_roofline"]["measured_ceilings"], "{:.1%}"),
            "prefill share of roofline": _format(p["roofline"]["seconds"] and p["roofline"]["seconds"]["prefill"]
                                                 / p["roofline"]["seconds"]["total"], "{:.0%}"),
            "speedup vs seed-after": _format(p.get("speedup_over_seed_after"), "{:.2f}x")
                                     + (f" ({p['speedup_noise']})" if p.get("speedup_noise") else ""),
            **({"vs hf-pipeline, same batch": _format(tps["median"] / pipeline[p["batch_size"]]
                                                      if p["batch_size"] in pipeline else None, "{:.2f}x")}
               if pipeline else {}),
            "$ / 1k examples": _format(p["cost"]["usd_per_1000_examples"], "${:.4f}"),
        })
    return rows


def hardware_text(report: dict) -> str:
    """The machine in a few words: its GPUs, else its CPU and the threads torch used."""
    gpus = report["hardware"]["gpus"]
    if gpus:
        return f"{len(gpus)} x {gpus[0]['name']}"
    load = report.get("load_average_1min_before_after")
    busy = f", 1-minute load average {load[0]} before and {load[1]} after the sweeps" if load else ""
    return f"{report['hardware']['cpu']['model']} (CPU, {report['threads']} torch threads{busy})"


def pipeline_comparison_lines(report: dict) -> list[str]:
    """What the hf-pipeline rows measured, how and on what hardware, then per batch size the
    workbook's fastest strategy over the pipeline and whether their outputs were compared."""
    generation = report["generation"]
    measured = [p for p in generation["points"] if "workbook_best_over_pipeline" in p]
    if not measured:
        return []
    lines = [f"hf-pipeline: {generation['hf_pipeline']}. Measured in this run beside the workbook's strategies: "
             f"{generation['model']}, {generation['examples']} prompts, {generation['max_new_tokens']} new tokens "
             f"each, median of {generation['repeats']} timed runs after a warm-up batch; transformers "
             f"{report['versions']['transformers']}, torch {report['versions']['torch']}, on {hardware_text(report)}."]
    for p in measured:
        ratio, prompts, compared = p["workbook_best_over_pipeline"], p["pipeline_prompts"], \
            p.get("compared_with_one_at_a_time")
        if ratio["ratio"] is None:
            lines.append(f"- batch {p['batch_size']}: {ratio['note']}")
            continue
        if compared is None:
            equality = "not compared with one-at-a-time output (needs seed-before in bench_strategies)"
        elif compared == 0:
            equality = "not compared with one-at-a-time output: the pipeline ran other token ids than the sweep's"
        else:
            equality = (f"{p['identical_to_one_at_a_time']} of {compared} outputs identical to one-at-a-time "
                        "greedy output")
        noisy = "".join(f"; {name} {note}" for name, note in (
            (ratio["strategy"], noise_note(_runs(generation, ratio["strategy"], p["batch_size"]))),
            ("hf-pipeline", noise_note(p["output_tokens_per_second"]["runs"]))) if note)
        lines.append(f"- batch {p['batch_size']}: workbook best / hf-pipeline = **{ratio['ratio']:.2f}x** "
                     f"({ratio['strategy']} {ratio['workbook_tokens_per_second']:,.1f} vs hf-pipeline "
                     f"{p['output_tokens_per_second']['median']:,.1f} output tok/s){noisy}; "
                     f"{prompts['prompts_with_the_sweeps_ids']} of {generation['examples']} prompts ran the sweep's "
                     f"token ids ({prompts['prompt_tokens_run']:,} prompt tokens, the sweep's "
                     f"{prompts['sweep_prompt_tokens']:,}); {equality}; {p['full_length_outputs']} of {p['examples']} "
                     "outputs ran to full length, counted from the returned ids")
    return lines


def training_rows(report: dict) -> list[dict]:
    """The workbook's points, then each baseline (HF Trainer, TRL) with the workbook's figures over its own."""
    training = report["training"] or {}
    rows = []
    for p in training.get("points", []) + training.get("baselines", []):
        planned = " (planned)" if p.get("micro_batch_rule") else ""  # 'auto': the planner's largest for this point
        row = {"loop": p.get("loop", "workbook"), "micro-batch": f"{p['micro_batch_size']}{planned}",
               "checkpointing": p["grad_checkpointing"], "compile": p["torch_compile"], "padding": p["padding"],
               "memory setting": training_setting(p)}
        if p.get("skipped"):
            rows.append({**row, "tokens/s": p["skipped"]})
            continue
        if p.get("out_of_memory"):
            rows.append({**row, "tokens/s": f"out of memory; the planner said it {p['planner_said']}",
                         "planner": format_bytes(p["predicted_peak_bytes"]) if p["predicted_peak_bytes"] else NA})
            continue
        rows.append({**row, "tokens/s": _format(p["tokens_per_second"], "{:,.0f}")
                     + _noise(p.get("timed_step_tokens_per_second", [])),
                     "MFU": _format(p["mfu"], "{:.1%}", missing=p["mfu_note"]),
                     "peak memory": format_bytes(p["peak_memory_bytes"]) if p["peak_memory_bytes"] else NOT_MEASURED,
                     "planner": format_bytes(p["predicted_peak_bytes"]) if p.get("predicted_peak_bytes") else NA,
                     "$ / M tokens": _format(p["cost"]["usd_per_million_tokens"], "${:.3f}"),
                     "final loss": _format(p.get("final_loss"), "{:.6g}"),
                     "workbook / baseline": _versus_text(p["versus"]) if "versus" in p else ""})
    return rows


def _versus_text(versus: dict) -> str:
    if versus["tokens_per_second_ratio"] is None:
        return versus["note"]
    memory = _format(versus["peak_memory_ratio"], "{:.2f}x", missing=NOT_MEASURED)
    return f"tokens/s {versus['tokens_per_second_ratio']:.2f}x, peak memory {memory}"


def baseline_note(report: dict) -> str:
    """What each baseline row (HF Trainer, TRL) measured, how, on what hardware, and what still differs
    ('' without one)."""
    paragraphs = []
    for p in (report["training"] or {}).get("baselines", []):
        if "versus" not in p:  # skipped (TRL not installed) or out of memory: its row says so
            continue
        versus, tool = p["versus"], p["loop"].split(" (")[0]
        workbook_loss, tool_loss = versus.get("workbook_final_loss"), versus.get("trainer_final_loss")
        losses = "" if workbook_loss is None or tool_loss is None else (
            f" Final loss after {p['steps']} steps: workbook {workbook_loss:.6g}, {tool} {tool_loss:.6g} "
            f"(same initial weights; {versus['settings']}).")
        paragraphs.append(f"{p['loop']} at micro-batch {p['micro_batch_size']} on {p['hardware']}: {p['how']}. "
                          f"workbook / {tool} = {_versus_text(versus)}.{losses} Still different: "
                          + "; ".join(p["differences"]) + ".")
    return "\n\n".join(paragraphs)


def _reading(nvml: dict, key: str, statistic: str, unit: float = 1.0) -> float | None:
    """One NVML statistic of a point; None where the GPU gave no such reading (not supported, or none sampled)."""
    values = nvml.get(key)
    return None if values is None else values[statistic] / unit


def _points(report: dict) -> list[tuple[str, dict]]:
    """(sweep, point) of every point of a report: generation, then training and its baselines."""
    training = report.get("training") or {}
    return ([("generation", p) for p in (report.get("generation") or {}).get("points", [])]
            + [("training", p) for p in training.get("points", []) + training.get("baselines", [])])


def nvml_rows(report: dict) -> list[dict]:
    sampled = [p for _, p in _points(report) if "nvml" in p]
    reasons = {p["nvml"].get("reason") for p in sampled}
    if sampled and len(reasons) == 1 and not any(p["nvml"]["available"] for p in sampled):
        return [{"point": f"all {len(sampled)} points", "kernel running (% of time)": reasons.pop()}]  # one why
    rows = []
    for p in sampled:
        nvml = p["nvml"]
        label = f"{p['strategy']} b{p['batch_size']}" if "strategy" in p else f"train {training_label(p)}"
        if not nvml["available"]:
            rows.append({"point": label, "kernel running (% of time)": nvml["reason"]})
            continue
        rows.append({"point": label,
                     "kernel running (% of time)": _format(_reading(nvml, "kernel_time_percent", "mean"), "{:.0f}"),
                     "memory used": _format(_reading(nvml, "memory_used_bytes", "max", GiB), "{:.1f} GiB"),
                     "power W": _format(_reading(nvml, "power_watts", "mean"), "{:.0f}"),
                     "SM clock MHz": _format(_reading(nvml, "sm_clock_mhz", "mean"), "{:.0f}")})
    return rows


# ----------------------------------------------------------------------------------------------
# Command line: `workbook bench --params FILE [--set key=value ...]`.


def gpu_capacity_bytes(settings: BenchSettings) -> int | None:
    """The profile's memory per GPU, the capacity line of the memory figure; None on the cpu profile."""
    return memory_budget(settings.hardware).capacity_bytes if settings.hardware.gpu_count else None


POINTS_FILE = "points.jsonl"  # each point as it is measured: what a stopped benchmark leaves
REPORT_SECONDS = 15  # kept from a time budget for writing the report: figures, JSON, the TF32 matmul check


def partial_record(path: Path) -> Callable[[str, dict], None]:
    """Append each measured point to ``path`` as one JSON line, flushed to disk at once: a benchmark
    stopped by a time limit (a lent GPU's call) or a crash keeps every point it finished."""
    def write(sweep: str, point: dict) -> None:
        with path.open("a") as file:
            file.write(json.dumps({"sweep": sweep, **point}, default=str) + "\n")
            file.flush()
            os.fsync(file.fileno())
    return write


def cli_main(params_arg: str, overrides: list[str], time_budget_seconds: float | None = None, *,
             figures=None) -> int:
    """Run the benchmark into a new run folder: benchmark.json, the PNGs and benchmark.md; with
    ``time_budget_seconds``, the points left when it runs out are marked so and the report written.
    ``figures(report, capacity_bytes)`` gives the PNGs by name (``benchmark_plots.benchmark_figures``:
    passed in by the command, so the benchmark itself never imports the plotting stack)."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    run = None  # the run folder, recorded in its manifest.json like any run (notebook 05 lists it)
    try:
        params, params_file, _ = runner.resolve_params(params_arg, overrides, log=say)
        settings = BenchSettings.from_params(params)
        run = runner.start_job(notebook.new_run_dir(f"bench-{settings.hardware.profile}"), "bench", params,
                               params_file, overrides)
        run_dir = run.run_dir
        # From the process's start (its imports count), less the report's writing (figures, the TF32 matmuls).
        budget = TimeBudget(time_budget_seconds and time_budget_seconds - (runtime.process_age_seconds() or 0)
                            - REPORT_SECONDS, points_only=True)
        try:
            report = run_benchmark(settings, run_dir, log=say, on_point=partial_record(run_dir / POINTS_FILE),
                                   budget=budget)
        finally:
            budget.cancel()
    except (params_module.ParamsError, BenchError, GenerationError, DoesNotFitError, DataError) as error:
        say(f"error: {error}")
        return runner.finish_job(run, 2, error)
    except Exception as error:  # a bug's traceback: the manifest says 'failed', not 'running' for ever
        runner.finish_job(run, 3, error)
        raise
    report["command"] = ("workbook bench --params " + params_arg + (" --set " + " ".join(overrides) if overrides else "")
                         + (f" --time-budget-seconds {time_budget_seconds:g}" if time_budget_seconds else ""))
    report["time_budget"] = {"seconds": time_budget_seconds, "ran_out": budget.expired}
    (run_dir / "benchmark.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    for name, figure in (figures(report, gpu_capacity_bytes(settings)) if figures else {}).items():
        figure.savefig(run_dir / name, dpi=120, bbox_inches="tight")
    # Lines under a section's table: what the tools users know measured beside ours.
    notes = {"Generation": pipeline_comparison_lines(report), "Training": [baseline_note(report)],
             "Goals": [published.vllm_line()]}

    def section(title: str, rows: list[dict]) -> str:
        lines = [line for line in notes.get(title, []) if line]
        return f"## {title}\n\n{notebook.markdown_table(rows)}" + ("\n\n" + "\n".join(lines) if lines else "")

    text = "\n\n".join(section(title, rows) for title, rows in (
        ("Generation", generation_rows(report)), ("Training", training_rows(report)),
        ("Seed claims", report["claims"]), ("Goals", report["goals"]),
        ("NVML (share of time a kernel ran, not efficiency)", nvml_rows(report))))
    (run_dir / "benchmark.md").write_text(f"`{report['command']}`\n\n{text}\n")
    print(text)
    print(f"wrote {run_dir / 'benchmark.json'}, {run_dir / 'benchmark.md'} and the PNGs")
    failed = failed_points(report)
    if failed:  # the report is whole but for these: the run is 'incomplete' and exits 1
        say(f"{len(failed)} point(s) failed (their rows say with what; the tracebacks are above): {'; '.join(failed)}")
    return runner.finish_job(run, 1 if failed else 0, "; ".join(failed) or None)


def failed_points(report: dict) -> list[str]:
    """'<sweep> <point>: <error>' of every point that raised (``TimeBudget.measure`` marked it)."""
    return [(f"training {training_label(point)}" if sweep == "training" else
             f"generation {point['strategy']} batch {point['batch_size']}") + f": {point['error']}"
            for sweep, point in _points(report) if point.get("error")]
