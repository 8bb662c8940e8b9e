"""The forecast of a streaming job (the ``continuous`` backend): one stream, ``batch_size`` requests
in flight, a finished request's slot refilled at once, so no row waits for its batch's longest.

The pilot runs the chosen batches' prompts (spread across the length distribution, as for static
batches) as one stream through the job's own code into the job's output, and times every model step
(each advances every in-flight request by a token and prefills the ones just admitted). A step's cost
is fitted as fixed + per token processed + per pair of positions of each prompt it prefills. The job is then simulated slot by slot: requests in queue
order (longest prompt first) each take the earliest free of ``batch_size`` slots for as many steps
as they generate tokens; the steps are the makespan, the tokens every prompt's and every output's::

    steps = makespan([4, 9, 2, ...], slots=32)       # model steps the stream takes
    result = simulate_stream(prompt_lengths, prompts_per_call=32, max_new_tokens=256,
                             timings=timings, outputs=outputs)
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import asdict, dataclass
from typing import Callable

from workbook.planner import forecast
from workbook.planner.forecast import GenerationSimulation, OutputLengths
from workbook.planner.forward_timer import ForwardTimer


@dataclass
class StreamTimings:
    """What a stream costs, in seconds, as a pilot measured it."""

    step_fixed_seconds: float  # per model step, whatever it processes (the weights read, the launches)
    seconds_per_token: float  # per token a step processes (a prompt's at admission, one per decoding request)
    steps_scale: float  # the pilot's measured steps over its simulated ones (the manager's own scheduling)
    tokens_scale: float  # the pilot's measured tokens over its simulated ones
    call_overhead_seconds: float  # starting and stopping the manager, once per stream
    warm_up_seconds: float = 0.0
    startup_seconds: float = 0.0
    exit_seconds: float = 0.0
    # Per pair of positions of a prompt prefilled in the step (attention within it): a step that
    # admits long prompts costs more per token (measured on CPU: 92 us a token in 300-token steps,
    # 150 us in 1,900-token ones), and a pilot's few large steps cannot show that per token alone.
    seconds_per_prompt_pair: float = 0.0
    pairs_scale: float = 1.0  # the pilot's measured pairs over its simulated ones (prefill in chunks)

    def to_dict(self) -> dict:
        return asdict(self)


def makespan(output_lengths: list[int], slots: int) -> int:
    """Steps a stream takes: each request, in queue order, takes the earliest free of ``slots``
    slots for as many steps as it generates tokens (the first comes from its prefill)."""
    free = [0] * max(min(slots, len(output_lengths)), 1)
    for steps in output_lengths:
        heapq.heapreplace(free, free[0] + max(steps, 1))
    return max(free)


def queue_outputs(prompt_lengths: list[int], prompts_per_call: int, max_new_tokens: int,
                  outputs: OutputLengths) -> list[tuple[int, int]]:
    """(prompt, output) lengths of every request in queue order (longest prompt first): each group
    of ``prompts_per_call`` takes, in turn, the lengths the pilot saw nearest its longest prompt."""
    requests = []
    for batch in forecast.batch_plan(prompt_lengths, prompts_per_call):
        seen = outputs.nearest(batch[0])
        requests += [(length, min(seen[i % len(seen)], max_new_tokens)) for i, length in enumerate(batch)]
    return requests


def stream_cost(requests: list[tuple[int, int]], slots: int, timings: StreamTimings) -> tuple[float, float, float, int]:
    """(prefill, decode, steps) of one stream: steps x fixed + tokens x per token, as the pilot scaled them."""
    steps = makespan([output for _, output in requests], slots) * timings.steps_scale
    per_token = timings.seconds_per_token * timings.tokens_scale
    prompt_tokens = sum(prompt for prompt, _ in requests)
    pairs = timings.seconds_per_prompt_pair * timings.pairs_scale * sum(prompt * prompt for prompt, _ in requests)
    prefill = per_token * prompt_tokens + pairs
    decode = steps * timings.step_fixed_seconds + per_token * sum(max(output - 1, 0) for _, output in requests)
    return prefill, decode, steps, prompt_tokens


def simulate_stream(prompt_lengths: list[int], *, prompts_per_call: int, max_new_tokens: int, timings: StreamTimings,
                    outputs: OutputLengths, processes: int = 1, include_startup: bool = True) -> GenerationSimulation:
    """The job's wall time as one stream per process (each takes every ``processes``-th prompt of
    the sorted list, the job's split); the slowest process's. ``batch_seconds``: each group of
    ``prompts_per_call`` requests in queue order, its share of the stream (the ETA's units)."""
    slowest, ordered = None, sorted(prompt_lengths, reverse=True)
    for rank in range(processes):
        lengths = ordered[rank::processes]
        requests = queue_outputs(lengths, prompts_per_call, max_new_tokens, outputs) if lengths else []
        prefill, decode, steps, tokens = stream_cost(requests, prompts_per_call, timings) if requests else (0, 0, 0, 0)
        fixed = timings.call_overhead_seconds + timings.warm_up_seconds
        fixed += timings.startup_seconds + timings.exit_seconds if include_startup else 0.0
        weights = [sum(prompt + output for prompt, output in requests[start:start + prompts_per_call])
                   for start in range(0, len(requests), prompts_per_call)]
        total = sum(weights) or 1
        result = GenerationSimulation(prefill + decode + fixed, [(prefill + decode) * w / total for w in weights],
                                      prefill, decode, fixed, steps, tokens)
        if slowest is None or result.seconds > slowest.seconds:
            slowest = result
    return slowest


@dataclass
class StreamPilot:
    """What the pilot's stream measured."""

    seconds: float  # the whole call, the manager's start and stop and the writing included
    steps: list[tuple[float, float, int, int]]  # (start, end, tokens, prompt pairs) of every model step
    requests: list[tuple[int, int]]  # (prompt, output) lengths in the order they were queued
    groups: list[tuple[int, list[int]]]  # (longest prompt, output lengths) of each chosen batch


def fit_stream(pilot: StreamPilot, slots: int, warm_up_seconds: float, startup_seconds: float
               ) -> tuple[StreamTimings, float, str]:
    """Timings from the pilot's stream, the relative error of the fitted steps on its own, and how
    the steps were timed. A step's seconds run to the next step's start (the manager's scheduling
    between steps included). No step seen (a step replayed as a CUDA graph runs no forward hook):
    the stream's time per simulated step, every cost in it."""
    simulated_steps = makespan([output for _, output in pilot.requests], slots)
    simulated_tokens = sum(prompt + max(output - 1, 0) for prompt, output in pilot.requests)
    if len(pilot.steps) < 2:
        timings = StreamTimings(pilot.seconds / max(simulated_steps, 1), 0.0, 1.0, 1.0, 0.0,
                                warm_up_seconds, startup_seconds)
        return timings, 0.0, "no model step seen by the forward hooks: the stream's seconds per simulated step"
    starts = [step[0] for step in pilot.steps]
    seconds = [following - start for start, following in zip(starts, starts[1:])] + [pilot.steps[-1][1] - starts[-1]]
    tokens, pairs = [step[2] for step in pilot.steps], [step[3] for step in pilot.steps]
    if len(set(pairs)) >= 3:  # the manager said where each prompt's prefill sits (transformers' cu_seq_lens_q)
        fixed, per_token, per_pair = forecast.fit_nonnegative(
            [[1.0] * len(tokens), [float(t) for t in tokens], [float(p) for p in pairs]], seconds)
    else:
        (fixed, per_token), per_pair = forecast.fit_line(tokens, seconds, single="intercept"), 0.0
    simulated_pairs = sum(prompt * prompt for prompt, _ in pilot.requests)
    stepping = pilot.steps[-1][1] - starts[0]
    timings = StreamTimings(fixed, per_token, len(pilot.steps) / max(simulated_steps, 1),
                            sum(tokens) / max(simulated_tokens, 1), max(pilot.seconds - stepping, 0.0),
                            warm_up_seconds, startup_seconds, seconds_per_prompt_pair=per_pair,
                            pairs_scale=sum(pairs) / simulated_pairs if simulated_pairs and per_pair else 1.0)
    predicted = [fixed + per_token * count + per_pair * pair for count, pair in zip(tokens, pairs)]
    error = abs(sum(predicted) - stepping) / stepping if stepping > 0 else 0.0
    return timings, error, (f"{len(pilot.steps)} model steps timed by forward hooks ({simulated_steps} simulated "
                            f"for the pilot's own requests)")


def step_tokens(args, kwargs) -> tuple[int, int]:
    """(tokens, prompt pairs) of a stream's model step: every token it processes, and the pairs of
    positions of each prompt it prefills (transformers' cu_seq_lens_q: each sequence's tokens)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    starts = kwargs.get("cu_seq_lens_q")
    queries = (starts[1:] - starts[:-1]).tolist() if starts is not None else []
    return int(ids.numel()) if ids is not None else 0, sum(q * q for q in queries if q > 1)


def run_stream_pilot(params, share_, files, rank, batches: list[list], log, clock: Callable[[], float] = time.perf_counter
                     ) -> StreamPilot:
    """The chosen batches' prompts as one stream through the job's writer into the job's output,
    every model step timed."""
    from workbook.generation import job
    backend = share_.backend
    prompts = [prompt for batch in batches for prompt in batch]
    finished: dict[tuple[int, int], int] = {}
    original = backend._completed

    def completed(prompt, tokens):
        outcome = original(prompt, tokens)
        finished[(prompt.index, prompt.sample)] = len(outcome.completed[0][1].token_ids)
        return outcome

    timer = ForwardTimer(share_.model, rank.device, clock, describe=step_tokens)
    backend._completed = completed
    began = clock()
    try:
        job.generate_share(params, dataclasses.replace(share_, prompts=prompts, bad_lines=[], too_long=[]),
                           files, rank, log=lambda line: None, show_progress=False)
    finally:
        backend._completed = original
        timer.remove()
    seconds = clock() - began
    if len(finished) < len(prompts):
        raise job.GenerationError(f"the pilot's stream finished {len(finished)} of its {len(prompts)} requests (an "
                                  "error or out of memory in flight): lower batch_size so the forecast times the "
                                  "stream the job will run")
    requests = [(len(p.token_ids), finished[(p.index, p.sample)]) for p in prompts]
    groups = [(max(len(p.token_ids) for p in batch), [finished[(p.index, p.sample)] for p in batch]) for batch in batches]
    steps = list(timer.events)
    log(f"pilot: one stream of {len(prompts)} requests, {len(steps)} model steps, {seconds:.1f} s")
    return StreamPilot(seconds, steps, requests, groups)

