"""The forecast of a streaming job (the ``continuous`` backend): one stream, ``batch_size`` requests
in flight, a finished request's slot refilled at once, so no row waits for its batch's longest.

The pilot runs the chosen batches' prompts (spread across the length distribution, as for static
batches) as one stream through the job's own code into the job's output, and times every model step
with the work it did (``StepWork``). A step's cost is fitted per unit of each kind of work.
``schedule`` runs transformers' FIFO scheduler step by step (decoding requests first, then prompts in
queue order, chunked to the step's token budget, never more than ``batch_size`` in flight) and sums
the work, for the pilot's own requests and for the job's; the pilot's measured work over its
simulated work scales the job's::

    prefill, decode = schedule([(120, 9), (80, 2), ...], slots=32, max_batch_tokens=2048)
    result = simulate_stream(prompt_lengths, prompts_per_call=32, max_new_tokens=256,
                             timings=timings, outputs=outputs)
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable

from workbook.forecast import model, regression
from workbook.forecast.forward_timer import ForwardTimer
from workbook.forecast.model import GenerationSimulation, OutputLengths
from workbook.generation import job
from workbook.planner.paged import paged_layout


@dataclass
class StepWork:
    """What model steps processed, summed."""

    steps: float = 0.0
    tokens: float = 0.0  # every token a step processes: a prompt's (or its chunk's), one per decoding request
    sequences: float = 0.0  # requests in the step (the manager's and the sampler's work per request)
    prefill_pairs: float = 0.0  # a prompt chunk's tokens x the positions each attends (attention's compute)
    decode_keys: float = 0.0  # positions each decoding request attends (its KV cache read)
    # Queries x keys of a dense attention mask, where the attention takes one (sdpa, eager on CPU): it
    # scores every query against every in-flight request's keys, so n decoding requests cost n^2.
    # Measured on CPU: without this term a pilot's fit put a whole job's steps 11% low.
    mask_pairs: float = 0.0

    def add(self, other: "StepWork") -> "StepWork":
        return StepWork(*(a + b for a, b in zip(self.values(), other.values())))

    def values(self) -> list[float]:
        return [getattr(self, name) for name in WORK]


WORK = tuple(f.name for f in fields(StepWork))


@dataclass
class StreamTimings:
    """What a stream costs, in seconds, as a pilot measured it."""

    step_seconds: dict[str, float]  # seconds per unit of each kind of StepWork ("steps": per step)
    scales: dict[str, float]  # the pilot's measured work over its simulated (what the scheduler model misses)
    call_overhead_seconds: float  # starting and stopping the manager, once per stream
    warm_up_seconds: float = 0.0
    startup_seconds: float = 0.0
    exit_seconds: float = 0.0

    def seconds(self, work: StepWork) -> float:
        return sum(self.step_seconds.get(name, 0.0) * self.scales.get(name, 1.0) * value
                   for name, value in zip(WORK, work.values()))

    def to_dict(self) -> dict:
        return asdict(self)


def batch_tokens(slots: int, prompt_lengths: list[int]) -> int:
    """A step's token budget, as the backend sizes it for a stream of these prompts (``paged_layout``)."""
    return paged_layout(max(slots, 1), max(prompt_lengths, default=1) or 1, 1).max_batch_tokens


def stream_work(requests: list[tuple[int, int]], slots: int, finished: list | None = None
                ) -> tuple[StepWork, StepWork]:
    """``schedule`` of these requests at the step budget the backend gives a stream of them."""
    return schedule(requests, slots, batch_tokens(slots, [prompt for prompt, _ in requests]), finished)


def schedule(requests: list[tuple[int, int]], slots: int, max_batch_tokens: int,
             finished: list | None = None) -> tuple[StepWork, StepWork]:
    """(prefill, decode) work of a stream of (prompt, output) requests in queue order, as
    transformers' FIFO scheduler runs it: each step takes every decoding request's next token
    first, then prompts (a partly prefilled one first, then the queue's while fewer than ``slots``
    are in flight), each as much as is left of the step's ``max_batch_tokens``. A prompt's last chunk
    yields its first token; it decodes from the next step on until its output is complete. A step
    counts as decode if anything in it decodes. Stretches where nothing but decoding happens are
    summed at once, so a job of millions of tokens simulates in milliseconds. ``finished``, if
    given, receives the work done so far (a StepWork's fields) as each request completes."""
    prefill, decode = [0.0] * len(WORK), [0.0] * len(WORK)  # StepWork's fields, summed in place
    queue = collections.deque((prompt or 1, output or 1) for prompt, output in requests)
    partial: collections.deque = collections.deque()  # [prompt, prefilled so far, output], in flight
    decoding: list[tuple[int, int]] = []  # heap of (its last step, offset): its keys at step s are offset + s
    offsets = step = 0
    while queue or partial or decoding:
        d = len(decoding)
        if not partial and (not queue or d >= slots):  # nothing but decoding until the next request ends
            last = decoding[0][0]
            count = last - step + 1
            keys = count * offsets + d * (step + last) * count / 2
            _add(decode, count, d * count, d * count, 0, keys, d * keys)
            step, done = last, 0
        else:
            chunks, prefilled = _prefill(partial, queue, max(max_batch_tokens - d, 1), slots - d - len(partial))
            tokens, keys = sum(q for q, _ in chunks), sum(k for _, k in chunks)
            all_keys = keys + offsets + d * step
            _add(prefill, 0 if d else 1, tokens, len(chunks), sum(q * k for q, k in chunks), 0, tokens * all_keys)
            if d:
                _add(decode, 1, d, d, 0, offsets + d * step, d * all_keys)
            for prompt, _, output in prefilled:
                if output > 1:  # its keys at step s: the prompt and what it generated since this step
                    heapq.heappush(decoding, (step + output - 1, prompt - step))
                    offsets += prompt - step
            done = sum(output == 1 for _, _, output in prefilled)
        while decoding and decoding[0][0] <= step:
            offsets -= heapq.heappop(decoding)[1]
            done += 1
        if finished is not None and done:
            finished += [tuple(a + b for a, b in zip(prefill, decode))] * done
        step += 1
    return StepWork(*prefill), StepWork(*decode)


