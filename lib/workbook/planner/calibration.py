"""How close the memory planner is to the peaks a real GPU measures: a benchmark, not a test.

Run it once per GPU profile and keep the JSON beside the profile's reference outputs::

    workbook calibrate --out outputs/reference/h200 --profile h200

On a CUDA machine it runs ``calibration_grid(profile)``: every case builds a preset model from its
config with RANDOM bf16 weights directly on the GPU (nothing is downloaded; memory depends on
shapes, not on weight values), measures the worst-case peak with the finder's probes
(``workbook.planner.probes``) and compares it with ``plan_generate`` / ``plan_train`` for the same
settings; ``memory_accuracy.json`` holds every case and the summary against the goal (median
absolute relative error <= 1.5%, max <= 4%). The grid takes a few minutes on an H200.

Without a GPU it runs ``exact_checks.cpu_exact_checks()`` only (what CPU can check exactly: parameter counts,
weight bytes, the KV cache of a real generate(), saved activations) and says the GPU part is
pending. Results are data only; plotting belongs to ``workbook.plots``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from workbook import gpu, models, params, presets
from workbook.planner import accelerate_estimate, exact_checks, probes
from workbook.planner.finder import ProbeMeasurement, error_summary
from workbook.planner.generation import plan_generate
from workbook.planner.plans import DEFAULT_OVERHEAD_BYTES, DEFAULT_SAFETY_MARGIN, Plan, budget_bytes
from workbook.planner.training import plan_train
from workbook.units import GiB

GOAL_MEDIAN_ABS_RELATIVE_ERROR = 0.015  # the planner's target: median |predicted/measured - 1|
GOAL_MAX_ABS_RELATIVE_ERROR = 0.04  # ... and the worst case
# Cases are kept well under the GPU so an underestimate shows up as an error, not as an OOM that
# measures nothing: a case runs only if its plan uses at most this share of the profile's budget.
GRID_BUDGET_FRACTION = 0.8
DTYPE = "bf16"  # weights, activations and KV cache: the model is built in bf16, no autocast
ATTN_IMPLEMENTATION = models.DEFAULT_ATTENTION  # transformers' default; the planner's default too
LORA_RANK = 16
RESULT_FILE = "memory_accuracy.json"
CPU_CHECKS_FILE = "cpu_exact_checks.json"


# ----------------------------------------------------------------------------------------------
# The grid.


@dataclass(frozen=True)
class CalibrationCase:
    """One measurement: a preset model, a mode and the sizes the planner is asked about."""

    name: str  # unique, e.g. "llama-3.1-8b/generate/b64-p1024-n512"
    model: str  # a preset name (workbook.presets)
    mode: str  # "generate" or "train"
    batch_size: int  # sequences (the micro-batch when training)
    prompt_len: int = 0  # generate: tokens of the (forced) longest prompt
    new_tokens: int = 0  # generate: tokens generated, forced (min_new_tokens = max_new_tokens)
    seq_len: int = 0  # train: tokens per sequence
    grad_checkpointing: bool = False  # train
    lora_rank: int = 0  # train: 0 = full fine-tune; > 0 needs peft
    # False for the tiny model: its tensors are a few MiB, so the measured CUDA context is nearly
    # all of its total and its error says nothing about the formulas.
    counts_toward_goal: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


# (model, prompt_len, new_tokens, batch): prefill-heavy and decode-heavy shapes per model.
_GENERATE_SHAPES = [
    ("tiny", 64, 128, 64),
    ("qwen2.5-0.5b", 512, 256, 16),
    ("qwen2.5-0.5b", 2048, 256, 64),
    ("llama-3.2-1b", 512, 256, 16),
    ("llama-3.2-1b", 1024, 512, 64),
    ("llama-3.1-8b", 512, 256, 16),
    ("llama-3.1-8b", 1024, 512, 64),
]
# (model, seq_len, micro_batch, grad_checkpointing, lora_rank).
_TRAIN_SHAPES = [
    ("tiny", 256, 8, False, 0),
    ("tiny", 256, 8, True, 0),
    ("qwen2.5-0.5b", 1024, 4, False, 0),
    ("qwen2.5-0.5b", 2048, 8, True, 0),
    ("llama-3.2-1b", 1024, 4, False, 0),
    ("llama-3.2-1b", 2048, 8, True, 0),
    ("llama-3.1-8b", 1024, 1, False, 0),
    ("llama-3.1-8b", 2048, 4, True, 0),
    ("qwen2.5-0.5b", 1024, 4, False, LORA_RANK),
    ("llama-3.2-1b", 2048, 4, False, LORA_RANK),
    ("llama-3.1-8b", 2048, 2, False, LORA_RANK),
]


def calibration_grid(profile: str | dict) -> list[CalibrationCase]:
    """The cases to measure on ``profile``'s GPU (a profile name, a params file, or loaded params).

    Models: the tiny model, Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B; modes: generate, train,
    train with gradient checkpointing, LoRA. Only cases whose plan stays within
    ``GRID_BUDGET_FRACTION`` of the GPU's budget are kept, so smaller GPUs get a shorter grid.
    18 cases on an H200 (11 on an A100 40GB), a few minutes: each builds its model and runs one
    generate or one training step.
    """
    gpu_memory_bytes = _profile_gpu_memory_bytes(profile)
    cases = [
        CalibrationCase(
            name=f"{model}/generate/b{batch}-p{prompt_len}-n{new_tokens}", model=model,
            mode="generate", batch_size=batch, prompt_len=prompt_len, new_tokens=new_tokens,
            counts_toward_goal=model != presets.TINY_PRESET,
        )
        for model, prompt_len, new_tokens, batch in _GENERATE_SHAPES
    ]
    for model, seq_len, batch, checkpointing, rank in _TRAIN_SHAPES:
        method = f"lora{rank}" if rank else ("train-checkpointed" if checkpointing else "train")
        cases.append(CalibrationCase(
            name=f"{model}/{method}/b{batch}-s{seq_len}", model=model, mode="train",
            batch_size=batch, seq_len=seq_len, grad_checkpointing=checkpointing, lora_rank=rank,
            counts_toward_goal=model != presets.TINY_PRESET,
        ))
    budget = budget_bytes(gpu_memory_bytes, DEFAULT_SAFETY_MARGIN)
    return [
        case for case in cases
        if plan_for_case(case, gpu_memory_bytes=gpu_memory_bytes).total_bytes
        <= GRID_BUDGET_FRACTION * budget
    ]


# Named case lists: a GPU session's chosen cases, measured as they are (not filtered to the grid's 0.8 of the
# budget: one case sits near the planner's largest batch on purpose, where an underestimate would run out of
# memory). ``workbook.planner.calibration --cases first-light``.
NEAR_LARGEST_SHARE = 0.9  # the near-largest case runs at this share of the planner's largest micro-batch


def first_light_cases(profile: str | dict) -> list[CalibrationCase]:
    """The planner against the measured peak in the fewest cases that span its modes (a lent GPU's first
    call): 8B-shaped generation at the seeds' batch 32 and at 128, the 1B-shaped full fine-tune plain and
    checkpointed, a 1B LoRA, and the checkpointed 1B at ``NEAR_LARGEST_SHARE`` of the planner's largest
    micro-batch on ``profile``'s GPU. The 1B stands in for training (an 8B full fine-tune does not fit one
    GPU; its cases build in seconds where an 8B takes most of a minute)."""
    gpu_memory_bytes = _profile_gpu_memory_bytes(profile)
    cases = [
        CalibrationCase(name=f"llama-3.1-8b/generate/b{batch}-p512-n256", model="llama-3.1-8b", mode="generate",
                        batch_size=batch, prompt_len=512, new_tokens=256)
        for batch in (32, 128)
    ] + [
        CalibrationCase(name="llama-3.2-1b/train/b4-s2048", model="llama-3.2-1b", mode="train", batch_size=4,
                        seq_len=2048),
        CalibrationCase(name="llama-3.2-1b/train-checkpointed/b8-s2048", model="llama-3.2-1b", mode="train",
                        batch_size=8, seq_len=2048, grad_checkpointing=True),
        CalibrationCase(name=f"llama-3.2-1b/lora{LORA_RANK}/b4-s2048", model="llama-3.2-1b", mode="train",
                        batch_size=4, seq_len=2048, lora_rank=LORA_RANK),
    ]
    checkpointed = cases[3]
    largest = plan_for_case(checkpointed, gpu_memory_bytes=gpu_memory_bytes).max_batch_size
    near = max(1, int(NEAR_LARGEST_SHARE * largest))
    cases.append(CalibrationCase(
        name=f"llama-3.2-1b/train-checkpointed/b{near}-s2048-near-largest-{largest}", model="llama-3.2-1b",
        mode="train", batch_size=near, seq_len=2048, grad_checkpointing=True))
    return cases


NAMED_CASES = {"first-light": first_light_cases}


def named_cases(name: str, profile: str | dict) -> list[CalibrationCase]:
    """The cases of the list ``name`` (``NAMED_CASES``) on ``profile``'s GPU."""
    if name not in NAMED_CASES:
        raise SystemExit(f"--cases {name!r}: no such case list; the lists: {', '.join(NAMED_CASES)}")
    return NAMED_CASES[name](profile)


