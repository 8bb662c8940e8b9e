"""A lent GPU's results against every goal the workbook sets, in one table: what a session reports and
the README's reference section report, read from the files the session's calls wrote (``gpu_session``),
never typed in.

    workbook gpu-summary outputs/reference/h100       # writes SUMMARY.md there

It reads, anywhere under the folder: ``ceilings.json``, ``cuda_overhead.json``, ``memory_accuracy.json``
(the planner's accuracy), every ``benchmark.json`` (generation against the roofline and the seeds,
MFU, the memory settings, the seeds' claims), ``continuous_batching.json`` (continuous against static) and
``forecast.json`` (the forecast against its run). A goal none of them measured says so.

Below the goals, each planner case of ``memory_accuracy.json`` sets the plan, its tensors, the
fake-tensor trace of the same case and the measured peak (allocated, reserved, the device's) side by
side. The trace is hardware-independent, so it is made here, on this CPU, after the GPU's files came
back (no device time spent on it), and kept in ``trace_of_cases.json`` beside them: a later summary
traces only the cases it lacks (``--no-trace`` leaves the column empty).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workbook import notebook
from workbook.bench import published
from workbook.bench.claims import GOALS
from workbook.bench.report import failed_points
from workbook.bench.training_sweep import training_label
from workbook.planner import calibration, trace
from workbook.planner.profile import PlanSettings
from workbook.units import GiB

SUMMARY_FILE = "SUMMARY.md"
GOAL_AREAS = dict(zip(GOALS, ("reference", "reference", "reference", "lean training", "reference")))
CONTINUOUS_GOAL = 1.5  # continuous at least 1.5x static-sorted on uneven outputs, the same memory
FORECAST_GOAL = 0.10  # the forecast within 10% of the measured wall time
TRACE_FILE = "trace_of_cases.json"


def found(folder: Path) -> dict[str, list[tuple[str, dict]]]:
    """Every result file under ``folder`` by name, each with its path relative to the folder."""
    names = ("ceilings.json", "cuda_overhead.json", "memory_accuracy.json", "benchmark.json",
             "continuous_batching.json", "forecast.json")
    return {name: [(str(path.relative_to(folder)), json.loads(path.read_text()))
                   for path in sorted(folder.rglob(name))] for name in names}


def rows(files: dict[str, list[tuple[str, dict]]]) -> list[dict]:
    table = []

    def add(area: str, goal: str, measured: str, met: str, source: str) -> None:
        table.append({"area": area, "goal": goal, "measured": measured, "met": met, "source": source})

    for source, record in files["ceilings.json"]:
        measured, sheet = record["measured"], record["datasheet"]
        add("reference", "measured ceilings beside the datasheet", f"copy {measured['copy_gb_per_second']:,.0f} GB/s "
            f"({_share(sheet['copy_share_of_datasheet'])} of the datasheet), bf16 matmul "
            f"{measured['matmul_tflops']:,.0f} TFLOP/s ({_share(sheet['matmul_share_of_datasheet'])})", "n/a (a fact)",
            source)
    for source, record in files["cuda_overhead.json"]:
        add("reference", "CUDA context constant measured by its own probe", f"{record['overhead_bytes'] / GiB:.2f} GiB "
            f"({record['hardware_name']})", "measured", source)
    for source, record in files["memory_accuracy.json"]:
        summary = record["summary"]
        add("reference", "planner: median |error| <= 1.5%, max <= 4%, no case the planner says fits runs out of memory",
            f"median {_share(summary['median_abs_relative_error'], 2)}, max {_share(summary['max_abs_relative_error'], 2)}"
            f" over {summary['counted_toward_goal']} cases ({len(record.get('cases', []))} of {record.get('cases_planned', '?')} run, "
            f"{len(summary.get('failed', []))} failed); out of memory: {len(summary['out_of_memory'])}; context "
            f"term: {record.get('cuda_context_term', 'each case its own')}", "yes" if summary["meets_goal"] else "no",
            source)
    goals, claims = {goal: [] for goal in GOALS}, {}
    for source, record in files["benchmark.json"]:
        if failed := failed_points(record):  # a path that broke on this GPU: what to fix before the next session
            add("reference", "every benchmark point runs", f"{len(failed)} failed: {'; '.join(failed)}"[:1000], "no", source)
    for source, record in files["benchmark.json"]:
        for row in record["goals"]:
            goals.setdefault(row["goal"], []).append((row, source))
        for row in record["claims"]:
            if not row["measured"].startswith("not measur") or row["claim"] not in claims:
                claims[row["claim"]] = (row, source)
    for source, record in files["benchmark.json"]:
        if beside := _peaks_beside_plans(record):
            add("reference", "peak memory beside the plan, every benchmark point", "; ".join(beside)[:1500],
                "n/a (a fact)", source)
    for goal in GOALS:
        # Each benchmark that measured the goal has its row (the sweeps differ: 1B, 8B LoRA, tiny smoke);
        # none: the last one's reason, or that none of them had the goal.
        measured = [(row, source) for row, source in goals[goal] if row["met"] != "n/a"]
        fallback = goals[goal][-1:] or [({"measured": "not measured in this session", "met": "n/a"}, "")]
        for row, source in measured or fallback:
            add(GOAL_AREAS[goal], goal, row["measured"], row["met"], source)
    for (row, source) in claims.values():
        add("reference", f"seed {row['seed']}: {row['claim']}", row["measured"], "n/a (a claim)", source)
    for source, record in files["continuous_batching.json"]:
        for result in record["results"]:
            fractions = result.get("roofline_fraction") or result.get("bandwidth_roofline_fraction") or {}  # before 11-24
            best = max(filter(None, fractions.values()), default=None)
            ratio = result["continuous_vs_static"]
            basis = "this GPU's measured ceilings" if "(--bandwidth-gbs)" in str(record.get("roofline")) else "the datasheet"
            add("continuous batching", f"continuous >= {CONTINUOUS_GOAL}x static-sorted at the same memory ({result['workload']} outputs)",
                f"{'not measured (the time budget ran out first)' if ratio is None else f'{ratio}x'}; batches "
                f"{result['batch_size']}; best fraction of the roofline {_share(best)} (at {basis}); peak beside "
                f"the plan: {_arm_peaks(result) or 'not recorded'}; continuous ran "
                f"attention {result.get('continuous_attention') or 'not recorded'}",
                "n/a (the goal is on uneven outputs)" if result["workload"] != "uneven" else
                "n/a" if ratio is None else "yes" if ratio >= CONTINUOUS_GOAL else "no", source)
    for source, record in files["forecast.json"]:
        for case in record["cases"]:
            wall = case.get("wall") or {}
            error = wall.get("median_error")
            add("forecast", f"forecast from a pilot within {FORECAST_GOAL:.0%} of the measured wall time: {case['case']}",
                "not finished" if error is None else f"{error:+.1%} (median of {len(wall['errors'])})",
                "n/a" if error is None else ("yes" if abs(error) <= FORECAST_GOAL else "no"), source)
    return table


def _arm_peaks(result: dict) -> str:
    peaks, plans = result.get("peak_memory_bytes") or {}, result.get("planned_bytes") or {}
    return ", ".join(f"{arm} {peaks[arm] / GiB:.1f} GiB (plan {plans[arm] / GiB:.1f})"
                     for arm in peaks if peaks[arm] and plans.get(arm))


def call_steps(folder: Path) -> list[dict]:
    """Every step of the calls whose record (``<call>.json``: a call, its steps) lies in ``folder``: what ran,
    what a budget cut and what was skipped, beside the figures it left."""
    table = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and "call" in record and isinstance(record.get("steps"), list):
            table += [{"call": record["call"], "step": step["step"], "status": step["status"],
                       "seconds": f"{step['seconds']:.0f}"} for step in record["steps"]]
    return table


def _peaks_beside_plans(record: dict) -> list[str]:
    """'<point>: peak X GiB, plan Y GiB (+z%)' of every benchmark point that has both."""
    lines = []
    for sweep in ("generation", "training"):
        for point in (record.get(sweep) or {}).get("points", []):
            peak, planned = point.get("peak_memory_bytes"), point.get("predicted_peak_bytes")
            if peak and planned:
                label = (f"{point['strategy']} batch {point['batch_size']}" if sweep == "generation"
                         else f"training {training_label(point)}")
                lines.append(f"{label}: peak {peak / GiB:.1f} GiB, plan {planned / GiB:.1f} GiB "
                             f"({(planned - peak) / peak:+.1%})")
    return lines


def case_trace(case: dict) -> dict:
    """The fake-tensor trace (``planner.trace``) of one calibration case (its ``CalibrationCase`` dict), run
    as the case runs on the GPU: bf16 weights, no autocast, the calibration's attention; training rows of
    ``seq_len`` tokens, unpacked, every token carrying loss, AdamW fused as on a GPU. ``{"error": ...}``
    where the step cannot run on fake tensors."""
    try:
        if case["mode"] == "generate":
            traced = trace.trace_generation(case["model"], batch_size=case["batch_size"], prompt_len=case["prompt_len"],
                                            new_tokens=case["new_tokens"], dtype=calibration.DTYPE, backend="static",
                                            attn_implementation=calibration.ATTN_IMPLEMENTATION)
        else:
            config = trace.train_config(PlanSettings(
                model=case["model"], seq_len=case["seq_len"], padding="length_grouped", dtype=calibration.DTYPE,
                precision="bf16", lora_rank=case["lora_rank"], grad_checkpointing=case["grad_checkpointing"],
                attn_implementation=calibration.ATTN_IMPLEMENTATION), case["batch_size"])
            traced = trace.trace_training(config, on_gpu=True)
    except trace.TraceError as error:
        return {"error": str(error)}
    return traced.to_dict()


def case_traces(folder: Path, records: list[dict], log=print) -> dict[str, dict]:
    """The trace of every case in ``records`` (memory_accuracy.json's), by case name: those already in
    ``<folder>/trace_of_cases.json`` for the same case are kept, the others traced and added."""
    path = folder / TRACE_FILE
    kept = json.loads(path.read_text()) if path.is_file() else {}
    for record in records:
        case = record["case"]
        if kept.get(case["name"], {}).get("case") != case:
            log(f"tracing {case['name']} on fake tensors (CPU)")
            kept[case["name"]] = {"case": case, "trace": case_trace(case)}
            path.write_text(json.dumps(kept, indent=2) + "\n")  # each one kept as it is made
    return {name: entry["trace"] for name, entry in kept.items()}


def planner_case_rows(record: dict, traces: dict[str, dict]) -> list[dict]:
    """One row per case of a memory_accuracy.json: plan, its tensors, the trace, the measured peaks, errors."""
    rows_out = []
    for case in record.get("cases", []):
        name = case["case"]["name"]
        traced = traces.get(name) or {}
        allocated = case.get("measured_allocated_bytes")
        tensors = case.get("predicted_tensor_bytes")
        peak = traced.get("peak_bytes")
        rows_out.append({
            "case": name, "status": case["status"],
            "plan (GiB)": _gib(case.get("predicted_bytes")), "plan's tensors": _gib(tensors),
            "trace (tensors)": (f"{_gib(peak)} in {traced['phase']}" if peak else
                                traced.get("error", "not traced")[:120]),
            "measured allocated": _gib(allocated),
            "measured reserved": _gib((case.get("measurement") or {}).get("peak_reserved_bytes")),
            "measured device peak": _gib(case.get("measured_bytes")),
            "plan vs device peak": _signed(case.get("relative_error")),
            "plan's tensors vs allocated": _signed(case.get("tensor_relative_error")),
            "trace vs allocated": _signed(peak and allocated and (peak - allocated) / allocated),
        })
    return rows_out


def markdown(folder: Path, table: list[dict], files: dict, traces: dict[str, dict] | None = None) -> str:
    hardware = next((record["hardware"] for records in files.values() for _, record in records
                     if isinstance(record.get("hardware"), dict)), None)
    cases = []
    for source, record in files["memory_accuracy.json"]:
        if record.get("cases"):
            cases += [f"## The planner against the measured peak, case by case ({source})", "",
                      "Bytes in GiB. The plan's tensors and the trace leave out the CUDA context and the allocator's "
                      "rounding, so they stand beside the allocated peak; the whole plan stands beside the device's "
                      "peak (reserved + memory outside PyTorch). The trace ran here, on fake tensors "
                      f"(`{TRACE_FILE}`).", "", notebook.markdown_table(planner_case_rows(record, traces or {})), ""]
    return "\n".join([
        f"# {folder.name}: the GPU session's figures against the workbook's goals", "",
        f"Hardware: {_hardware_text(hardware)}", "",
        "Each row comes from the file in its source column (`workbook gpu-summary "
        f"{folder}` rewrites this page).", "", notebook.markdown_table(table), "", *cases,
        *(["## The calls' steps", "", notebook.markdown_table(steps), ""] if (steps := call_steps(folder)) else []),
        published.vllm_line(), ""])


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GiB:.2f}"


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def _hardware_text(hardware: dict | None) -> str:
    if not hardware:
        return "not recorded"
    versions = ", ".join(f"{name} {version}" for name, version in (hardware.get("versions") or {}).items() if version)
    gpus = hardware.get("gpus") or []
    machine = (f"{len(gpus)} x {gpus[0].get('name')}, driver {hardware.get('driver_version')}" if gpus else
               f"no GPU; CPU {hardware['cpu']['model']}, {hardware['cpu']['logical_cores']} logical cores")
    return f"{machine}; {versions}" if versions else machine


def _share(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook gpu-summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a GPU session's results, e.g. outputs/reference/h100")
    parser.add_argument("--no-trace", action="store_true", help=f"trace no planner case here (those already in "
                        f"{TRACE_FILE} are still shown)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    files = found(folder)
    if not any(files.values()):
        print(f"error: {folder} holds none of {', '.join(files)}")
        return 2
    traces = {}
    for _, record in files["memory_accuracy.json"]:
        measured = [case for case in record.get("cases", []) if case["status"] in ("measured", "oom")]
        traces.update(case_traces(folder, [] if args.no_trace else measured))
    text = markdown(folder, rows(files), files, traces)
    (folder / SUMMARY_FILE).write_text(text)
    print(text + f"\nwrote {folder / SUMMARY_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