def _add(summed: list[float], *work: float) -> None:
    for index, value in enumerate(work):
        summed[index] += value


def _prefill(partial: collections.deque, queue: collections.deque, budget: int, room: int):
    """One step's prompt chunks, (tokens, keys each attends), and the requests whose prompt it
    completes; a prompt cut by the budget stays first in ``partial``."""
    chunks, prefilled = [], []
    while budget > 0 and (partial or (queue and room > 0)):
        if partial:
            entry = partial.popleft()
        else:
            entry, room = [queue[0][0], 0, queue.popleft()[1]], room - 1
        chunk = min(entry[0] - entry[1], budget)
        entry[1] += chunk
        budget -= chunk
        chunks.append((chunk, entry[1]))
        if entry[1] < entry[0]:
            partial.appendleft(entry)
            break
        prefilled.append(entry)
    return chunks, prefilled


def queue_outputs(prompt_lengths: list[int], prompts_per_call: int, max_new_tokens: int,
                  outputs: OutputLengths) -> list[tuple[int, int]]:
    """(prompt, output) lengths of every request in queue order (longest prompt first): each group
    of ``prompts_per_call`` takes, in turn, the lengths the pilot saw nearest its longest prompt."""
    requests = []
    for batch in model.batch_plan(prompt_lengths, prompts_per_call):
        seen = outputs.nearest(batch[0])
        requests += [(length, min(seen[i % len(seen)], max_new_tokens)) for i, length in enumerate(batch)]
    return requests


def simulate_stream(prompt_lengths: list[int], *, prompts_per_call: int, max_new_tokens: int, timings: StreamTimings,
                    outputs: OutputLengths, processes: int = 1, include_startup: bool = True) -> GenerationSimulation:
    """The job's wall time as one stream per process (each takes every ``processes``-th prompt of
    the sorted list, the job's split); the slowest process's. ``batch_seconds``: each group of
    ``prompts_per_call`` requests in queue order, its share of the stream (the ETA's units)."""
    slowest, ordered = None, sorted(prompt_lengths, reverse=True)
    for rank in range(processes):
        lengths = ordered[rank::processes]
        requests = queue_outputs(lengths, prompts_per_call, max_new_tokens, outputs) if lengths else []
        prefill, decode = stream_work(requests, prompts_per_call)
        prefill_seconds, decode_seconds = timings.seconds(prefill), timings.seconds(decode)
        fixed = timings.call_overhead_seconds + timings.warm_up_seconds
        fixed += timings.startup_seconds + timings.exit_seconds if include_startup else 0.0
        weights = [sum(prompt + output for prompt, output in requests[start:start + prompts_per_call])
                   for start in range(0, len(requests), prompts_per_call)]
        total, stepping = sum(weights) or 1, prefill_seconds + decode_seconds
        steps = (prefill.steps + decode.steps) * timings.scales.get("steps", 1.0)
        result = GenerationSimulation(stepping + fixed, [stepping * w / total for w in weights],
                                      prefill_seconds, decode_seconds, fixed, steps, int(prefill.tokens),
                                      decode.decode_keys * timings.scales.get("decode_keys", 1.0))
        if slowest is None or result.seconds > slowest.seconds:
            slowest = result
    return slowest


def group_seconds(prompt_lengths: list[int], *, group: int, max_new_tokens: int, timings: StreamTimings,
                  outputs: OutputLengths) -> list[float]:
    """The stream's ETA units: the seconds from one ``group`` of completed requests to the next (its
    progress counts them so; the last group may be short), by the forecast's model. Long prompts run
    first and fill the stream, so the first groups take far longer than the rest (measured on CPU:
    the first tenth of the requests took a third of the time). The manager's start and stop come
    last: the progress starts counting once the manager runs, and the last group closes after its stop."""
    finished: list = []
    stream_work(queue_outputs(prompt_lengths, group, max_new_tokens, outputs), group, finished)
    closing = finished[group - 1::group] + ([finished[-1]] if len(finished) % group else [])
    at = [timings.warm_up_seconds + timings.seconds(StepWork(*work)) for work in closing]
    seconds = [now - before for before, now in zip([0.0] + at, at)]
    if seconds:
        seconds[-1] += timings.call_overhead_seconds
    return seconds