def plan_for_case(case: CalibrationCase, *, gpu_memory_bytes: int, overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> Plan:
    """The planner's prediction for ``case``, with the settings measure_case runs it under.

    Training is pure bf16 (``mixed_precision=False``: the weights are bf16, no autocast) with
    AdamW; LoRA adapters are fp32, as PEFT makes them.
    """
    if case.mode == "generate":
        return plan_generate(
            case.model, batch_size=case.batch_size, prompt_len=case.prompt_len,
            new_tokens=case.new_tokens, gpu_memory_bytes=gpu_memory_bytes, dtype=DTYPE,
            attn_implementation=ATTN_IMPLEMENTATION, overhead_bytes=overhead_bytes,
        )
    if case.mode == "train":
        return plan_train(
            case.model, micro_batch_size=case.batch_size, seq_len=case.seq_len,
            gpu_memory_bytes=gpu_memory_bytes, dtype=DTYPE, mixed_precision=False,
            grad_checkpointing=case.grad_checkpointing, lora_rank=case.lora_rank,
            attn_implementation=ATTN_IMPLEMENTATION, overhead_bytes=overhead_bytes,
        )
    raise ValueError(f"case {case.name!r}: mode {case.mode!r} is not 'generate' or 'train'")


def skip_reason(case: CalibrationCase) -> str | None:
    """Why ``case`` cannot run here (a missing package), or None."""
    if case.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        return "LoRA cases need the 'peft' package, which is not installed (pip install peft)"
    return None


def _profile_gpu_memory_bytes(profile: str | dict) -> int:
    loaded = profile if isinstance(profile, dict) else params.load(params.profile_path(profile))
    gib = loaded["gpu_memory_gib"]
    if not gib:
        raise ValueError(
            f"profile {loaded.get('profile', '?')!r} has no GPU (gpu_memory_gib is {gib}); the "
            "calibration grid is sized by a GPU's memory: pass a GPU profile such as 'h200'"
        )
    return int(gib * GiB)


# ----------------------------------------------------------------------------------------------
# One case on the GPU.


def measure_case(case: CalibrationCase, *, device: str | torch.device = "cuda", overhead_bytes: int | None = None) -> dict:
    """Build ``case``'s model on the GPU, measure its worst-case peak, compare with the planner.

    The plan's CUDA context term is ``overhead_bytes``, the constant the overhead probe measured
    (``overhead_probe``; the profile's, as users plan with it), or without it the overhead measured
    in this run (memory used outside PyTorch's allocator), so the comparison tests the tensor formulas
    and the fragmentation prior alone. Everything is freed before returning. Returns a
    JSON-ready record: status "measured", "oom" (the planner said it fits, the GPU disagreed) or
    "skipped" with the reason.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            "measure_case needs a CUDA GPU (it reads torch.cuda's peak memory statistics); on "
            "this machine run cpu_exact_checks() instead"
        )
    record = {"case": case.to_dict(), "settings": {
        "dtype": DTYPE, "attn_implementation": ATTN_IMPLEMENTATION, "weights": "random",
        "mixed_precision": False, "optimizer": "adamw (lr=0: the probe does not train)",
    }}
    reason = skip_reason(case)
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    _, total_bytes = torch.cuda.mem_get_info(device)
    clear_device_cache(garbage_collection=True)
    started = time.perf_counter()
    try:
        measurement = run_case_probe(case, device)
    except Exception as error:
        if not should_reduce_batch_size(error):  # a case that fails otherwise is a finding; the grid goes on
            traceback.print_exc()
            return {**record, "status": "failed", "reason": error_summary(error)}
        measurement = None
        oom_error = error_summary(error)
    finally:
        clear_device_cache(garbage_collection=True)  # the model went with run_case_probe's frame
    seconds = time.perf_counter() - started
    if measurement is None:
        plan = plan_for_case(case, gpu_memory_bytes=total_bytes,
                             overhead_bytes=DEFAULT_OVERHEAD_BYTES if overhead_bytes is None else overhead_bytes)
        return {**record, "status": "oom", "error": oom_error, "seconds": seconds,
                "predicted_bytes": plan.total_bytes, "plan": plan.to_dict()}
    plan = plan_for_case(case, gpu_memory_bytes=total_bytes, overhead_bytes=max(0, measurement.non_pytorch_bytes)
                         if overhead_bytes is None else overhead_bytes)
    return {**record, "status": "measured", "seconds": seconds,
            **compare(plan, measurement),
            **accelerate_estimate.against_measured(plan, case.model, measurement.peak_bytes),
            "measurement": measurement.to_dict(), "plan": plan.to_dict()}


def compare(plan: Plan, measurement: ProbeMeasurement) -> dict:
    """Predicted against measured bytes: the whole peak, and the tensors alone.

    ``relative_error`` is (predicted - measured) / measured of the device peak (reserved peak +
    non-PyTorch memory); positive means the planner overestimates (safe). ``tensor_relative_error``
    compares the plan without its context and fragmentation terms to the allocator's
    allocated peak, isolating the tensor formulas.
    """
    overhead_terms = ("cuda_context", "allocator_fragmentation")
    planned_tensors = sum(t.bytes for t in plan.terms if t.name not in overhead_terms)
    measured = measurement.peak_bytes
    return {
        "predicted_bytes": plan.total_bytes,
        "measured_bytes": measured,
        "relative_error": (plan.total_bytes - measured) / measured,
        "predicted_tensor_bytes": planned_tensors,
        "measured_allocated_bytes": measurement.peak_allocated_bytes,
        "tensor_relative_error": (planned_tensors - measurement.peak_allocated_bytes) / measurement.peak_allocated_bytes,
        "measured_fragmentation_bytes": measurement.peak_reserved_bytes - measurement.peak_allocated_bytes,
        "measured_overhead_bytes": measurement.non_pytorch_bytes,
    }


def run_case_probe(case: CalibrationCase, device: torch.device) -> ProbeMeasurement:
    """Build the model with random bf16 weights on ``device`` and run the case's probe once.

    The model lives only in this frame, so returning (or raising) releases it. Runs on CPU too
    (the tests use that for the tiny model), where the measurement has no peaks.
    """
    model = models.build_random(case.model, DTYPE, device, attn_implementation=ATTN_IMPLEMENTATION).model
    if case.mode == "generate":
        # Random ids: memory depends on the lengths only; min_new_tokens forces the full length.
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (case.prompt_len,), generator=generator)
        probe = probes.generation_probe(model, None, prompt.tolist(), case.new_tokens)
        return probe(case.batch_size)
    if case.grad_checkpointing:
        models.enable_gradient_checkpointing(model)
    if case.lora_rank > 0:
        model = models.with_lora(model, case.lora_rank)  # skip_reason() says so when peft is missing
    return probes.training_probe(model, case.seq_len)(case.batch_size)


# ----------------------------------------------------------------------------------------------
# The whole grid, written to memory_accuracy.json.


def run_calibration(out_dir: str | Path, profile_name: str, cases: list[CalibrationCase] | None = None, *,
                    log=print, overhead_bytes: int | None = None, case_list: str | None = None) -> dict:
    """Measure every case (default: ``calibration_grid(profile_name)``) on this CUDA GPU and
    write ``<out_dir>/memory_accuracy.json`` after each; returns the same record.

    The record holds every case (settings, predicted, measured, relative error), the summary
    against the goal, the hardware, the software versions and the command that reproduces it.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "run_calibration needs a CUDA GPU; on this machine run cpu_exact_checks(), or run "
            f"`{command_line(out_dir, profile_name)}` on the GPU the profile describes"
        )
    cases = calibration_grid(profile_name) if cases is None else cases
    if not cases:
        raise ValueError(f"profile {profile_name}: no calibration case to measure (its grid is empty: the cpu "
                         "profile has none); give the profile of the GPU at hand")
    say = log or (lambda line: None)
    started, records = time.perf_counter(), []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fixed = {  # what every case's rewrite of the record shares, read once
        "profile": profile_name,
        "goal": {"median_abs_relative_error": GOAL_MEDIAN_ABS_RELATIVE_ERROR,
                 "max_abs_relative_error": GOAL_MAX_ABS_RELATIVE_ERROR},
        "cuda_context_term": (f"{overhead_bytes / GiB:.3f} GiB, the overhead probe's constant" if overhead_bytes is not None
                              else "each case's own memory outside PyTorch's allocator, measured in its run"),
        "hardware": gpu.detect(), "versions": gpu.software_versions(),
        "command": command_line(out_dir, profile_name, case_list),
    }
    for number, case in enumerate(cases, 1):
        records.append(measure_case(case, overhead_bytes=overhead_bytes))
        say(f"[{number}/{len(cases)}] {case.name}: {_case_line(records[-1])}")
        # Written after every case: a run cut at a time limit keeps the cases it measured.
        result = {**fixed, "summary": summarize(records, len(cases)), "cases": records, "cases_planned": len(cases),
                  "seconds": time.perf_counter() - started}
        (partial := out_dir / f".{RESULT_FILE}").write_text(json.dumps(result, indent=2) + "\n")
        partial.replace(out_dir / RESULT_FILE)  # whole or the last whole one, never half
    return result


