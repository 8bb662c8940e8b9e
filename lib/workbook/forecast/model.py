"""How long a job takes and what it costs: the job simulated from timings a pilot measured.

Pure arithmetic, no model: ``pilot`` measures the timings on the hardware at hand, this module
turns them into the whole job's wall time as the engine runs it (prompts sorted longest first, cut
into batches of the job's size; a static batch decodes until its longest output ends), with a
range, and projects the phases to the other profiles by the hardware ratio that governs each:
memory bandwidth for decode, compute for prefill and training steps::

    timings = GenerationTimings(...)            # from pilot.fit_generation
    result = simulate_generation(prompt_lengths, batch_size=32, timings=timings)
    result.seconds, result.batch_seconds        # the whole job; each batch, in run order
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbook import gpu
from workbook.hardware import Hardware
from workbook.paths import REFERENCE_DIR, REPO_ROOT
from workbook.recorded_forecast import FORECAST_SUFFIX, TRAINING_FILE_NAME

SECONDS_PER_HOUR = 3600.0
BOOTSTRAP_DRAWS = 200  # resamples of the pilot's output lengths behind the range
BOOTSTRAP_PROMPTS = 2_000_000  # prompts simulated over all the draws (at least 20): seconds for a large job
MINIMUM_SPREAD = 0.03  # the range is never narrower than +-3%: run-to-run noise of a shared machine


@dataclass
class OutputLengths:
    """Output lengths (tokens, end-of-sequence included) the pilot saw, per batch, with the
    longest prompt of that batch: a job batch draws from the pilot batch nearest in prompt length."""

    by_prompt_length: list[tuple[int, list[int]]]

    def nearest(self, prompt_tokens: int) -> list[int]:
        return min(self.by_prompt_length, key=lambda entry: abs(entry[0] - prompt_tokens))[1]

    def resampled(self, rng: random.Random) -> "OutputLengths":
        return OutputLengths([(length, rng.choices(outputs, k=len(outputs)))
                              for length, outputs in self.by_prompt_length])


def expected_longest(lengths: list[int], rows: int, cap: int) -> float:
    """Expected longest of ``rows`` draws from ``lengths`` (capped at ``cap``): the decode steps of
    a static batch, whose every row waits for its longest. E[max] = sum_k P(max >= k), summed per
    stretch between distinct lengths, where it stays the same (not per k: 2,048 new tokens)."""
    capped = sorted(min(length, cap) for length in lengths)
    total, previous = 0.0, 0
    for shorter, length in enumerate(capped):  # for k in (previous, length]: P(one draw < k) = shorter / n
        total += (length - previous) * (1 - (shorter / len(capped)) ** rows)
        previous = length
    return total


@dataclass
class GenerationTimings:
    """What one backend call costs, in seconds, as a pilot measured it."""

    prefill_fixed_seconds: float  # per call, whatever its size
    prefill_seconds_per_token: float  # per padded prompt position (rows x the batch's longest prompt)
    step_fixed_seconds: float  # per decode step of a full batch
    step_seconds_per_context_token: float  # per row x context position (attention over the KV cache)
    call_overhead_seconds: float  # per call beyond its forwards (padding, the last step's tail, finishing)
    write_seconds_per_output: float  # decoding the text and appending the record
    warm_up_seconds: float = 0.0  # the first forward's extra cost, paid once per process
    startup_seconds: float = 0.0  # interpreter, imports, model load, reading and tokenizing the prompts
    finish_seconds_per_output: float = 0.0  # merging, verifying and summarizing after the last batch
    exit_seconds: float = 0.0  # the process ending (a process holding torch takes a moment to exit)
    # Per row x longest prompt squared: attention over every pair of prompt positions. It is what makes a
    # long prompt's tokens dearer (measured on CPU, tiny model, 32 rows: 20 us a token at 20 tokens,
    # 32 us at 200); without it a fit through the pilot's total put the longest batches 20% low.
    prefill_seconds_per_token_pair: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationSimulation:
    seconds: float  # the whole job's wall time, start-up included
    batch_seconds: list[float]  # each batch, in run order (longest prompts first)
    prefill_seconds: float
    decode_seconds: float
    overhead_seconds: float  # start-up, warm-up, per-call overhead, writing and finishing
    decode_steps: float
    prefill_tokens: int  # padded prompt positions
    decode_context_positions: float = 0.0  # KV cache positions the decode steps read, over every row and step


def batch_plan(prompt_lengths: list[int], prompts_per_call: int) -> list[list[int]]:
    """The job's batches: prompt lengths sorted longest first, cut every ``prompts_per_call``
    (the engine's ``sort_longest_first`` and ``run_batches``)."""
    ordered = sorted(prompt_lengths, reverse=True)
    return [ordered[start:start + prompts_per_call] for start in range(0, len(ordered), prompts_per_call)]


def batch_seconds(rows: int, longest_prompt: int, steps: float, timings: GenerationTimings) -> tuple[float, float, float]:
    """(prefill, decode, overhead) seconds of one static call: one prefill over the padded prompts,
    then ``steps - 1`` decode steps (the prefill yields the first token) at a growing context."""
    prefill = (timings.prefill_fixed_seconds + timings.prefill_seconds_per_token * rows * longest_prompt
               + timings.prefill_seconds_per_token_pair * rows * longest_prompt ** 2)
    decode_steps = max(steps - 1, 0.0)
    decode = (decode_steps * timings.step_fixed_seconds
              + timings.step_seconds_per_context_token * rows * decode_contexts(longest_prompt, steps))
    overhead = timings.call_overhead_seconds + timings.write_seconds_per_output * rows
    return prefill, decode, overhead


def decode_contexts(longest_prompt: int, steps: float) -> float:
    """The positions one row attends over a static call's ``steps - 1`` decode steps (the prefill yields
    the first token), its context growing by one each step: the KV cache it reads."""
    decode_steps = max(steps - 1, 0.0)
    return decode_steps * longest_prompt + decode_steps * (decode_steps + 1) / 2


def simulate_generation(prompt_lengths: list[int], *, prompts_per_call: int, max_new_tokens: int,
                        timings: GenerationTimings, outputs: OutputLengths, processes: int = 1,
                        include_startup: bool = True) -> GenerationSimulation:
    """The job's wall time with these timings: every batch of the engine's plan, each decoding
    until the expected longest of its rows' outputs. With several processes each takes every
    ``processes``-th prompt of the sorted list (the job's split) and the wall time is the slowest."""
    per_process = [sorted(prompt_lengths, reverse=True)[rank::processes] for rank in range(processes)]
    slowest = None
    for lengths in per_process:
        prefill = decode = overhead = steps_total = contexts = 0.0
        tokens = 0
        seconds_each = []
        for batch in batch_plan(lengths, prompts_per_call):
            steps = expected_longest(outputs.nearest(batch[0]), len(batch), max_new_tokens)
            parts = batch_seconds(len(batch), batch[0], steps, timings)
            prefill, decode, overhead = prefill + parts[0], decode + parts[1], overhead + parts[2]
            seconds_each.append(sum(parts))
            steps_total += max(steps - 1, 0.0)  # decode steps: the prefill yields the first token
            tokens += len(batch) * batch[0]
            contexts += len(batch) * decode_contexts(batch[0], steps)
        fixed = timings.warm_up_seconds + timings.finish_seconds_per_output * len(prompt_lengths)
        fixed += timings.startup_seconds + timings.exit_seconds if include_startup else 0.0
        result = GenerationSimulation(prefill + decode + overhead + fixed, seconds_each, prefill, decode,
                                      overhead + fixed, steps_total, tokens, contexts)
        if slowest is None or result.seconds > slowest.seconds:
            slowest = result
    return slowest


def generation_range(prompt_lengths: list[int], *, prompts_per_call: int, max_new_tokens: int,
                     timings, outputs: OutputLengths, processes: int = 1,
                     fit_error: float = 0.0, seed: int = 0, simulate=None) -> tuple[float, float]:
    """(low, high) wall seconds: the 10th and 90th percentile over resamples of the pilot's output
    lengths (how long outputs run is the least known part), widened by the timing fit's
    relative error on the pilot's own batches and never narrower than MINIMUM_SPREAD.
    ``simulate``: the job's simulation (default ``simulate_generation``, static batches; a stream's
    is ``stream.simulate_stream``)."""
    simulate = simulate or simulate_generation
    rng = random.Random(seed)
    job = dict(prompts_per_call=prompts_per_call, max_new_tokens=max_new_tokens, timings=timings, processes=processes)
    count = max(20, min(BOOTSTRAP_DRAWS, BOOTSTRAP_PROMPTS // max(len(prompt_lengths), 1)))
    draws = sorted(simulate(prompt_lengths, outputs=outputs.resampled(rng), **job).seconds for _ in range(count))
    low, high = draws[len(draws) // 10], draws[(9 * len(draws)) // 10]
    middle = simulate(prompt_lengths, outputs=outputs, **job).seconds
    return widened(min(low, middle), max(high, middle), max(fit_error, MINIMUM_SPREAD))


def widened(low: float, high: float, spread: float) -> tuple[float, float]:
    """(low, high) widened by a relative error, as a factor either way: low / (1 + spread), never
    negative however wide the error (a busy host's pilot has fitted worse than 100%)."""
    return low / (1 + spread), high * (1 + spread)


def forecast_files(root: Path) -> list[Path]:
    """Every forecast `workbook forecast` wrote under ``root`` (beside outputs, in training folders),
    newest first."""
    found = list(root.rglob(f"*{FORECAST_SUFFIX}")) + list(root.rglob(TRAINING_FILE_NAME))
    return sorted((path for path in found if path.is_file()), key=lambda path: path.stat().st_mtime, reverse=True)


def forecast_points(root: Path) -> list[dict]:
    """Forecast against measured for every run under ``root`` that recorded both (a generation
    summary's or a training metrics file's ``forecast``): notebook 05's plot."""
    points = []
    for path in sorted(list(root.rglob("*.summary.json")) + list(root.rglob("training_metrics.json"))):
        try:
            recorded = json.loads(path.read_text()).get("forecast")
        except (OSError, ValueError):
            continue
        if recorded and recorded.get("measured_wall_seconds"):
            points.append({"run": str(path.relative_to(root)), "predicted_seconds": recorded["predicted_wall_seconds"],
                           "measured_seconds": recorded["measured_wall_seconds"],
                           "kind": "training" if path.name == "training_metrics.json" else "generation"})
    return points


# ----------------------------------------------------------------------------------------------
# Training: fixed costs plus steps at the planned micro-batch.


@dataclass
class TrainingTimings:
    startup_seconds: float  # interpreter, imports, reading, tokenizing and packing the data
    fixed_seconds: float  # model load, accuracy before/after, the first validation, one step's warm-up
    step_seconds: float  # one optimizer step at the planned micro-batch, steady state
    evaluation_seconds: float  # one validation pass
    save_seconds: float  # the final model
    exit_seconds: float = 0.0  # the process ending

    def to_dict(self) -> dict:
        return asdict(self)


def simulate_training(total_steps: int, evaluations: int, timings: TrainingTimings) -> float:
    """Wall seconds of a training run of ``total_steps`` with ``evaluations`` validation passes
    besides the one before the first step (counted in fixed_seconds)."""
    return (timings.startup_seconds + timings.fixed_seconds + total_steps * timings.step_seconds
            + evaluations * timings.evaluation_seconds + timings.save_seconds + timings.exit_seconds)


# ----------------------------------------------------------------------------------------------
# Cost and projection to the other profiles.


def cost(wall_seconds: float, hardware: Hardware, num_nodes: int = 1) -> dict:
    """GPU-hours and dollars of ``wall_seconds`` on ``num_nodes`` machines of a profile (its
    gpu_count GPUs each) at its usd_per_gpu_hour."""
    gpu_hours = wall_seconds / SECONDS_PER_HOUR * max(hardware.gpu_count, 0) * num_nodes
    return {"gpu_hours": round(gpu_hours, 4), "usd": round(gpu_hours * hardware.usd_per_gpu_hour, 4),
            "usd_per_gpu_hour": hardware.usd_per_gpu_hour}


@dataclass
class Phases:
    """A job's wall time by what bounds it: decode (memory bandwidth), compute (prefill, training
    steps) and the rest (start-up, per-call overhead, writing), which no peak governs."""

    decode_seconds: float
    compute_seconds: float
    other_seconds: float
    decode_bytes: float = 0.0  # bytes read by the decode steps (weights + KV cache), for the efficiency
    compute_flops: float = 0.0
    parallel: bool = True  # the phases split over data-parallel GPUs

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Peaks:
    """A machine's peaks: dense compute in FLOP/s at the job's dtype, memory bandwidth in bytes/s."""

    flops: float
    bytes_per_second: float
    source: str
    note: str = ""  # set when the compute peak is not the job's dtype's


def profile_peaks(hardware: Hardware, dtype: str) -> Peaks | None:
    """The spec-table peaks a profile states, or None when it states none (the cpu profile). Where
    the profile has no peak for ``dtype`` (fp32 always; bf16 on a V100), the job is projected at the
    16-bit peak it would run at there, and the source says so."""
    tflops, used = gpu.dense_peak_tflops(hardware, dtype), dtype
    for other in ("bf16", "fp16"):
        if not tflops:
            tflops, used = gpu.dense_peak_tflops(hardware, other), other
    if tflops <= 0 or hardware.memory_bandwidth_gbs <= 0:
        return None
    note = f"at {hardware.profile}'s {used} peak (it states none for {dtype})" if used != dtype else ""
    return Peaks(tflops * 1e12, hardware.memory_bandwidth_gbs * 1e9, f"params/{hardware.profile}.yaml", note)


def efficiencies(phases: Phases, peaks: Peaks) -> dict:
    """Achieved share of each peak: decode bytes/s over bandwidth, FLOP/s over compute."""
    return {"decode_bandwidth": phases.decode_bytes / phases.decode_seconds / peaks.bytes_per_second
            if phases.decode_seconds > 0 and phases.decode_bytes else None,
            "compute": phases.compute_flops / phases.compute_seconds / peaks.flops
            if phases.compute_seconds > 0 and phases.compute_flops else None}


def reference_efficiencies(profile_name: str, mode: str, root: Path = REFERENCE_DIR) -> dict | None:
    """Efficiencies a committed reference measured on that GPU, or None when there is none: the
    ``efficiency`` of a ``forecast.json`` under ``outputs/reference/<profile>/`` (a forecast's own
    --json, or the forecast check's median over its trials, which a GPU session leaves in a
    subfolder), the shallowest first. Training needs the compute share only, generation both."""
    folder = root / profile_name
    needed = ("compute",) if mode == "train" else ("decode_bandwidth", "compute")
    paths = sorted(folder.rglob("forecast.json"), key=lambda path: (len(path.parts), str(path))) if folder.is_dir() else []
    for path in paths:
        try:
            recorded = json.loads(path.read_text()).get("efficiency", {}).get(mode)
        except (OSError, ValueError, AttributeError):
            continue
        if recorded and all(recorded.get(key) for key in needed):
            return {**recorded, "file": str(path.relative_to(REPO_ROOT)) if REPO_ROOT in path.parents else str(path)}
    return None


def project(phases: Phases, here: Peaks, there: Peaks, gpus_there: int, processes_here: int,
            efficiency_there: dict | None = None) -> float:
    """Wall seconds on another machine: each phase scaled by the ratio of the peak that governs it
    (decode by bandwidth, compute by FLOP/s), at this machine's efficiency, or at the other
    machine's own measured efficiency when ``efficiency_there`` is given. Start-up and overheads
    are kept as measured; data-parallel phases split over the other machine's GPUs."""
    decode, compute = phases.decode_seconds, phases.compute_seconds
    if efficiency_there:
        decode = phases.decode_bytes / (there.bytes_per_second * efficiency_there["decode_bandwidth"]) if phases.decode_bytes else 0.0
        compute = phases.compute_flops / (there.flops * efficiency_there["compute"]) if phases.compute_flops else 0.0
    else:
        decode *= here.bytes_per_second / there.bytes_per_second
        compute *= here.flops / there.flops
    split = max(gpus_there, 1) / max(processes_here, 1) if phases.parallel else 1.0
    return phases.other_seconds + (decode + compute) / split


def profile_rows(phases: Phases, this_profile: str, dtype: str, here: Peaks, profiles: dict[str, Hardware],
                 wall_seconds: float, mode: str, processes_here: int = 1, num_nodes: int = 1) -> list[dict]:
    """One row per profile of ``profiles`` (each its machine): wall seconds, GPU-hours and dollars, and
    the basis of the number. ``this_profile``: the one the pilot ran on, in ``dtype``. Every profile runs
    the job on ``num_nodes`` machines of its gpu_count GPUs; ``processes_here``: the processes over all
    nodes that ``phases`` were simulated for."""
    rows = []
    for name, hardware in sorted(profiles.items()):
        if name == this_profile:
            seconds, basis = wall_seconds, "measured here (pilot)"
        else:
            there = profile_peaks(hardware, dtype)
            if there is None:
                rows.append({"profile": name, "wall_seconds": None, "usd": None, "gpu_hours": None,
                             "basis": "not projected: the profile states no peak compute or bandwidth"})
                continue
            reference = reference_efficiencies(name, mode)
            seconds = project(phases, here, there, hardware.gpu_count * num_nodes, processes_here, reference)
            basis = (f"projected from {name}'s committed reference ({reference['file']})"
                     if reference else f"projected from here ({this_profile}: {here.source}) by "
                     "bandwidth (decode) and compute (prefill, steps) ratios") + (f"; {there.note}" if there.note else "")
        rows.append({"profile": name, "wall_seconds": round(seconds, 2), **cost(seconds, hardware, num_nodes),
                     "basis": basis})
    return rows


def relative_error(predicted: list[float], measured: list[float]) -> float:
    """Largest |predicted - measured| / measured over pairs (0 when there are none)."""
    return max((abs(p - m) / m for p, m in zip(predicted, measured) if m > 0), default=0.0)


def round_floats(value, digits: int = 6):
    """``value`` with every float to ``digits`` significant digits (not decimals: a per-token time
    of 8e-05 s read back by the job's ETA must not become 0.0001)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: round_floats(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [round_floats(item, digits) for item in value]
    return value


@dataclass
class Forecast:
    """What ``workbook forecast`` prints (``to_dict``: its --json) and records beside the output."""

    mode: str
    profile: str
    predicted_wall_seconds: float
    predicted_wall_seconds_range: tuple[float, float]
    remaining_wall_seconds: float  # what the job still takes after the pilot (its outputs count)
    pilot: dict
    timings: dict
    job: dict
    cost: dict
    profiles: list[dict] = field(default_factory=list)
    efficiency: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    clock: str = "wall"  # seconds of: 'wall' (what a user waits for) or 'cpu' (this process's CPU time)
    network: dict = field(default_factory=dict)  # what crosses the network over num_nodes (planner.network)
    # The job's ETA plan, read back by the job (``eta.eta_plan``); generation only, empty for training.
    eta_plan: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return round_floats(asdict(self))