@dataclass
class StreamPilot:
    """What the pilot's stream measured."""

    seconds: float  # the whole call, the manager's start and stop and the writing included
    steps: list[tuple[float, float, StepWork]]  # (start, end, work) of every model step
    requests: list[tuple[int, int]]  # (prompt, output) lengths in the order they were queued
    groups: list[tuple[int, list[int]]]  # (longest prompt, output lengths) of each chosen batch


def fit_stream(pilot: StreamPilot, slots: int, warm_up_seconds: float, startup_seconds: float
               ) -> tuple[StreamTimings, float, str]:
    """Timings from the pilot's stream, the relative error of its simulated steps (unscaled) on its
    measured ones, and how the steps were timed. A step's seconds run to the next step's start (the
    manager's scheduling between steps included). No step seen (a step replayed as a CUDA graph
    runs no forward hook): the stream's time per simulated step, every cost in it."""
    prefill, decode = stream_work(pilot.requests, slots)
    simulated = prefill.add(decode)
    if len(pilot.steps) < 2:
        timings = StreamTimings({"steps": pilot.seconds / max(simulated.steps, 1)}, {}, 0.0, warm_up_seconds,
                                startup_seconds)
        return timings, 0.0, "no model step seen by the forward hooks: the stream's seconds per simulated step"
    starts = [step[0] for step in pilot.steps]
    seconds = [following - start for start, following in zip(starts, starts[1:])] + [pilot.steps[-1][1] - starts[-1]]
    works = [step[2] for step in pilot.steps]
    measured = StepWork()
    for work in works:
        measured = measured.add(work)
    used = [name for name in WORK if getattr(measured, name) > 0]  # a mask only where the attention takes one
    costs = regression.fit_nonnegative([[getattr(work, name) for work in works] for name in used], seconds)
    step_seconds = dict(zip(used, costs))
    scales = {name: getattr(measured, name) / getattr(simulated, name) if getattr(simulated, name) else 1.0
              for name in used}
    stepping = pilot.steps[-1][1] - starts[0]
    timings = StreamTimings(step_seconds, scales, max(pilot.seconds - stepping, 0.0), warm_up_seconds, startup_seconds)
    unscaled = StreamTimings(step_seconds, {}, 0.0).seconds(simulated)
    error = abs(unscaled - stepping) / stepping if stepping > 0 else 0.0
    return timings, error, (f"{len(pilot.steps)} model steps timed by forward hooks ({simulated.steps:.0f} simulated "
                            f"for the pilot's own requests)")


def step_work(args, kwargs) -> tuple[StepWork]:
    """The work of a stream's model step, from what transformers' manager passes the model: each
    sequence's queries and keys (``cu_seq_lens_q``/``_k``, the keys per layer type where a model has
    several: its full-attention layers'), and the attention mask, where there is one."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens = int(ids.numel()) if ids is not None else 0
    queries = _lengths(kwargs.get("cu_seq_lens_q"))
    keys = _lengths(_full_attention(kwargs.get("cu_seq_lens_k"))) or queries
    mask = _full_attention(kwargs.get("attention_mask"))
    mask_pairs = mask.shape[-2] * mask.shape[-1] if hasattr(mask, "shape") and len(mask.shape) >= 2 else 0
    pairs = [(q, k) for q, k in zip(queries, keys) if q > 0]  # padded sequences have none
    return (StepWork(1, tokens, len(pairs), sum(q * k for q, k in pairs if q > 1),
                     sum(k for q, k in pairs if q == 1), mask_pairs),)


def _full_attention(value):
    if isinstance(value, dict):
        return value.get("full_attention", next(iter(value.values()), None))
    return value


def _lengths(cumulative) -> list[int]:
    return (cumulative[1:] - cumulative[:-1]).tolist() if cumulative is not None and len(cumulative) > 1 else []


def run_stream_pilot(settings, share_, files, rank, batches: list[list], log, clock: Callable[[], float] = time.perf_counter
                     ) -> StreamPilot:
    """The chosen batches' prompts as one stream through the job's writer into the job's output,
    every model step timed."""
    backend = share_.backend
    prompts = [prompt for batch in batches for prompt in batch]
    finished: dict[tuple[int, int], int] = {}
    original = backend._completed

    def completed(prompt, tokens):
        outcome = original(prompt, tokens)
        finished[(prompt.index, prompt.sample)] = len(outcome.completed[0][1].token_ids)
        return outcome

    timer = ForwardTimer(share_.model, rank.device, clock, describe=step_work)
    backend._completed = completed
    began = clock()
    try:
        job.generate_share(settings, dataclasses.replace(share_, prompts=prompts, bad_lines=[], too_long=[]),
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