def summarize(records: list[dict], planned: int | None = None) -> dict:
    """Median and max |relative error| of the measured cases counted toward the goal, and whether it is met."""
    errors = [abs(record["relative_error"]) for record in records
              if record["status"] == "measured" and record["case"]["counts_toward_goal"]]
    out_of_memory = [record["case"]["name"] for record in records if record["status"] == "oom"]
    median, largest = (statistics.median(errors), max(errors)) if errors else (None, None)
    return {
        "cases": len(records),
        "measured": sum(record["status"] == "measured" for record in records),
        "counted_toward_goal": len(errors),
        "skipped": [{"name": r["case"]["name"], "reason": r["reason"]}
                    for r in records if r["status"] == "skipped"],
        "out_of_memory": out_of_memory,
        "failed": [{"name": r["case"]["name"], "reason": r["reason"]} for r in records if r["status"] == "failed"],
        "median_abs_relative_error": median,
        "max_abs_relative_error": largest,
        # Only a whole grid meets it: a case cut off by a time limit, or failed, was not checked.
        "meets_goal": bool(errors) and not out_of_memory and (planned is None or len(records) == planned)
        and not any(r["status"] == "failed" for r in records)
        and median <= GOAL_MEDIAN_ABS_RELATIVE_ERROR and largest <= GOAL_MAX_ABS_RELATIVE_ERROR,
        "accelerate_estimate_memory": accelerate_estimate.summarize([
            record for record in records if record["status"] == "measured" and record["case"]["counts_toward_goal"]]),
    }


