"""The pilot: a few of the job's own batches, run on this machine and timed, whose outputs the job
keeps; ``forecast`` turns what they measured into the whole job's time and cost.

Generation: the job's batches (length-sorted, at its batch size) are picked evenly across the
length distribution, not the first lines of the file; each runs through the job's own code into
the job's output file, so the job's resume skips them (nothing is generated twice). Forward hooks
time every model call: the prefill against padded prompt tokens, each decode step against batch
and context; the outputs give the lengths reached at end of sequence. Training: the first steps
of the run at the planned micro-batch, in a scratch folder. The pilot's share of the job is
bounded (``share`` of its batches or steps, and ``seconds``)::

    result = forecast_generation(params, share=0.1)     # a forecast.Forecast
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from workbook import ceilings, decoding, job_keys, runtime
from workbook.forecast import eta, model as forecast, regression, startup, stream as stream_forecast, training_steps
from workbook.forecast.forward_timer import ForwardTimer
from workbook.forecast.model import GenerationTimings, OutputLengths, Phases, Peaks
from workbook.forecast.settings import profiles_hardware
from workbook.generation import job
from workbook.generation.engine import in_batches, sort_longest_first
from workbook.generation.files import OutputFiles, lock_output, resolve_output_path
from workbook.generation.inputs import read_inputs
from workbook.generation.settings import GenerationSettings
from workbook.hardware import Hardware
from workbook.paths import OUTPUTS_DIR
from workbook.planner import profile
from workbook.planner.formulas import kv_cache_bytes_per_token
from workbook.training import batches, config as training_config
from workbook.training.loop import EVAL_POINTS
from workbook.training.prepare import prepare_data
from workbook.training.run_plan import plan_run

PARAMS_USED = job_keys.FORECAST
DEFAULT_SHARE = 0.1  # the pilot runs at most this share of the job's batches (training: steps), at least one
WARM_UP_NEW_TOKENS = 2  # the warm-up's generation: a prefill and one decode step at the pilot's first shape
# What the forecast predicts: wall seconds (what a user waits and pays for), or this process's CPU
# seconds (user + system), which a machine shared with other work does not stretch: with one thread
# per process (OMP_NUM_THREADS=1) they equal the wall time of the same run on an idle machine.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclasses.dataclass
class Call:
    """One backend call of the pilot: its prompts' shape, its forwards and outputs."""

    rows: int
    longest_prompt: int
    seconds: float
    forwards: list[tuple[float, float, int]]  # (start, end, context positions) per model call
    output_lengths: list[int]
    written_seconds: float = 0.0  # the call plus writing its records (the engine's batch time)


def pick_batches(batches: list[list], share: float) -> list[int]:
    """Indices of the pilot's batches: ``share`` of the full ones (at least one), spread evenly
    over the length-sorted list so that long, middle and short prompts are all timed."""
    full = [i for i, batch in enumerate(batches) if len(batch) == len(batches[0])] or [0]
    count = max(1, min(len(full), math.floor(share * len(batches))))
    return sorted({full[math.floor((i + 0.5) * len(full) / count)] for i in range(count)})


def fit_generation(calls: list[Call], warm_up_seconds: float, startup_seconds: float) -> tuple[GenerationTimings, float]:
    """Timings from the pilot's calls, and the largest relative error of the fitted model on them."""
    prefill_shapes, prefill_y, step_x, step_y = [], [], [], []
    for call in calls:
        starts = [start for start, _, _ in call.forwards]
        if len(starts) > 1:
            prefill_shapes.append((call.rows, call.longest_prompt))
            prefill_y.append(starts[1] - starts[0])
        for (start, _, context), following in zip(call.forwards[1:], starts[2:]):
            step_x.append(call.rows * context)
            step_y.append(following - start)
    # One distinct prefill size: its time is per token (what scales); one distinct context: a step's
    # time is fixed (reading the weights, launching the kernels).
    prefill_fixed, prefill_slope, prefill_pair = fit_prefill(prefill_shapes, prefill_y)
    step_fixed, step_slope = regression.fit_line(step_x, step_y, single="intercept") if step_x else (0.0, 0.0)
    timings = GenerationTimings(prefill_fixed, prefill_slope, step_fixed, step_slope, 0.0, 0.0,
                                warm_up_seconds, startup_seconds, prefill_seconds_per_token_pair=prefill_pair)
    modelled = [sum(forecast.batch_seconds(c.rows, c.longest_prompt, max(c.output_lengths, default=0), timings)[:2])
                for c in calls]
    timings.call_overhead_seconds = max(statistics.fmean(c.seconds - m for c, m in zip(calls, modelled)), 0.0)
    timings.write_seconds_per_output = max(statistics.fmean((c.written_seconds - c.seconds) / c.rows for c in calls), 0.0)
    predicted = [sum(forecast.batch_seconds(c.rows, c.longest_prompt, max(c.output_lengths, default=0), timings))
                 for c in calls]
    return timings, forecast.relative_error(predicted, [c.written_seconds for c in calls])


