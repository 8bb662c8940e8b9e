"""The forecast without a pilot held against real runs on this machine: the efficiency measured once,
on one job, then other jobs forecast from their work alone and run. A benchmark, not a test::

    workbook roofline-check --out outputs/reference/cpu      # roofline_check.{json,md}, roofline_efficiency.json

On the cpu profile: the tiny model's architecture with random weights (every output runs to
max_new_tokens, so the lengths are known and the check is of work -> time alone), at the profile's
batch, in this process with one thread. The calibration job's forward hooks split its engine time
into prefill and decode; each phase's efficiency is its work over that time and this machine's
measured ceilings. The efficiency file it leaves is what ``roofline`` reads for this profile. On a
GPU (``--profile h100 --model <folder>``) the same, against the profile's datasheet peaks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from workbook import gpu, models, params as params_module, presets, runtime, tiny_model
from workbook.forecast import roofline
from workbook.forecast.forward_timer import ForwardTimer
from workbook.forecast.work import model_work, static_generation_work
from workbook.generation.job import run_job
from workbook.generation.settings import GenerationSettings
from workbook.hardware import Hardware

GOAL = 0.15  # |forecast - measured| / measured
# (name, prompts file, max_new_tokens): the first job measures the efficiency, the others are forecast.
JOBS = (("calibration: 1,500 prompts, 16 new tokens", "lib/workbook/data/arithmetic_contraction_pool.jsonl", 16),
        ("300 arithmetic prompts, 8 new tokens", "lib/workbook/data/arithmetic_prompts.jsonl", 8),
        ("300 held-out prompts, 16 new tokens", "lib/workbook/data/arithmetic_contraction_held_out.jsonl", 16),
        ("1,500 prompts, 24 new tokens", "lib/workbook/data/arithmetic_contraction_pool.jsonl", 24))
WARM_UP = ("lib/workbook/data/arithmetic_prompts.jsonl", 4)  # run first, not counted: one-time costs of the process


def _prompt_length(args, kwargs) -> tuple[int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return (ids.shape[-1] if ids is not None else 1,)


# What the check measures: wall seconds, or this process's CPU seconds, which other work on a shared
# machine does not stretch (with one thread they equal the wall time of the run on an idle machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run_once(params, model, tokenizer, output: Path, clock=time.perf_counter) -> dict:
    """One real run of the job (the model preloaded: no start-up, no load): its seconds on ``clock``,
    the engine's wall seconds, and the forwards' seconds by phase on ``clock``."""
    timer = ForwardTimer(model, runtime.default_device(), clock, describe=_prompt_length)
    began = clock()
    try:
        summary = run_job(params, output, model=model, tokenizer=tokenizer, log=lambda line: None, show_progress=False)
    finally:
        timer.remove()
    seconds = clock() - began
    prefill = sum(end - start for start, end, tokens in timer.events if tokens > 1)
    decode = sum(end - start for start, end, tokens in timer.events if tokens == 1)
    return {"seconds": seconds, "engine_wall_seconds": summary["seconds"], "prefill_forward_seconds": prefill,
            "decode_forward_seconds": decode, "outputs": summary["generated"]}


def cpu_time_peaks(copy_bytes: int = 128 * 2 ** 20, size: int = 1024, repeats: int = 3) -> roofline.forecast.Peaks:
    """This machine's ceilings on the CPU-time clock, as the check measures its runs: the fastest of
    ``repeats`` fp32 copies (bytes read + written) and ``size``^3 matmuls, in this process's CPU seconds
    (a shared machine's other work stretches the wall clock, not these)."""
    source, target = torch.ones(copy_bytes // 4), torch.empty(copy_bytes // 4)
    a, b = torch.randn(size, size), torch.randn(size, size)

    def best(work) -> float:
        work()
        times = []
        for _ in range(repeats):
            began = time.process_time()
            work()
            times.append(time.process_time() - began)
        return min(times)

    copy, matmul = best(lambda: target.copy_(source)), best(lambda: a @ b)
    return roofline.forecast.Peaks(2 * size ** 3 / matmul, 2 * copy_bytes / copy,
                                   f"this machine's ceilings in CPU time, {torch.get_num_threads()} thread(s): a "
                                   f"{copy_bytes // 2 ** 20} MiB fp32 copy (read + write) and a {size}^3 fp32 matmul, "
                                   f"best of {repeats}")


def check(profile: str = "cpu", model_name: str = tiny_model.TINY_MODEL_NAME, repeats: int = 3, log=print,
          clock: str = "cpu") -> dict:
    base = params_module.load(params_module.profile_path(profile))
    hardware, dtype = Hardware.from_params(base), GenerationSettings.from_params(base).dtype
    torch.manual_seed(0)
    if model_name == tiny_model.TINY_MODEL_NAME:  # random weights: every output runs to max_new_tokens
        model = AutoModelForCausalLM.from_config(presets.load_config(model_name)).to(runtime.default_device()).eval()
        tokenizer = tiny_model.build_tokenizer()
    else:
        loaded = models.load_model(model_name, dtype, runtime.default_device())
        model, tokenizer = loaded.model, models.load_tokenizer(model_name)
    counted = model_work(presets.load_config(models.model_source(model_name)), dtype)
    peaks = roofline.peaks_for(hardware, dtype) if clock == "wall" or hardware.has_gpu else cpu_time_peaks()
    cases, efficiency = [], None
    with tempfile.TemporaryDirectory(prefix="roofline-check-") as scratch:
        warm = params_module.apply_overrides(base, {"model": model_name, "prompts_path": WARM_UP[0], "backend": "static",
                                                    "max_new_tokens": WARM_UP[1], "do_sample": False,
                                                    "samples_per_prompt": 1, "verifier": "", "max_accepted_per_prompt": 0})
        run_once(warm, model, tokenizer, Path(scratch) / "warm-up.jsonl", CLOCKS[clock])
        for index, (name, prompts, new_tokens) in enumerate(JOBS):
            params = params_module.apply_overrides(base, {
                "model": model_name, "prompts_path": prompts, "max_new_tokens": new_tokens, "backend": "static",
                "do_sample": False, "samples_per_prompt": 1, "verifier": "", "max_accepted_per_prompt": 0})
            lengths = roofline.job_lengths(GenerationSettings.from_params(params), tokenizer)
            batch = roofline.planner_profile.resolve_batch_size(params, "generate")
            job = static_generation_work(counted, lengths.prompt_tokens, [float(new_tokens)] * len(lengths.prompt_tokens),
                                         batch_size=batch, max_new_tokens=new_tokens)
            runs = [run_once(params, model, tokenizer, Path(scratch) / f"{index}-{repeat}.jsonl", CLOCKS[clock])
                    for repeat in range(repeats)]
            measured = statistics.median(run["seconds"] for run in runs)
            if efficiency is None:
                # The calibration job: decode steps are its decode forwards; the rest of the engine's time is
                # per call (padding, the prefill, decoding and writing the outputs), as a prefill is.
                decode_seconds = statistics.median(r["decode_forward_seconds"] for r in runs)
                efficiency = {"decode_bandwidth": job.decode.bytes / decode_seconds / peaks.bytes_per_second,
                              "compute": job.prefill.flops / (measured - decode_seconds) / peaks.flops}
            predicted = roofline.seconds(job, peaks, efficiency)
            error = (predicted - measured) / measured
            log(f"{name}: forecast {predicted:.2f} s, measured {measured:.2f} s ({error:+.1%})")
            cases.append({"job": name, "prompts_path": prompts, "max_new_tokens": new_tokens, "batch_size": batch,
                          "prompts": len(lengths.prompt_tokens), "calls": len(job.calls),
                          "forecast_seconds": predicted, "measured_seconds": measured,
                          "relative_error": error, "within_goal": abs(error) <= GOAL, "runs": runs,
                          "work": job.summary(), "role": "calibration" if index == 0 else "check"})
    return {"what": "the forecast without a pilot (work at an efficiency measured once) against real runs",
            "profile": profile, "model": model_name + (" (random weights)" if model_name == tiny_model.TINY_MODEL_NAME else ""),
            "threads": torch.get_num_threads(), "clock": clock, "goal": GOAL, "peaks": peaks.__dict__,
            "efficiency": {"generate": efficiency}, "cases": cases,
            "hardware": gpu.cpu_facts() if not torch.cuda.is_available() else gpu.detect()}


def markdown(record: dict) -> str:
    rows = [f"| {case['job']} | {case['role']} | {case['prompts']} | {case['calls']} | {case['forecast_seconds']:.2f} s | "
            f"{case['measured_seconds']:.2f} s | {case['relative_error']:+.1%} |" for case in record["cases"]]
    eff = record["efficiency"]["generate"]
    return "\n".join([
        "# The forecast without a pilot against real runs", "", f"`{record['command']}`", "",
        f"{record['model']} on the {record['profile']} profile, {record['threads']} thread(s); peaks: "
        f"{record['peaks']['source']}. Efficiency measured once, on the calibration job: decode "
        f"{eff['decode_bandwidth']:.2%} of the bandwidth, prefill {eff['compute']:.2%} of the compute "
        "(a tiny model on a CPU is bound by per-step overhead, not by its bytes: its efficiency is small, and holds "
        f"only for jobs at the same batch size). Measured: the job's {record['clock']} seconds with the model loaded "
        "(median of the runs; start-up and model load left out, as the forecast leaves them out); 'cpu': this "
        "process's CPU time, which other work on a shared machine does not stretch. Goal: within "
        f"{record['goal']:.0%}.", "",
        "| job | role | prompts | calls | forecast | measured | error |", "|---|---|---|---|---|---|---|", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook roofline-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder, e.g. outputs/reference/cpu")
    parser.add_argument("--profile", default="cpu", help="the profile of this machine (default cpu)")
    parser.add_argument("--model", default=tiny_model.TINY_MODEL_NAME,
                        help="'tiny' (its architecture, random weights) or a model folder with weights")
    parser.add_argument("--repeats", type=int, default=3, help="runs per job; the median counts")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="measure this process's CPU seconds (default; one thread: a shared machine's other work "
                             "does not stretch them) or wall seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine's "
                                                                 "other work stretches fewer)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    record = {**check(args.profile, args.model, args.repeats, log=lambda line: print(line, file=sys.stderr),
                      clock=args.clock),
              "command": "workbook roofline-check " + " ".join(argv)}
    record["seconds"] = time.perf_counter() - began
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline_check.json").write_text(json.dumps(roofline.forecast.round_floats(record), indent=2) + "\n")
    (out / "roofline_check.md").write_text(markdown(record))
    (out / roofline.EFFICIENCY_FILE).write_text(json.dumps({
        "what": "generation efficiency on this profile's device, measured by workbook roofline-check (its calibration "
                "job); the forecast without a pilot reads it", "command": record["command"],
        "model": record["model"], "threads": record["threads"], "clock": record["clock"], "peaks": record["peaks"],
        "efficiency": record["efficiency"]}, indent=2) + "\n")
    print(markdown(record))
    return 0 if all(case["within_goal"] for case in record["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