def _probed_overhead(path: str | None) -> int | None:
    """The overhead probe's constant from ``path`` (its JSON); None without one: the grid still runs,
    each case planned with its own memory outside PyTorch's allocator (as its record says)."""
    if path and not Path(path).is_file():
        print(f"{path} is missing (its probe did not run or failed): each case is planned with the memory "
              "outside PyTorch's allocator measured in its own run")
        path = None
    return json.loads(Path(path).read_text())["overhead_bytes"] if path else None


def command_line(out_dir: str | Path, profile_name: str, case_list: str | None = None) -> str:
    """The command that reproduces a calibration (``case_list``: a named list's, ``NAMED_CASES``)."""
    if case_list:
        return f"python3 -m workbook.planner.calibration --out {out_dir} --profile {profile_name} --cases {case_list}"
    return f"workbook calibrate --out {out_dir} --profile {profile_name}"


def _case_line(record: dict) -> str:
    if record["status"] == "measured":
        return (f"predicted {record['predicted_bytes'] / GiB:.2f} GiB, measured "
                f"{record['measured_bytes'] / GiB:.2f} GiB "
                f"({record['relative_error']:+.1%})")
    return record["status"] + (f": {record['reason']}" if "reason" in record else "")


# ----------------------------------------------------------------------------------------------
# Command line.