def fit_prefill(shapes: list[tuple[int, int]], seconds: list[float]) -> tuple[float, float, float]:
    """(fixed, per token, per token pair) prefill seconds from (rows, longest prompt) shapes. Three
    prompt lengths or more tell the pairs' (attention's) cost from the tokens'; fewer fit a line."""
    if len({length for _, length in shapes}) < 3:
        fixed, per_token = regression.fit_line([rows * length for rows, length in shapes], seconds,
                                             single="slope") if shapes else (0.0, 0.0)
        return fixed, per_token, 0.0
    columns = [[1.0] * len(shapes), [float(rows * length) for rows, length in shapes],
               [float(rows * length ** 2) for rows, length in shapes]]
    fixed, per_token, per_pair = regression.fit_nonnegative(columns, seconds)
    return fixed, per_token, per_pair


def warm_up(model, device: torch.device, token_id: int, rows: int, length: int,
            clock: Callable[[], float] = time.perf_counter, call: Callable[[], object] | None = None) -> float:
    """The first call's extra cost over a steady one, at the pilot's first (largest) batch shape,
    ``rows`` x ``length`` tokens: the job pays it once, in its first batch. A warm-up at a smaller
    shape leaves the pilot's first batch to grow the allocator and caches (measured on CPU: its
    prefill 18% slower than the same batch warm), which the fit would spread over every batch.
    ``call``: a short generation of that batch through the job's backend instead of a bare forward, so
    that the decode step's kernels are loaded too (a GPU's pilot may be one batch, whose first decode
    steps would otherwise carry them into the fitted cost of every batch)."""
    if call is None:
        ids = torch.full((max(rows, 1), max(length, 1)), token_id, dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        mask[0, 0] = 0  # one left-padded row: the masked attention path the job's padded batches take
        # Logits of the last position only, as generate() asks: all of them could outgrow the GPU.
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

        def call():
            return model(input_ids=ids, attention_mask=mask, **keep)
    seconds = []
    with torch.no_grad():
        for _ in range(2):
            runtime.synchronize(device)
            began = clock()
            call()
            runtime.synchronize(device)
            seconds.append(clock() - began)
    return max(seconds[0] - seconds[1], 0.0)


def host_peaks(device: torch.device) -> Peaks:
    """This machine's achievable peaks, measured (a profile without spec peaks: the cpu one): an fp32
    2048^3 matmul for compute and a 128 MiB copy (read + write) for bandwidth, best of 3."""
    measured = ceilings.measure(device, dtype=torch.float32, copy_bytes=128 * 2 ** 20, matmul_size=2048, repeats=3)
    return Peaks(measured.matmul_flops_per_second, measured.copy_bytes_per_second, measured.how)


def forecast_generation(params, *, share: float = DEFAULT_SHARE, seconds: float | None = None,
                        log: Callable[[str], None] = print, model=None, tokenizer=None,
                        clock: str = "wall") -> forecast.Forecast:
    """Forecast a generation job from a pilot of its own batches on this machine. The pilot's
    outputs go into the job's output (its ``output_path``, which must be set): the job's resume skips
    them. ``model``/``tokenizer`` preloaded skip loading the job's model (tests). The entry: the params
    become the job's settings, this machine's hardware and every profile's, here."""

    entered = startup.seconds_so_far(clock)
    settings = GenerationSettings.from_params(params)  # the job's own settings, as run_job builds them
    hardware, profiles = Hardware.from_params(params), profiles_hardware(params)
    files = OutputFiles(resolve_output_path(settings.output_path, None))  # where the job writes
    rank = job.Rank(0, 1, runtime.default_device())
    with lock_output(files):
        inputs = read_inputs(settings, files, record_skipped=False)
        share_ = job.prepare_share(settings, inputs, files, rank, model=model, tokenizer=tokenizer, log=log)
        model, backend, samples = share_.model, share_.backend, settings.samples_per_prompt
        context = decoding.context_length(model)
        # The whole job as a fresh run: every candidate whose prompt leaves room to generate.
        every = [len(share_.token_ids[i]) for i in range(len(share_.examples)) for _ in range(samples)
                 if not context or len(share_.token_ids[i]) < context]
        pending = in_batches(sort_longest_first(share_.prompts), backend.prompts_per_call)  # the engine's batches
        chosen = pick_batches(pending, share) if pending else []
        before_pilot = startup.seconds_so_far(clock)
        first = pending[chosen[0]] if chosen else []
        # A streaming backend (continuous) runs the chosen batches' prompts as one stream, as the job does.
        streaming = callable(getattr(backend, "stream", None)) and bool(chosen)
        short = [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, WARM_UP_NEW_TOKENS)) for p in first]
        warm_up_seconds = warm_up(model, rank.device, share_.settings.pad_token_id, len(first),
                                  max((len(p.token_ids) for p in first), default=1), CLOCKS[clock],
                                  call=(lambda: backend.generate(short)) if first and not streaming else None)
        pilot_began = time.perf_counter()
        if streaming:
            stream = stream_forecast.run_stream_pilot(settings, share_, files, rank, [pending[i] for i in chosen], log,
                                                      CLOCKS[clock])
        else:
            calls = run_pilot(settings, share_, files, rank, [pending[i] for i in chosen], seconds, log, CLOCKS[clock])
        pilot_seconds = time.perf_counter() - pilot_began
    piloted_batches = len(chosen) if streaming else len(calls)
    if not piloted_batches:
        raise job.GenerationError(f"nothing left to generate in {files.output}: the job is done, so there is "
                                  "nothing to forecast (point output_path at a new file to forecast a fresh run)")
    fresh = startup.fresh_process("workbook.generation.job")
    job_start = startup.job_startup(clock, entered, before_pilot, fresh)
    if streaming:
        timings, fit_error, timed_how = stream_forecast.fit_stream(stream, backend.prompts_per_call, warm_up_seconds, job_start)
        outputs, rows, simulate_job = OutputLengths(stream.groups), len(stream.requests), stream_forecast.simulate_stream
    else:
        timings, fit_error = fit_generation(calls, warm_up_seconds, job_start)
        timed_how = f"{sum(len(c.forwards) for c in calls)} forwards timed by forward hooks over {len(calls)} static calls"
        outputs, rows, simulate_job = (OutputLengths([(c.longest_prompt, c.output_lengths) for c in calls]),
                                       sum(c.rows for c in calls), forecast.simulate_generation)
    timings.exit_seconds = startup.job_exit(clock, fresh)
    processes = settings.data_parallel_processes * hardware.num_nodes  # the job's global split, every node's
    simulate = dict(prompts_per_call=backend.prompts_per_call, max_new_tokens=settings.max_new_tokens,
                    timings=timings, outputs=outputs, processes=processes)
    whole = simulate_job(every, **simulate)
    low, high = forecast.generation_range(every, fit_error=fit_error, simulate=simulate_job, **simulate)
    piloted = {(p.index, p.sample) for i in chosen[:piloted_batches] for p in pending[i]}
    left_prompts = [p for p in share_.prompts if (p.index, p.sample) not in piloted]
    left = [len(p.token_ids) for p in left_prompts]
    remaining = simulate_job(left, **simulate).seconds if left else 0.0
    phases = generation_phases(model, settings.dtype, whole)
    network = profile.plan(settings.profile_params, mode="generate").network
    made = _assemble("generate", hardware, settings.dtype, profiles, network, whole.seconds, (low, high), remaining,
                     phases, timings.to_dict(), rank.device, {
        "batches": piloted_batches, "prompts": rows, "seconds": pilot_seconds, "timed": timed_how,
        "share_of_job_batches": piloted_batches / max(len(forecast.batch_plan(every, backend.prompts_per_call)), 1),
        "batch_indices": chosen[:piloted_batches], "written_to": str(files.output),
        "fit_error": fit_error, "output_lengths": outputs.by_prompt_length,
        "fresh_process": startup.record(fresh, entered),
    }, {"prompts": len(every), "batches": len(whole.batch_seconds), "batch_size": share_.batch_size,
        "backend": backend.name, "model": settings.model, "prompt_tokens": {
            "min": min(every), "median": statistics.median(every), "max": max(every)},
        "max_new_tokens": settings.max_new_tokens, "processes": processes,
        "batch_seconds_planned": whole.batch_seconds}, clock)
    # The job run next plans its ETA by this model: its batches (as the engine cuts what is left) priced here.
    left_batches = in_batches(sort_longest_first(left_prompts), backend.prompts_per_call)
    made.eta_plan = (eta.eta_plan(left_batches, eta.planned_batch_seconds(made.to_dict())(left_batches))
                     if left_batches else {})
    return made