def main(argv: list[str] | None = None) -> int:
    """``workbook calibrate --out DIR --profile NAME``: CPU checks, then the grid."""
    parser = argparse.ArgumentParser(
        prog="workbook calibrate",
        description="Compare the memory planner with measured GPU peaks (memory_accuracy.json); "
                    "without a GPU, run only the exact CPU checks (cpu_exact_checks.json).",
    )
    parser.add_argument("--out", required=True, help="output folder, e.g. outputs/reference/h200")
    parser.add_argument("--profile", required=True, help="GPU profile in params/, e.g. h200")
    parser.add_argument("--only", help="comma-separated beginnings of case names: measure only the first case "
                        "each matches (a smoke pass), e.g. llama-3.2-1b/generate,llama-3.2-1b/train-checkpointed")
    parser.add_argument("--overhead-from", help="an overhead probe's cuda_overhead.json: plan every case's CUDA "
                        "context with its constant (default: each case's own measured context)")
    parser.add_argument("--cases", choices=list(NAMED_CASES), help="measure a named case list instead of the grid "
                        "(first-light: the fewest cases that span generation and training, one near the planner's "
                        "largest batch); the CPU exact checks are left to the cpu profile's run")
    args = parser.parse_args(argv)
    if args.cases and args.only:
        parser.error("give --cases or --only, not both")
    try:  # an unknown profile or --only case is named before any work, on a CPU too
        cases = ([] if args.profile == "cpu" else
                 named_cases(args.cases, args.profile) if args.cases else calibration_grid(args.profile))
    except (params.ParamsError, ValueError) as error:
        parser.error(str(error))
    cases = chosen_cases(cases, args.only.split(",")) if args.only else cases
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(args.out, args.profile)

    has_gpu = torch.cuda.is_available() and bool(cases)  # the cpu profile has no grid, GPU or not
    all_exact = True
    if args.cases:  # a named list is a GPU session's few cases: its seconds go to them alone
        if not has_gpu:
            print(f"--cases {args.cases}: the cases need a CUDA GPU and none was found; nothing measured")
            return 0
    else:
        cpu_checks = exact_checks.cpu_exact_checks()
        cpu_checks["command"] = command
        if args.profile == "cpu":  # the exact checks are all a CPU can give; the grid needs a GPU profile
            command = "workbook calibrate --profile h200   (or the profile of the GPU at hand)"
        cpu_checks["gpu_calibration"] = (
            {"status": "run", "file": RESULT_FILE} if has_gpu else
            {"status": "pending",
             "reason": ("the GPU calibration needs a CUDA GPU; none was found on this machine"
                        if not torch.cuda.is_available() else
                        f"profile {args.profile} has no calibration grid; give the profile of the GPU at hand"),
             "to_run": f"{command}  (on the GPU the profile describes)"}
        )
        (out_dir / exact_checks.CPU_CHECKS_FILE).write_text(json.dumps(cpu_checks, indent=2) + "\n")
        exact = sum(check["exact"] for check in cpu_checks["checks"])
        print(f"CPU exact checks: {exact}/{len(cpu_checks['checks'])} exact -> "
              f"{out_dir / exact_checks.CPU_CHECKS_FILE}")
        if not has_gpu:
            print(f"GPU calibration pending: it needs a CUDA GPU and none was found. Run `{command}` "
                  f"on that GPU to write outputs/reference/<profile>/{RESULT_FILE}.")
            return 0 if cpu_checks["all_exact"] else 1
        all_exact = cpu_checks["all_exact"]

    result = run_calibration(out_dir, args.profile, cases, overhead_bytes=_probed_overhead(args.overhead_from),
                             case_list=args.cases)
    from workbook import plots  # the figure is for people; the JSON above is the record
    plots.memory_accuracy(result).savefig(out_dir / "memory_accuracy.png", dpi=120, bbox_inches="tight")
    summary = result["summary"]
    print(f"GPU calibration: {summary['measured']} cases measured, median |error| "
          f"{_percent(summary['median_abs_relative_error'])}, max "
          f"{_percent(summary['max_abs_relative_error'])} (goal <= "
          f"{GOAL_MEDIAN_ABS_RELATIVE_ERROR:.1%} / {GOAL_MAX_ABS_RELATIVE_ERROR:.0%}) -> "
          f"{out_dir / RESULT_FILE}")
    beside = summary["accelerate_estimate_memory"]
    print(f"accelerate estimate-memory on the same cases: median |error| "
          f"{_percent(beside['median_abs_relative_error'])}, max {_percent(beside['max_abs_relative_error'])}, "
          f"{beside['cases_below_measured']} of {beside['cases']} below the measured peak")
    return 0 if all_exact else 1


def chosen_cases(cases: list[CalibrationCase], beginnings: list[str]) -> list[CalibrationCase]:
    """The first case whose name starts with each of ``beginnings``, in that order."""
    chosen = []
    for beginning in beginnings:
        matches = [case for case in cases if case.name.startswith(beginning.strip())]
        if not matches:
            raise SystemExit(f"--only: no case of this profile's grid starts with {beginning.strip()!r}; the "
                             f"cases: {', '.join(case.name for case in cases)}")
        chosen.append(matches[0])
    return chosen


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


if __name__ == "__main__":
    sys.exit(main())