def run_pilot(settings, share_, files, rank, batches: list[list], seconds: float | None, log,
              clock: Callable[[], float] = time.perf_counter) -> list[Call]:
    """Generate ``batches`` through the job's own writer, timing each call; stops early once the
    pilot has run ``seconds`` (after at least one batch)."""
    timer = ForwardTimer(share_.model, rank.device, clock)
    backend, calls, began = share_.backend, [], time.perf_counter()
    original = backend.generate

    def timed(prompts):
        first, call_began = len(timer.events), clock()
        output = original(prompts)
        calls.append(Call(len(prompts), max(len(p.token_ids) for p in prompts), clock() - call_began,
                          timer.events[first:], [len(c.token_ids) for c in output.completions]))
        return output

    backend.generate = timed
    try:
        for batch in batches:
            if seconds is not None and calls and time.perf_counter() - began >= seconds:
                log(f"pilot: stopped after {len(calls)} batches ({seconds:g} s budget)")
                break
            done, batch_began = len(calls), clock()
            job.generate_share(settings, dataclasses.replace(share_, prompts=batch, bad_lines=[], too_long=[]),
                               files, rank, log=lambda line: None, show_progress=False)
            if len(calls) != done + 1:  # a split (out of memory) is not the job's steady state
                raise job.GenerationError("the pilot's batch was split (out of memory or an error): lower "
                                          "batch_size so the forecast times the batches the job will run")
            calls[-1].written_seconds = clock() - batch_began
    finally:
        backend.generate = original
        timer.remove()
    return calls


def generation_phases(model, dtype: str, whole: forecast.GenerationSimulation) -> Phases:
    """The simulated job by what bounds each part: decode steps read every weight once and each row's
    KV cache (at an 8B model's planned batch on an 80 GB GPU the cache read outweighs the weights), the
    prefill costs 2 FLOPs per multiplied weight per token."""
    # An untied input embedding is gathered a row per token, not streamed or multiplied (as the bench counts).
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    gathered = 0 if head is not None and head.weight is embedding else embedding.numel()
    parameters = sum(p.numel() for p in model.parameters()) - gathered
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - gathered * embedding.element_size()
    kv_bytes = whole.decode_context_positions * kv_cache_bytes_per_token(model.config, dtype)
    return Phases(decode_seconds=whole.decode_seconds, compute_seconds=whole.prefill_seconds,
                  other_seconds=whole.overhead_seconds, decode_bytes=whole.decode_steps * weight_bytes + kv_bytes,
                  compute_flops=2.0 * parameters * whole.prefill_tokens)


def _assemble(mode, hardware: Hardware, dtype: str, profiles: dict[str, Hardware], network: dict, wall, wall_range,
              remaining, phases: Phases, timings, device, pilot, job_facts, clock: str = "wall") -> forecast.Forecast:
    """The forecast from what the pilot measured on ``hardware`` (the job in ``dtype``), projected to
    every profile of ``profiles`` (this run's own among them, its --set included); ``network``: the
    planner's account of what crosses the network between the job's nodes."""
    here = forecast.profile_peaks(hardware, dtype) or host_peaks(device)
    rows = forecast.profile_rows(phases, hardware.profile, dtype, here, profiles, wall, mode,
                                 processes_here=job_facts.get("processes", 1), num_nodes=hardware.num_nodes)
    notes = [f"not in the time: the network ({network['explanation']}); the profiles state no network bandwidth"
             ] if hardware.num_nodes > 1 and network["network_bytes_per_node_per_step"] else []
    fresh = pilot.get("fresh_process", {})
    if clock == "wall" and fresh.get("measured") and fresh["this_process_start_seconds"] > 2 * fresh["startup_seconds"] + 1:
        notes.append(f"this process took {fresh['this_process_start_seconds']:.1f} s to start and a fresh one "
                     f"{fresh['startup_seconds']:.1f} s after it (a cold disk cache: the first command on this machine); "
                     "the forecast counts the second, as the job run next will find the cache")
    notes += ["projections keep start-up and per-call overheads as measured here and scale only the decode "
             "(bandwidth) and compute phases; a small model on a CPU is overhead-bound, so its projections "
             "understate GPU overheads"] if not forecast.profile_peaks(hardware, dtype) else []
    return forecast.Forecast(
        mode=mode, profile=hardware.profile, predicted_wall_seconds=wall, predicted_wall_seconds_range=wall_range,
        remaining_wall_seconds=remaining, pilot=pilot, timings=timings, job=job_facts,
        cost=forecast.cost(wall, hardware, hardware.num_nodes), profiles=rows, network=network,
        efficiency={mode: forecast.efficiencies(phases, here), "peaks": dataclasses.asdict(here),
                    "phases": phases.to_dict()}, notes=notes, clock=clock)


def forecast_training(params, *, share: float = DEFAULT_SHARE, seconds: float | None = None,
                      log: Callable[[str], None] = print, clock: str = "wall") -> forecast.Forecast:
    """Forecast a training run from a pilot of its own steps drawn across the run (``training_steps``:
    every epoch it spans, in pairs), run by the training loop itself at the planned micro-batch in a
    scratch folder (the pilot's steps are not reused by the run); every step of the run, timed or
    not, is then priced by what it holds. The loop times its steps on the wall clock; with
    ``clock='cpu'`` every time is converted by the pilot's CPU/wall ratio."""
    entered = startup.seconds_so_far(clock)
    hardware, profiles = Hardware.from_params(params), profiles_hardware(params)
    with tempfile.TemporaryDirectory(prefix="forecast-") as scratch:
        config = training_config.config_from_params(params, scratch)
        prepared = prepare_data(config, log=log)
        # The run over every node: the same micro-batches and accumulation per process, so more
        # processes make a larger effective batch and (by epochs) fewer steps. The pilot runs on this
        # node alone, so its steps are those of a run over this node's processes.
        run = plan_run(config, prepared, processes=config.processes * hardware.num_nodes)
        here = plan_run(config, prepared) if hardware.num_nodes > 1 else run
        lengths = [example.length for example in prepared.train]
        rows = batches.plan_rows(lengths, config.padding, prepared.max_seq_length)
        contents = training_steps.run_step_contents(rows, lengths, config.padding, run, config.seed)
        contents_here = (training_steps.run_step_contents(rows, lengths, config.padding, here, config.seed)
                         if here is not run else contents)
        chosen = training_steps.pick_steps(here.total_steps, here.steps_per_epoch,
                                           max(2, math.floor(share * run.total_steps)))
        before_pilot = startup.seconds_so_far(clock)
        pilot_config = dataclasses.replace(config, run_only_steps=tuple(chosen), output_dir=str(Path(scratch) / "pilot"),
                                           save_every_steps=0)
        result, pilot_seconds, cpu_per_wall = training_steps.run_alone(pilot_config, prepared)
        to_clock = cpu_per_wall if clock == "cpu" else 1.0
    history = [{**r, "seconds": r["seconds"] * to_clock} for r in result["history"]]
    measured = [r["seconds"] for r in history]  # history[i] is step chosen[i]
    # A step that starts an epoch's loader carries the loader's start (the first, the warm-up too), in
    # the run as here: the model is fitted to the others, as the run's steps are compared without them.
    starts = training_steps.loader_starts(chosen, here.steps_per_epoch)
    steady = [i for i, start in enumerate(starts) if not start] or list(range(len(chosen)))
    model = training_steps.fit([contents_here[chosen[i]] for i in steady], [measured[i] for i in steady])
    later_starts = [measured[i] - model.seconds(contents_here[chosen[i]]) for i, start in enumerate(starts) if start][1:]
    loader_start_seconds = max(statistics.fmean(later_starts), 0.0) if later_starts else 0.0
    planned = [model.seconds(content) for content in contents]  # every step of the run, by what it holds
    epochs = math.ceil(run.total_steps / run.steps_per_epoch)
    steps_part = sum(planned) + loader_start_seconds * (epochs - 1)
    step_seconds = steps_part / run.total_steps
    tokens_per_step = statistics.fmean(content.tokens for content in contents) * run.processes  # every process's
    validation_tokens = sum(example.length for example in prepared.validation)
    # A validation pass is forward only: a third of a step's FLOPs (2N of 6N) per token.
    evaluation_seconds = step_seconds * validation_tokens / max(tokens_per_step, 1) / 3
    eval_every = max(1, math.ceil(run.total_steps / EVAL_POINTS))
    evaluations = (run.total_steps // eval_every + (1 if run.total_steps % eval_every else 0)) if validation_tokens else 0
    pilot_every = max(1, math.ceil(here.total_steps / EVAL_POINTS))
    pilot_evaluations = sum((step + 1) % pilot_every == 0 for step in chosen) if validation_tokens else 0
    # What the pilot's run spent besides its steps, as priced, and its evaluations: model load, accuracy
    # before and after, the first validation, the first step's warm-up.
    fixed = (result["time"]["wall_seconds"] * to_clock - sum(model.seconds(contents_here[step]) for step in chosen)
             - loader_start_seconds * max(sum(starts) - 1, 0) - pilot_evaluations * evaluation_seconds)
    save_seconds = _save_seconds(result["parameters"], config.dtype)
    fresh = startup.fresh_process("workbook.training.loop")
    timings = forecast.TrainingTimings(startup.job_startup(clock, entered, before_pilot, fresh), max(fixed, 0.0), step_seconds,
                                       evaluation_seconds, save_seconds, startup.job_exit(clock, fresh))
    wall = forecast.simulate_training(run.total_steps, evaluations, timings)
    # The range: the steps' own noise about the model (relative RMS) over the steps' share of the run.
    spread = max(model.fit_error * steps_part / wall, forecast.MINIMUM_SPREAD)
    flops_per_token = sum(r["flops"] for r in history) / max(sum(r["tokens"] for r in history), 1)
    phases = Phases(decode_seconds=0.0, compute_seconds=steps_part + evaluations * evaluation_seconds,
                    other_seconds=wall - steps_part - evaluations * evaluation_seconds,
                    compute_flops=flops_per_token * tokens_per_step * (run.total_steps + evaluations * validation_tokens
                                                                       / tokens_per_step / 3))
    network = profile.plan(params, mode="train").network
    return _assemble("train", hardware, config.dtype, profiles, network, wall, forecast.widened(wall, wall, spread), wall,
                     phases, timings.to_dict(), runtime.default_device(), {
                         "steps": len(chosen), "seconds": pilot_seconds, "share_of_job_steps": len(chosen) / run.total_steps,
                         "step_indices": chosen, "step_seconds": measured, "starts_a_loader": starts,
                         "step_model": {**model.to_dict(), "loader_start_seconds": loader_start_seconds,
                                        "fitted_steps": len(steady),
                                        "planned_step_seconds_by_phase": training_steps.phase_means(planned)},
                         "reused_by_the_job": False, "fresh_process": startup.record(fresh, entered)},
                     {"total_steps": run.total_steps, "steps_per_epoch": run.steps_per_epoch,
                      "micro_batch_size": run.micro_batch_size,
                      "max_seq_length": prepared.max_seq_length, "padding": config.padding,
                      "train_examples": len(prepared.train), "validation_examples": len(prepared.validation),
                      "evaluations": evaluations, "tokens_per_step": tokens_per_step, "processes": run.processes},
                     clock)


def _save_seconds(parameters: int, dtype: str) -> float:
    """Seconds to write the final model: its bytes at the rate a 64 MiB write to disk gets here."""
    OUTPUTS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=OUTPUTS_DIR, prefix=".forecast-write-") as handle:
        block = b"\0" * (64 * 2 ** 20)
        began = time.perf_counter()
        handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
        rate = len(block) / (time.perf_counter() - began)
    return parameters * (4 if dtype == "fp32" else 2) / rate
