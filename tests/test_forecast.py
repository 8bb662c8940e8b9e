"""The forecast: the job simulated from a pilot's timings, the pilot drawn across the length
distribution, its outputs kept by the job (generated once), and the ETA from the same model."""

import dataclasses
import json
import math
import random

import pytest
import torch

from workbook import bench, cli, generation, params, recorded_forecast
from workbook.forecast import eta, model as forecast, pilot, regression, startup, stream as stream_forecast, training_steps
from workbook.forecast.model import GenerationTimings, OutputLengths
from workbook.generation import progress
from workbook.hardware import Hardware
from workbook.paths import PARAMS_DIR


def timings(**changes) -> GenerationTimings:
    values = dict(prefill_fixed_seconds=0.01, prefill_seconds_per_token=0.001, step_fixed_seconds=0.02,
                  step_seconds_per_context_token=0.0001, call_overhead_seconds=0.005, write_seconds_per_output=0.0002)
    return GenerationTimings(**{**values, **changes})


def test_expected_longest_output_of_a_batch():
    assert forecast.expected_longest([5, 5, 5], rows=4, cap=8) == 5  # fixed-length outputs
    assert forecast.expected_longest([9, 9], rows=4, cap=8) == 8  # capped at max_new_tokens
    # Outputs of 1 or 3 tokens, two rows: P(max >= 1) + P(max >= 2) + P(max >= 3) = 1 + 0.75 + 0.75.
    assert forecast.expected_longest([1, 3], rows=2, cap=8) == pytest.approx(2.5)
    # More rows wait for a longer longest: a static batch decodes until its longest row ends.
    assert forecast.expected_longest([1, 3], rows=8, cap=8) > forecast.expected_longest([1, 3], rows=2, cap=8)
    # Summed per stretch between distinct lengths, it equals P(max >= k) summed for every k.
    rng = random.Random(3)
    for rows, cap in [(1, 50), (7, 30), (64, 2048)]:
        lengths = [rng.choice([1, 2, 2, rng.randint(1, 60)]) for _ in range(rng.randint(1, 40))]
        every_k = sum(1 - (sum(min(x, cap) < k for x in lengths) / len(lengths)) ** rows for k in range(1, cap + 1))
        assert forecast.expected_longest(lengths, rows=rows, cap=cap) == pytest.approx(every_k)


def test_simulation_adds_up_the_engines_batches_on_synthetic_timings():
    known = timings()
    lengths = [10, 30, 20, 40, 50]  # sorted longest first and cut every 2: [50, 40], [30, 20], [10]
    result = forecast.simulate_generation(lengths, prompts_per_call=2, max_new_tokens=8, timings=known,
                                          outputs=OutputLengths([(30, [4])]), include_startup=False)

    def by_hand(rows, longest):  # prefill, 3 decode steps at contexts longest+1..+3, overhead, writes
        contexts = sum(longest + step for step in (1, 2, 3))
        return (0.01 + 0.001 * rows * longest + 3 * 0.02 + 0.0001 * rows * contexts + 0.005 + 0.0002 * rows)

    assert result.batch_seconds == pytest.approx([by_hand(2, 50), by_hand(2, 30), by_hand(1, 10)])
    assert result.seconds == pytest.approx(sum(result.batch_seconds))
    assert result.prefill_tokens == 2 * 50 + 2 * 30 + 10
    assert result.decode_steps == 3 * 3  # three calls of 4 tokens: the prefill yields each call's first
    # The KV cache the decode steps read: each row its context at each of the 3 steps.
    contexts = lambda longest: sum(longest + step for step in (1, 2, 3))
    assert result.decode_context_positions == 2 * contexts(50) + 2 * contexts(30) + contexts(10)
    # Two processes take every other prompt ([50, 30, 10] and [40, 20]); the job ends with the slower.
    split = forecast.simulate_generation(lengths, prompts_per_call=2, max_new_tokens=8, timings=known,
                                         outputs=OutputLengths([(30, [4])]), include_startup=False, processes=2)
    assert split.batch_seconds == pytest.approx([by_hand(2, 50), by_hand(1, 10)])


def test_the_decode_phase_counts_the_kv_cache_it_reads_beside_the_weights(tiny_model_path):
    """The decode bandwidth efficiency (and every projection by bandwidth) over the bytes a step
    really reads: at an 8B model's planned batch on an 80 GB GPU the KV cache outweighs the weights."""
    from workbook.planner.formulas import kv_cache_bytes_per_token
    model = generation.load_model(str(tiny_model_path), "fp32", "cpu")[0]
    whole = forecast.GenerationSimulation(10.0, [10.0], 1.0, 8.0, 1.0, decode_steps=100, prefill_tokens=500,
                                          decode_context_positions=2e6)
    phases = pilot.generation_phases(model, "fp32", whole)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        weights -= model.get_input_embeddings().weight.numel() * 4  # gathered a row per token, not streamed
    assert phases.decode_bytes == 100 * weights + 2e6 * kv_cache_bytes_per_token(model.config, "fp32")
    # The same weights per step as the bench's roofline counts.
    assert weights == bench.decode_step_cost(model.config, "fp32", 1, 0).weights_bytes


def fake_call(truth: GenerationTimings, rows: int, longest: int, outputs: list[int]) -> pilot.Call:
    """A pilot call whose forwards take exactly what ``truth`` says."""
    forwards, clock = [], 0.0
    prefill = forecast.batch_seconds(rows, longest, 1, truth)[0]
    forwards.append((clock, clock + prefill, longest))
    clock += prefill
    for step in range(1, max(outputs)):
        seconds = truth.step_fixed_seconds + truth.step_seconds_per_context_token * rows * (longest + step)
        forwards.append((clock, clock + seconds, longest + step))
        clock += seconds
    return pilot.Call(rows, longest, clock, forwards, outputs, written_seconds=clock)


def test_a_long_prompts_dearer_tokens_are_fitted_and_carried_to_lengths_the_pilot_did_not_run():
    """Attention makes a prefill's cost grow with rows x length squared (on CPU the tiny model's
    token at 200 positions costs 1.6x one at 20): a line through the pilot's total put the job's
    longest batches 20% low and its shortest 10% high. From pilot batches across the lengths the
    fit recovers the pairs' cost and predicts a batch longer than any it ran."""
    truth = timings(call_overhead_seconds=0.0, write_seconds_per_output=0.0, prefill_fixed_seconds=0.0,
                    prefill_seconds_per_token=2e-5, prefill_seconds_per_token_pair=7e-8)
    calls = [fake_call(truth, 32, length, [4] * 32) for length in (180, 120, 60, 30)]
    fitted, error = pilot.fit_generation(calls, warm_up_seconds=0.0, startup_seconds=0.0)
    assert fitted.prefill_seconds_per_token_pair == pytest.approx(7e-8, rel=1e-6)
    assert fitted.prefill_seconds_per_token == pytest.approx(2e-5, rel=1e-6)
    assert error == pytest.approx(0.0, abs=1e-9)
    longer = fake_call(truth, 32, 220, [4] * 32)
    predicted = forecast.simulate_generation([220] * 32, prompts_per_call=32, max_new_tokens=8, timings=fitted,
                                             outputs=OutputLengths([(220, [4])]), include_startup=False)
    assert predicted.seconds == pytest.approx(longer.seconds, rel=1e-6)
    # The same calls fitted with a line alone (what the forecast did before) put its prefill over 10% low.
    line = timings(call_overhead_seconds=0.0, write_seconds_per_output=0.0, step_fixed_seconds=fitted.step_fixed_seconds,
                   step_seconds_per_context_token=fitted.step_seconds_per_context_token,
                   **dict(zip(("prefill_fixed_seconds", "prefill_seconds_per_token"), regression.fit_line(
                       [32 * c.longest_prompt for c in calls], [c.forwards[1][0] for c in calls], single="slope"))))
    by_line = forecast.simulate_generation([220] * 32, prompts_per_call=32, max_new_tokens=8, timings=line,
                                           outputs=OutputLengths([(220, [4])]), include_startup=False)
    assert by_line.prefill_seconds < 0.9 * longer.forwards[1][0]


def stream_timings(**step_seconds) -> stream_forecast.StreamTimings:
    return stream_forecast.StreamTimings({"steps": 0.01, "tokens": 0.001, **step_seconds}, {}, call_overhead_seconds=0.5)


def one_step_at_a_time(requests, slots, budget) -> list[stream_forecast.StepWork]:
    """The reference for ``schedule``: transformers' FIFO scheduler a step at a time, each request
    tracked (decoding first, then prompts in the order admitted, then the queue's), each step's work."""
    queue, flight, steps = list(requests), [], []
    while queue or flight:
        left, queries_keys, chunks = budget, [], []
        for request in flight:
            if request["done"] == request["prompt"]:  # decoding: its last token, over everything so far
                queries_keys.append((1, request["prompt"] + request["generated"]))
                left -= 1
        for request in flight + [None] * len(queue):
            if request is None:
                if not queue or len(flight) >= slots:
                    break
                prompt, output = queue.pop(0)
                request = {"prompt": prompt, "done": 0, "output": output, "generated": 0}
                flight.append(request)
            if request["done"] == request["prompt"]:
                continue
            if left <= 0:
                break
            chunk = min(request["prompt"] - request["done"], left)
            request["done"] += chunk
            left -= chunk
            chunks.append((request, chunk))
        tokens = sum(q for q, _ in queries_keys) + sum(chunk for _, chunk in chunks)
        keys = sum(k for _, k in queries_keys) + sum(request["done"] for request, _ in chunks)
        steps.append(stream_forecast.StepWork(
            1, tokens, len(queries_keys) + len(chunks), sum(chunk * request["done"] for request, chunk in chunks),
            sum(k for _, k in queries_keys), tokens * keys))
        for request in flight:
            if request["done"] == request["prompt"] and (request["generated"] or any(r is request for r, _ in chunks)):
                request["generated"] += 1
        flight = [request for request in flight if request["generated"] < request["output"]]
    return steps


def total(works):
    summed = stream_forecast.StepWork()
    for work in works:
        summed = summed.add(work)
    return summed


def test_the_stream_schedule_by_hand():
    # Step 0 prefills both prompts (5 tokens, 3x3 + 2x2 pairs, a 5 x 5 mask); step 1 decodes both (keys
    # 4 and 3); step 2 decodes the second (keys 4) beside the third prompt's prefill: 5 tokens, 8 keys.
    prefill, decode = stream_forecast.schedule([(3, 2), (2, 3), (4, 1)], slots=2, max_batch_tokens=100)
    assert prefill == stream_forecast.StepWork(steps=1, tokens=9, sequences=3, prefill_pairs=29, mask_pairs=25 + 4 * 8)
    assert decode == stream_forecast.StepWork(steps=2, tokens=3, sequences=3, decode_keys=11, mask_pairs=2 * 7 + 1 * 8)
    # A prompt longer than the step's budget is prefilled in chunks, each attending what came before.
    prefill, decode = stream_forecast.schedule([(10, 2)], slots=4, max_batch_tokens=4)
    assert (prefill.steps, prefill.tokens, prefill.prefill_pairs) == (3, 10, 4 * 4 + 4 * 8 + 2 * 10)
    assert (decode.steps, decode.decode_keys) == (1, 11)


@pytest.mark.parametrize("slots, budget", [(4, 2048), (8, 64), (3, 5)])
def test_the_stream_schedule_equals_a_step_at_a_time(slots, budget):
    """The schedule sums stretches of decoding at once; a step at a time must give the same work."""
    rng = random.Random(slots)
    requests = [(rng.randint(1, 40), rng.choice([1, 2, 3, 30, rng.randint(1, 60)])) for _ in range(60)]
    prefill, decode = stream_forecast.schedule(requests, slots, budget)
    assert prefill.add(decode) == total(one_step_at_a_time(requests, slots, budget))


def test_a_stream_of_uneven_outputs_takes_far_fewer_steps_than_static_batches():
    """What continuous batching is for: a static batch decodes until its longest row ends, a stream
    refills each finished slot. Each group of 4 has one 30-token answer and three of 2 tokens."""
    lengths = [50] * 16
    outputs = OutputLengths([(50, [30, 2, 2, 2])])
    stream = stream_forecast.simulate_stream(lengths, prompts_per_call=4, max_new_tokens=32, timings=stream_timings(),
                                             outputs=outputs, include_startup=False)
    # The long answers start as slots free, at steps 0, 2, 4 and 12: the last ends at 42, where four static
    # batches of these groups decode 4 x 30 = 120 steps, each waiting for its long answer.
    assert stream.decode_steps == 42
    # By hand: steps x fixed + every prompt token and every decoded token x per token + the manager's start.
    decoded = 4 * 29 + 12 * 1
    assert stream.seconds == pytest.approx(stream.decode_steps * 0.01 + 0.001 * (16 * 50 + decoded) + 0.5)
    assert sum(stream.batch_seconds) == pytest.approx(stream.seconds - 0.5)
    # The KV cache its decode steps read: a request at step k of its answer attends its prompt + k tokens.
    assert stream.decode_context_positions == 4 * sum(50 + k for k in range(1, 30)) + 12 * (50 + 1)


def test_a_streams_fit_recovers_its_step_costs_and_the_managers_own_scheduling():
    """Steps timed as the scheduler runs them, each costing 20 ms + 0.5 ms a token + 1 us a mask
    pair: the fit prices the simulated pilot at its measured time; one step in ten more than the
    simulation (the manager's own lag) becomes the steps' scale."""
    rng = random.Random(0)
    requests = [(rng.randint(5, 60), rng.randint(1, 12)) for _ in range(24)]
    works = one_step_at_a_time(requests, 4, stream_forecast.batch_tokens(4, [p for p, _ in requests]))
    steps, clock = [], 1.0  # the manager started 1 s before its first step
    for work in works:
        seconds = 0.02 + 0.0005 * work.tokens + 1e-6 * work.mask_pairs
        steps.append((clock, clock + seconds, work))
        clock += seconds
    run = stream_forecast.StreamPilot(seconds=clock + 0.25, steps=steps, requests=requests, groups=[(60, [3])])
    fitted, error, how = stream_forecast.fit_stream(run, slots=4, warm_up_seconds=0.0, startup_seconds=3.0)
    assert error == pytest.approx(0.0, abs=1e-9) and fitted.call_overhead_seconds == pytest.approx(1.25)
    assert set(fitted.scales.values()) == {1.0}
    assert fitted.seconds(total(works)) == pytest.approx(clock - 1.0)
    assert f"{len(works)} model steps timed" in how
    lagging = dataclasses.replace(run, steps=steps + [(clock, clock + 0.02, stream_forecast.StepWork(steps=1))] * (len(works) // 10))
    assert stream_forecast.fit_stream(lagging, 4, 0.0, 3.0)[0].scales["steps"] == pytest.approx(1 + (len(works) // 10) / len(works))
    # No step seen (CUDA graphs replay without the forward hooks): the stream's time per simulated step.
    blind, _, how = stream_forecast.fit_stream(dataclasses.replace(run, steps=[]), slots=4, warm_up_seconds=0.0,
                                               startup_seconds=3.0)
    assert blind.step_seconds == {"steps": pytest.approx(run.seconds / len(works))}
    assert "no model step seen" in how


def test_the_nonnegative_fit_drops_a_negative_cost_and_keeps_the_total():
    columns = [[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0], [1.0, 4.0, 9.0, 16.0]]
    assert regression.fit_nonnegative(columns, [2.0, 3.0, 4.0, 5.0]) == pytest.approx([1.0, 1.0, 0.0], abs=1e-9)
    # Time falling with size fits no positive slope: the mean, as a fixed cost.
    assert regression.fit_nonnegative(columns, [5.0, 4.0, 3.0, 2.0]) == pytest.approx([3.5, 0.0, 0.0], abs=1e-9)
    # Convex data whose exact fit has a negative fixed cost: none, and the total kept.
    ys = [0.5, 3.0, 7.5, 14.0]  # 1 * x^2 - 0.5 ... without the constant
    fixed, per_token, per_pair = regression.fit_nonnegative(columns, ys)
    assert fixed == 0.0 and per_token >= 0 and per_pair > 0
    assert sum(per_token * x + per_pair * x * x for x in (1, 2, 3, 4)) == pytest.approx(sum(ys))


def test_fitted_timings_predict_batches_the_pilot_did_not_run():
    """Calls made from known costs: the fit recovers them, and the simulation then predicts the
    time of a batch of other lengths."""
    truth = timings(call_overhead_seconds=0.0, write_seconds_per_output=0.0)

    calls = [fake_call(truth, 8, 100, [6] * 8), fake_call(truth, 8, 20, [6] * 8)]
    fitted, error = pilot.fit_generation(calls, warm_up_seconds=0.0, startup_seconds=0.0)
    assert fitted.prefill_seconds_per_token == pytest.approx(truth.prefill_seconds_per_token, rel=1e-6)
    assert fitted.step_seconds_per_context_token == pytest.approx(truth.step_seconds_per_context_token, rel=1e-6)
    assert error == pytest.approx(0.0, abs=1e-9)
    unseen = fake_call(truth, 8, 60, [6] * 8)
    predicted = forecast.simulate_generation([60] * 8, prompts_per_call=8, max_new_tokens=8, timings=fitted,
                                             outputs=OutputLengths([(60, [6])]), include_startup=False)
    assert predicted.seconds == pytest.approx(unseen.seconds, rel=1e-6)


def test_a_noisy_pilot_fit_never_goes_negative_and_keeps_the_pilots_total_time():
    """One slow batch at the longest prompts tilts the least-squares line below 0 at the origin;
    clipping that alone kept the tilted slope and overstated the job (the pilot's own prefill by
    27% in a measured CPU pilot). The fit must keep the total time the pilot measured."""
    tokens = [5920, 4600, 3460, 2620, 1860, 1220, 800, 540, 510]  # 32 rows x the longest prompt
    seconds = [0.84, 0.49, 0.27, 0.20, 0.14, 0.088, 0.060, 0.043, 0.042]  # the first batch slow
    intercept, slope = regression.fit_line(tokens, seconds)
    assert intercept == 0.0 and slope > 0
    assert intercept * len(tokens) + slope * sum(tokens) == pytest.approx(sum(seconds))
    # A line the data supports is left as least squares gives it (positive fixed cost).
    assert regression.fit_line([100, 200, 300], [1.5, 2.5, 3.5]) == pytest.approx((0.5, 0.01))
    # Time that falls with more work is noise: no slope, the mean as a fixed cost.
    assert regression.fit_line([100, 200, 300], [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ColdOnceModel(torch.nn.Module):
    """1 ms per token; the first forward at a larger shape than any before, or the first with a
    padding mask, also pays a one-off 0.5 s (allocator growth, another attention path), as the
    tiny model does on CPU (its first masked 32 x 138 prefill was 18% slower than warm)."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.clock, self.largest, self.masked = clock, 0, False

    def forward(self, input_ids, attention_mask=None):
        cold = input_ids.numel() > self.largest or (attention_mask is not None and not self.masked)
        self.largest, self.masked = max(self.largest, input_ids.numel()), self.masked or attention_mask is not None
        self.clock.now += 0.001 * input_ids.numel() + (0.5 if cold else 0.0)


def test_warm_up_leaves_the_pilots_first_batch_timed_warm_and_measures_the_one_off():
    """The pilot's first batch timed cold would raise the fitted per-token prefill of every batch."""
    clock = FakeClock()
    model = ColdOnceModel(clock)
    one_off = pilot.warm_up(model, torch.device("cpu"), token_id=0, rows=4, length=50, clock=clock)
    assert one_off == pytest.approx(0.5)  # paid once by the job, in its first batch
    began = clock()
    model(input_ids=torch.zeros(4, 50, dtype=torch.long), attention_mask=torch.ones(4, 50))  # the first pilot batch
    assert clock() - began == pytest.approx(0.001 * 4 * 50)  # steady: nothing one-off left in it


def test_warm_up_through_the_backend_runs_a_short_generation_twice_and_measures_the_one_off():
    """A static job's pilot warms up with a short generation of its first batch through the job's own
    backend (a prefill and a decode step: the decode-shaped kernels loaded too), not a bare forward."""
    clock, calls = FakeClock(), []

    def short_generation():
        calls.append(clock.now)
        clock.now += 0.2 + (0.7 if len(calls) == 1 else 0.0)  # the first call loads kernels and grows caches

    one_off = pilot.warm_up(None, torch.device("cpu"), token_id=0, rows=4, length=50, clock=clock, call=short_generation)
    assert len(calls) == 2 and one_off == pytest.approx(0.7)


def test_the_recorded_forecast_keeps_the_timings_the_eta_reads(tmp_path):
    """The job's ETA reads the timings back from the recorded forecast: per-token times of ~1e-5 s
    must survive the recording (rounded to 4 decimals they became 0.0001 or 0)."""
    small = timings(prefill_seconds_per_token=7.94e-5, step_seconds_per_context_token=9.4e-7)
    made = forecast.Forecast(mode="generate", profile="cpu", predicted_wall_seconds=10.0,
                             predicted_wall_seconds_range=(9.0, 11.0), remaining_wall_seconds=9.0,
                             pilot={"output_lengths": [(138, [8, 8]), (17, [5, 4])]}, timings=small.to_dict(),
                             job={}, cost={})
    (tmp_path / "out.forecast.json").write_text(json.dumps(made.to_dict()))
    planned = eta.planned_batch_seconds(json.loads((tmp_path / "out.forecast.json").read_text()))
    batch = [generation.Prompt(i, [1] * length, 8) for i, length in enumerate([138] * 32)]
    assert planned([batch]) == [pytest.approx(sum(forecast.batch_seconds(32, 138, 8, small)), rel=1e-5)]


def test_pilot_batches_span_the_length_distribution():
    batches = [[length] * 4 for length in range(200, 0, -10)]  # 20 full batches, longest first
    chosen = pilot.pick_batches(batches, share=0.1)
    assert chosen == [5, 15]  # 10% of 20 batches, one from each half, not the first lines
    assert len(pilot.pick_batches(batches, share=0.01)) == 1  # at least one batch
    assert pilot.pick_batches(batches + [[1]], share=1.0)[-1] == 19  # the short last batch is not the job's shape


def test_eta_counts_the_planned_time_left_not_the_examples_left():
    planned = [4.0, 3.0, 2.0, 1.0]  # longest prompts first: the first batch is the slowest
    # One batch done in 8 s, twice its plan: the rest takes twice theirs.
    assert progress.remaining_seconds(planned, finished_at_seconds=[8.0]) == pytest.approx(12.0)
    examples_left_estimate = 8.0 * 3  # 8 s per batch so far, 3 batches left
    assert progress.remaining_seconds(planned, [8.0]) < examples_left_estimate
    assert progress.remaining_seconds(planned, []) == pytest.approx(10.0)


def test_eta_paces_by_the_recent_batches_not_the_first_ones():
    """A first batch that paid a one-off cost (a compilation: 30 s on a 2 s plan), then batches at
    their plan: the pace of the recent quarter of the batches done (at least 3) forgets it."""
    planned = [2.0] * 20
    finished = [30.0 + 2.0 * i for i in range(12)]  # 12 batches done: the first at 30 s, then 2 s each
    assert progress.remaining_seconds(planned, finished) == pytest.approx(8 * 2.0)  # 8 left at the plan's pace
    every = (finished[-1] / sum(planned[:12])) * 8 * 2.0  # the pace of every batch done: 52 s for 24 planned
    assert every > 2 * progress.remaining_seconds(planned, finished)
    # Three batches done: the window is all of them, the first included.
    assert progress.remaining_seconds(planned, finished[:3]) == pytest.approx(34.0 / 6.0 * 17 * 2.0)


def test_projection_scales_each_phase_by_its_peak():
    phases = forecast.Phases(decode_seconds=10.0, compute_seconds=4.0, other_seconds=1.0,
                             decode_bytes=1e10, compute_flops=4e12)
    here = forecast.Peaks(1e12, 1e9, "test")
    there = forecast.Peaks(4e12, 1e10, "test")
    assert forecast.project(phases, here, there, gpus_there=1, processes_here=1) == pytest.approx(1 + 1 + 1)
    assert forecast.project(phases, here, there, gpus_there=2, processes_here=1) == pytest.approx(1 + 1)
    # At the other GPU's own measured efficiency: bytes / (bandwidth x efficiency), flops likewise.
    measured_there = {"decode_bandwidth": 0.5, "compute": 0.25}
    assert forecast.project(phases, here, there, 1, 1, measured_there) == pytest.approx(1 + 2 + 4)


def write_prompts(path, count):
    rng = random.Random(0)
    lines = []
    for i in range(count):  # mixed lengths: a padding clause of 0-12 words before the question
        filler = " ".join(rng.choice(["please", "kindly", "now", "quickly"]) for _ in range(rng.randint(0, 12)))
        lines.append({"id": f"q{i}", "input": f"{filler} What is {i} + {i % 7}?".strip()})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def job_params(prompts_path, output_path, **changes):
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(prompts_path=str(prompts_path), output_path=str(output_path), log_every_batches=0, verifier="",
                  interactive=False, do_sample=False, samples_per_prompt=1)  # one greedy output per prompt
    for key, value in changes.items():
        values[key] = params.validate_value(key, value, "test")
    return values


@pytest.mark.slow
def test_the_pilot_writes_a_relative_output_path_where_the_job_will(tmp_path, tiny_model_path, monkeypatch):
    # A relative prompts path falls back to the repository root; an output path never does: the
    # pilot must write where the job then resumes, even when the root holds a file of that name.
    from workbook.generation import files
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir(), work.mkdir()
    (repo / "out.jsonl").write_text("")
    monkeypatch.setattr(files, "REPO_ROOT", repo)
    monkeypatch.chdir(work)
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 20)
    pilot.forecast_generation(job_params(prompts, "out.jsonl", batch_size=4, max_new_tokens=4), share=0.2,
                              log=lambda line: None, model=model, tokenizer=tokenizer)
    assert len((work / "out.jsonl").read_text().splitlines()) == 4 and (repo / "out.jsonl").read_text() == ""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["static", "continuous"])
def test_pilot_outputs_are_kept_by_the_job_and_generated_once(tmp_path, tiny_model_path, backend):
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    prompts, output = write_prompts(tmp_path / "prompts.jsonl", 40), tmp_path / "out.jsonl"
    job = job_params(prompts, output, batch_size=4, max_new_tokens=4, backend=backend)
    result = pilot.forecast_generation(job, share=0.2, log=lambda line: None, model=model, tokenizer=tokenizer)
    piloted = [json.loads(line)["metadata"]["example_id"] for line in output.read_text().splitlines()]
    assert result.pilot["batches"] == 2 and len(piloted) == 8  # 20% of the 10 batches
    # continuous: the chosen batches' prompts as one stream, its model steps timed; the job simulated as a stream
    assert ("scales" in result.timings) == (backend == "continuous")
    assert ("model steps timed" in result.pilot["timed"]) == (backend == "continuous")
    assert result.predicted_wall_seconds_range[0] <= result.predicted_wall_seconds <= result.predicted_wall_seconds_range[1]
    assert result.remaining_wall_seconds < result.predicted_wall_seconds
    assert {row["profile"] for row in result.profiles} == set(params.profile_names())
    recorded_forecast.generation_file(output).write_text(json.dumps(result.to_dict()))  # as the CLI does
    summary = generation.run_job(job, output, model=model, tokenizer=tokenizer, log=lambda line: None,
                                 show_progress=False)
    # The run records the forecast it started with: the time left after the pilot, beside its own.
    assert summary["forecast"]["compared_with"] == "remaining after the pilot"
    assert summary["forecast"]["predicted_wall_seconds"] == pytest.approx(result.remaining_wall_seconds, rel=1e-3)
    ids = [json.loads(line)["metadata"]["example_id"] for line in output.read_text().splitlines()]
    assert summary["generated"] == 40 - 8  # the job generated only what the pilot had not
    # Its ETA planned each batch (a stream: each group of completions) by the forecast's model, in seconds.
    assert [batch["planned"] > 0 for batch in summary["batch_list"]] == [True] * 8
    assert len(progress.eta_errors(summary["batch_list"])) == 4
    assert sorted(ids) == sorted(f"q{i}" for i in range(40))  # each once


def test_forecast_cli_refuses_a_bad_pilot_share_and_defaults_to_the_pilots_share(capsys):
    assert cli.main(["forecast", "--params", "cpu", "--pilot-share", "2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("error: --pilot-share 2")
    # The command's default is the pilot's own (the parser cannot import it: the pilot imports torch).
    from workbook.forecast import pilot
    forecast = cli.build_parser().parse_args(["forecast", "--params", "cpu"])
    assert forecast.pilot_share == pilot.DEFAULT_SHARE
    with pytest.raises(SystemExit):
        cli.main(["forecast", "--help"])
    assert f"default {pilot.DEFAULT_SHARE:g}" in " ".join(capsys.readouterr().out.split())


def test_the_jobs_eta_uses_the_forecasts_timings(tmp_path):
    """The job's ETA plans each batch with the timings its forecast measured (the same model)."""
    known = timings()
    made = {"mode": "generate", "timings": known.to_dict(), "pilot": {"output_lengths": [[30, [4, 4]]]},
            "job": {"max_new_tokens": 8}}
    (tmp_path / "out.forecast.json").write_text(json.dumps(made))
    planned = eta.planned_batch_seconds(json.loads((tmp_path / "out.forecast.json").read_text()))
    batch = [generation.Prompt(i, [1] * length, 8) for i, length in enumerate([50, 40])]
    assert planned([batch]) == [pytest.approx(sum(forecast.batch_seconds(2, 50, 4, known)))]
    assert progress.planned_by_prompt(recorded_forecast.eta_plan(tmp_path / "none.forecast.json")) is None


def test_a_streams_eta_plans_its_groups_of_completions_by_the_forecasts_model(tmp_path):
    """A stream (continuous) counts progress in groups of batch_size completed requests: each group's
    planned seconds come from the forecast's simulated schedule, they add up to the simulated stream,
    and the manager's start and stop fall in the last group (the progress starts once it runs)."""
    known = dataclasses.replace(stream_timings(), warm_up_seconds=0.25)
    made = {"mode": "generate", "timings": known.to_dict(), "pilot": {"output_lengths": [[50, [30, 2, 2, 2]]]}}
    (tmp_path / "out.forecast.json").write_text(json.dumps(made))
    planned = eta.planned_batch_seconds(json.loads((tmp_path / "out.forecast.json").read_text()))
    batches = [[generation.Prompt(4 * b + i, [1] * 50, 32) for i in range(4)] for b in range(4)]
    seconds = planned(batches)
    whole = stream_forecast.simulate_stream([50] * 16, prompts_per_call=4, max_new_tokens=32, timings=known,
                                            outputs=OutputLengths([(50, [30, 2, 2, 2])]), include_startup=False)
    assert len(seconds) == 4 and sum(seconds) == pytest.approx(whole.seconds)
    # By hand (4 slots): the three short answers of the first group end after step 1, the long one at
    # step 29; each short answer admitted later takes the slot one frees. Completions, in steps run:
    finished: list = []
    requests = stream_forecast.queue_outputs([50] * 16, 4, 32, OutputLengths([(50, [30, 2, 2, 2])]))
    stream_forecast.schedule(requests, 4, stream_forecast.batch_tokens(4, [50] * 16), finished)
    assert [work[0] for work in finished] == [2, 2, 2, 4, 4, 6, 8, 10, 12, 30, 32, 32, 34, 34, 34, 42]
    # The first group closes after step 3: 4 steps, 200 + 150 prompt tokens and 4 + 1 + 4 decoded, the warm-up.
    assert seconds[0] == pytest.approx(0.25 + 0.01 * 4 + 0.001 * (350 + 9))
    assert seconds[-1] > 0.5  # the manager's start and stop


def test_a_runs_eta_is_checked_against_the_time_it_really_had_left(tmp_path):
    """A finished run's batches, each with the ETA's plan: planned 4, 2, 2, 1, 1 s, run at twice the
    plan but the last two (1 s each). After 1 batch (10% and 25%: int(0.25 x 5) = 1) the ETA says
    2 x 6 = 12 s where 10 were left; after 2, 2 x 4 = 8 s for 6; after 3, 2 x 2 = 4 s for 2."""
    finished = [8, 12, 16, 17, 18]
    batches = [{"rank": 0, "planned": plan, "finished_at_seconds": at} for plan, at in zip([4, 2, 2, 1, 1], finished)]
    checks = progress.eta_errors(batches + [{"rank": 1, "planned": 1, "finished_at_seconds": 99}])
    assert [(c["share_of_batches"], c["after_batches"]) for c in checks] == [(0.1, 1), (0.25, 1), (0.5, 2), (0.75, 3)]
    assert [c["eta_seconds"] for c in checks] == pytest.approx([12.0, 12.0, 8.0, 4.0], abs=1e-3)
    assert [c["left_seconds"] for c in checks] == [10, 10, 6, 2]
    assert [c["error"] for c in checks] == pytest.approx([0.2, 0.2, 1 / 3, 1.0], abs=1e-4)
    assert progress.eta_errors([{"rank": 0, "planned": None, "finished_at_seconds": 1}] * 3) == []  # no plan
    # Notebook 05's table: one row per run that kept its plan, each checkpoint said and measured.
    run = tmp_path / "20260101-000000-cpu"
    run.mkdir()
    (run / "generations.summary.json").write_text(json.dumps({"batch_list": batches}))
    (run / "old.summary.json").write_text(json.dumps({"batch_list": [{"finished_at_seconds": 1}] * 3}))  # no plan
    rows = progress.eta_rows(tmp_path)
    assert [row["run"] for row in rows] == ["20260101-000000-cpu/generations.summary.json"]
    assert rows[0]["ETA error after 75% of the batches"] == "+100% (4.0 s said, 2.0 s left)"


def test_review_collects_forecast_against_measured_and_plots_it(tmp_path):
    from workbook import plots
    run = tmp_path / "20260101-000000-cpu"
    run.mkdir()
    recorded = {"predicted_wall_seconds": 100.0, "measured_wall_seconds": 90.0}
    (run / "generations.summary.json").write_text(json.dumps({"forecast": recorded}))
    (run / "training_metrics.json").write_text(json.dumps({"forecast": None}))  # a run without one
    points = forecast.forecast_points(tmp_path)
    assert points == [{"run": "20260101-000000-cpu/generations.summary.json", "predicted_seconds": 100.0,
                       "measured_seconds": 90.0, "kind": "generation"}]
    [axis] = plots.forecast_against_measured(points).axes
    [generation_points, training_points] = axis.collections[:2]
    assert generation_points.get_offsets().tolist() == [[90.0, 100.0]] and len(training_points.get_offsets()) == 0
    assert {"forecast = measured", "within 10%"} <= set(axis.get_legend_handles_labels()[1])
    [empty] = plots.forecast_against_measured([]).axes
    assert "no run recorded a forecast yet" in empty.texts[0].get_text()
    rows = [{"profile": "cpu", "wall_seconds": 3600.0, "usd": 0.0, "basis": "measured here (pilot)"},
            {"profile": "h100", "wall_seconds": 60.0, "usd": 0.04, "basis": "projected from here"},
            {"profile": "v100", "wall_seconds": None, "usd": None, "basis": "not projected"}]
    assert len(plots.forecast_costs(rows, "test").axes) == 2


def test_a_gpu_sessions_forecast_check_becomes_that_gpus_reference_for_projections(tmp_path):
    """The GPU session leaves the forecast check's file in a subfolder of the GPU's reference folder:
    its median efficiencies are what a forecast elsewhere projects that GPU's row with."""
    from workbook.bench import forecast_check
    trial = lambda decode, compute: {"wall": {"efficiency": {"decode_bandwidth": decode, "compute": compute}}}
    rows = [{"mode": "generate", "trials": [trial(0.5, 0.3), trial(0.7, 0.4), trial(0.6, 0.2)]},
            {"mode": "train", "trials": [trial(None, 0.45)]}]
    checked = {"cases": rows, "efficiency": forecast_check.measured_efficiency(rows)}
    assert checked["efficiency"] == {"generate": {"decode_bandwidth": 0.6, "compute": 0.3}, "train": {"compute": 0.45}}
    reference = tmp_path / "reference"
    (reference / "h100" / "forecast").mkdir(parents=True)
    (reference / "h100" / "forecast" / "forecast.json").write_text(json.dumps(checked))
    (reference / "cpu").mkdir()
    (reference / "cpu" / "forecast.json").write_text(json.dumps({"cases": []}))  # a check without efficiencies

    generate = forecast.reference_efficiencies("h100", "generate", root=reference)
    assert generate["decode_bandwidth"] == 0.6 and generate["file"] == str(reference / "h100/forecast/forecast.json")
    assert forecast.reference_efficiencies("h100", "train", root=reference)["compute"] == 0.45  # no decode in training
    assert forecast.reference_efficiencies("cpu", "generate", root=reference) is None
    assert forecast.reference_efficiencies("h200", "generate", root=reference) is None
    phases = forecast.Phases(decode_seconds=99.0, compute_seconds=99.0, other_seconds=1.0, decode_bytes=6e12, compute_flops=3e15)
    there = forecast.Peaks(flops=1e15, bytes_per_second=2e12, source="test")
    assert forecast.project(phases, there, there, 1, 1, generate) == pytest.approx(1 + 6e12 / (2e12 * 0.6) + 3e15 / (1e15 * 0.3))


def test_every_profile_is_projected_and_costed_on_as_many_nodes():
    """A job over two nodes: each profile runs it on two machines of its gpu_count GPUs, so its
    data-parallel phases split over all of them and it pays for all of them."""
    phases = forecast.Phases(decode_seconds=10.0, compute_seconds=4.0, other_seconds=1.0)
    peaks = dict(peak_bf16_tflops=1.0, peak_fp16_tflops=1.0, memory_bandwidth_gbs=1.0, usd_per_gpu_hour=2.0)
    here = Hardware(profile="test-here", gpu_count=1, **peaks)
    other = Hardware(profile="test-other", gpu_count=2, **peaks)
    rows = forecast.profile_rows(phases, "test-here", "bf16", forecast.profile_peaks(here, "bf16"),
                                 {"test-here": here, "test-other": other}, 15.0, "generate",
                                 processes_here=2, num_nodes=2)  # simulated for 2 nodes x 1 process
    by_name = {row["profile"]: row for row in rows}
    assert by_name["test-other"]["wall_seconds"] == pytest.approx(1 + 14 / 2)  # 4 GPUs where the job had 2
    assert by_name["test-other"]["gpu_hours"] == pytest.approx(8.0 / 3600 * 2 * 2, abs=1e-4)
    assert by_name["test-here"]["gpu_hours"] == pytest.approx(15.0 / 3600 * 1 * 2, abs=1e-4)


def test_an_fp32_job_is_projected_at_the_16_bit_peak_it_would_run_at_and_the_row_says_so():
    phases = forecast.Phases(decode_seconds=0.0, compute_seconds=8.0, other_seconds=0.0)
    here = Hardware(profile="test-here", gpu_count=1, peak_bf16_tflops=100.0, peak_fp16_tflops=100.0,
                    memory_bandwidth_gbs=1.0, usd_per_gpu_hour=1.0)
    v100 = dataclasses.replace(here, profile="test-v100", peak_bf16_tflops=0.0, peak_fp16_tflops=200.0)
    rows = {row["profile"]: row for row in forecast.profile_rows(
        phases, "test-here", "fp32", forecast.profile_peaks(here, "fp32"), {"test-here": here, "test-v100": v100},
        8.0, "train")}
    assert rows["test-v100"]["wall_seconds"] == pytest.approx(4.0)  # twice the compute: its fp16 peak
    assert rows["test-v100"]["basis"].endswith("; at test-v100's fp16 peak (it states none for fp32)")
    assert forecast.profile_peaks(here, "bf16").note == ""


@pytest.mark.slow
def test_a_generation_forecast_over_two_nodes_shards_the_prompts_and_sends_nothing_per_token(tmp_path, tiny_model_path):
    from workbook.forecast import command as forecast_command
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    prompts, output = write_prompts(tmp_path / "prompts.jsonl", 40), tmp_path / "out.jsonl"
    job = job_params(prompts, output, batch_size=4, max_new_tokens=4, num_nodes=2)
    result = pilot.forecast_generation(job, share=0.1, log=lambda line: None, model=model, tokenizer=tokenizer)
    assert result.job["processes"] == 2  # one process on each node, each with every other prompt
    assert len(result.job["batch_seconds_planned"]) == 5  # 20 prompts per process, batches of 4
    assert result.network["num_nodes"] == 2 and result.network["network_bytes_per_node_per_step"] == 0
    assert "nothing crosses the network per token" in result.network["explanation"]
    assert any(line.startswith("network: 2 node(s)") for line in forecast_command.forecast_lines(result))
    # The job's own start and exit, timed in a fresh process that imports what the job imports.
    fresh = result.pilot["fresh_process"]
    assert fresh["measured"] and "workbook.generation.job" in fresh["modules"]
    assert any(".modeling_llama" in name for name in fresh["modules"])  # the model's own transformers module
    assert 0 < fresh["startup_seconds"] < 120 and result.timings["exit_seconds"] == pytest.approx(fresh["exit_seconds"], rel=1e-3)
    assert result.timings["startup_seconds"] <= fresh["this_process_start_seconds"] + 600  # reading and loading added


def test_a_cold_first_start_is_not_charged_to_the_job_run_after_it():
    """The first command on a fresh machine imports from a cold disk (48 s measured on a fresh VM,
    2 s warm); the job run after the forecast starts warm. Its own work before the pilot (reading,
    tokenizing, loading) is kept; CPU seconds never counted the wait."""
    warm = startup.FreshProcess(startup_seconds=2.0, exit_seconds=0.5, modules=[])
    assert startup.job_startup("wall", entered=48.0, before_pilot=51.0, fresh=warm) == pytest.approx(5.0)
    assert startup.job_startup("wall", entered=1.5, before_pilot=4.5, fresh=warm) == pytest.approx(4.5)  # already warm
    assert startup.job_startup("wall", entered=48.0, before_pilot=51.0, fresh=None) == 51.0  # not measured: its own
    assert startup.job_startup("cpu", entered=3.0, before_pilot=6.0, fresh=warm) == 6.0  # no CPU measured: its own
    # CPU seconds: the fresh process's, not this one's (which imported the forecast's own modules too).
    lean = dataclasses.replace(warm, cpu_seconds=2.2)
    assert startup.job_startup("cpu", entered=3.0, before_pilot=6.0, fresh=lean) == pytest.approx(5.2)
    # Its exit: the wall time on the wall clock; in CPU seconds counted once, in the start-up's.
    assert (startup.job_exit("wall", lean), startup.job_exit("cpu", lean), startup.job_exit("wall", None)) == (0.5, 0.0, 0.0)
    assert forecast.simulate_training(10, 0, forecast.TrainingTimings(5.0, 1.0, 0.5, 0.0, 0.0, exit_seconds=0.5)) == 11.5


@pytest.mark.slow
def test_a_training_forecast_over_two_nodes_names_the_gradient_all_reduce(tmp_path):
    """Two nodes: the same micro-batches per process, so an epoch has half the steps; the gradient
    all-reduce crosses the network every step, and the forecast says it is not in its time."""
    from workbook.training import config as training_config, prepare, run_plan
    job = params.load(PARAMS_DIR / "cpu.yaml")
    job.update(num_nodes=2, micro_batch_size=4, epochs=1, max_steps=0, validation_fraction=0.0,  # no evaluation: fast
               train_output_dir=str(tmp_path / "run"), interactive=False)
    config = training_config.config_from_params(job, str(tmp_path / "plan"))
    prepared = prepare.prepare_data(config, log=lambda line: None)
    result = pilot.forecast_training(job, share=0.05, log=lambda line: None)
    assert result.job["processes"] == 2
    assert result.job["total_steps"] == run_plan.plan_run(config, prepared, processes=2).total_steps
    assert result.job["total_steps"] < run_plan.plan_run(config, prepared, processes=1).total_steps
    assert "all-reduce" in result.network["explanation"] and result.network["network_bytes_per_node_per_step"] > 0
    assert any(note.startswith("not in the time: the network") for note in result.notes)
    # The pilot ran steps of this node's own run, drawn across it, not its first steps.
    here = run_plan.plan_run(config, prepared, processes=1)
    assert result.pilot["step_indices"] == training_steps.pick_steps(
        here.total_steps, here.steps_per_epoch, max(2, math.floor(0.05 * result.job["total_steps"])))
    assert min(result.pilot["step_indices"]) >= here.total_steps // 4  # one pair: the run's middle, not its start


@pytest.mark.slow
def test_a_forecast_without_output_path_leaves_a_run_folder_that_generate_finishes(tmp_path, tiny_model_path,
                                                                                   monkeypatch, capsys):
    # The pilot's folder had outputs but no manifest: notebook 05 could not say what it was, and the job
    # that resumed it recorded nothing there.
    from workbook import notebook, runner
    folder = tmp_path / "20260101-000000-cpu"
    monkeypatch.setattr(notebook, "new_run_dir", lambda profile: folder.mkdir() or folder)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    settings = [f"prompts_path={prompts}", "batch_size=4", "max_new_tokens=4", "samples_per_prompt=1",
                "do_sample=false", "verifier=", "log_every_batches=0"]
    assert cli.main(["forecast", "--params", "cpu", "--mode", "generate", "--pilot-share", "0.2", "--set", *settings]) == 0
    manifest = json.loads((folder / runner.MANIFEST_FILE).read_text())
    assert (manifest["job"], manifest["status"]) == ("generate", "incomplete")
    assert "the forecast's pilot only; the job resumes after it: workbook generate" in manifest["error"]
    capsys.readouterr()
    assert cli.main(["generate", "--params", "cpu", "--set", *settings,
                     f"output_path={folder / 'generations.jsonl'}"]) == 0
    manifest = json.loads((folder / runner.MANIFEST_FILE).read_text())
    assert manifest["status"] == "ok" and len(manifest["resumed_at"]) == 1
    assert len((folder / "generations.jsonl").read_text().splitlines()) == 40


def test_a_range_widened_by_an_error_over_100_percent_stays_positive():
    # A busy host's pilot once fitted its own batches 10.7x off: the range read "-2327.2-2693.3 s".
    low, high = forecast.widened(100.0, 120.0, 10.67)
    assert 0 < low < 100.0 < 120.0 < high and low == pytest.approx(100.0 / 11.67)
    assert forecast.widened(100.0, 100.0, 0.03) == pytest.approx((97.09, 103.0), abs=0.01)


def test_the_range_always_holds_the_forecast_itself():
    # Resampled output lengths can all fall on one side of the pilot's own (a skewed few): the range
    # must still hold the point forecast it is printed beside.
    from types import SimpleNamespace
    observed = OutputLengths([(10, [4, 4, 4, 8])])

    def simulate(prompt_lengths, *, outputs, **job):
        return SimpleNamespace(seconds=100.0 if outputs is observed else 50.0)

    low, high = forecast.generation_range([10] * 8, prompts_per_call=4, max_new_tokens=8, timings=timings(),
                                          outputs=observed, simulate=simulate)
    assert low < 50.0 and 100.0 < high


# ---------------------------------------------------------------------------------------------
# The ETA's plan and pace, the fits and the stream's model on the cases a user meets (a short last
# batch, mixed new-token limits, a split job, a model with sliding-window layers).


def test_the_eta_paces_by_the_last_quarter_of_the_batches_done_not_a_larger_share():
    # 20 batches done: the pace is that of the last 5. The 15th batch was slow (7 s on a 1 s plan);
    # a window of 6 would take it in and double the ETA of a run now back at its plan.
    planned = [1.0] * 40
    finished = [float(i + 1) for i in range(14)] + [21.0 + i for i in range(6)]
    assert progress.remaining_seconds(planned, finished) == pytest.approx(20 * 1.0)


def test_an_eta_with_no_planned_time_in_its_recent_batches_keeps_the_plan_left_not_zero():
    # No pace can be taken from batches planned at 0 s: the ETA is the plan left as it stands.
    assert progress.remaining_seconds([0.0, 0.0, 0.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(5.0)


def test_a_runs_batches_without_a_rank_are_checked_as_a_single_process():
    # Summaries of a single process may leave the rank out: its batches are rank 0's, not nobody's.
    batches = [{"planned": plan, "finished_at_seconds": at} for plan, at in zip([4, 2, 2, 1, 1], [8, 12, 16, 17, 18])]
    assert [check["after_batches"] for check in progress.eta_errors(batches)] == [1, 1, 2, 3]


def test_a_static_batchs_eta_decodes_until_the_largest_new_token_limit_among_its_rows(tmp_path):
    # A prompt near the model's context gets a smaller max_new_tokens (2); its batch still decodes
    # until the other row's 6 tokens (the pilot's outputs, under that row's limit of 8).
    known = timings()
    made = {"mode": "generate", "timings": known.to_dict(), "pilot": {"output_lengths": [[50, [6, 6]]]}}
    (tmp_path / "out.forecast.json").write_text(json.dumps(made))
    planned = eta.planned_batch_seconds(json.loads((tmp_path / "out.forecast.json").read_text()))
    batch = [generation.Prompt(0, [1] * 50, 8), generation.Prompt(1, [1] * 40, 2)]
    assert planned([batch]) == [pytest.approx(sum(forecast.batch_seconds(2, 50, 6, known)))]


def test_a_streams_eta_plans_one_entry_per_batch_when_the_last_batch_is_short(tmp_path):
    # 14 requests in groups of 4: the progress closes 4 groups (the last of 2), so the plan has 4
    # entries, each a group of batch_size completions, not of the short last batch's size.
    made = {"mode": "generate", "timings": stream_timings().to_dict(), "pilot": {"output_lengths": [[50, [3]]]}}
    (tmp_path / "out.forecast.json").write_text(json.dumps(made))
    planned = eta.planned_batch_seconds(json.loads((tmp_path / "out.forecast.json").read_text()))
    prompts = [generation.Prompt(i, [1] * 50, 8) for i in range(14)]
    seconds = planned([prompts[start:start + 4] for start in range(0, 14, 4)])
    whole = stream_forecast.simulate_stream([50] * 14, prompts_per_call=4, max_new_tokens=8, timings=stream_timings(),
                                            outputs=OutputLengths([(50, [3])]), include_startup=False)
    assert len(seconds) == 4 and sum(seconds) == pytest.approx(whole.seconds)


def test_without_a_forecast_a_batch_costs_its_rows_times_its_longest_prompt_and_new_token_limit():
    # The ETA's plan without a pilot: positions computed. A batch allowed 100 new tokens is dearer
    # than one of the same prompts allowed 10: its decode runs longer.
    first = [generation.Prompt(0, [1] * 50, 10), generation.Prompt(1, [1] * 40, 10)]
    second = [generation.Prompt(2, [1] * 30, 100)]
    assert progress.positions_cost([first, second]) == [2 * (50 + 10), 1 * (30 + 100)]


def test_a_pilot_of_one_length_prices_its_prefill_per_token_and_its_steps_as_fixed():
    # One distinct x cannot separate a fixed cost from a per-unit one: a prefill's time scales with its
    # tokens (a line through 0), a decode step's is fixed (reading the weights).
    assert regression.fit_line([100, 100], [2.0, 3.0]) == pytest.approx((0.0, 0.025))
    assert regression.fit_line([100, 100], [2.0, 3.0], single="intercept") == pytest.approx((2.5, 0.0))


def test_the_nonnegative_fit_recovers_costs_that_need_every_column():
    # Fixed, per-token and per-pair costs all positive: only the full set of columns fits them exactly.
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    columns = [[1.0] * 5, xs, [x * x for x in xs]]
    ys = [0.5 + 0.2 * x + 0.03 * x * x for x in xs]
    assert regression.fit_nonnegative(columns, ys) == pytest.approx([0.5, 0.2, 0.03], rel=1e-6)


def test_a_streams_requests_take_the_outputs_seen_nearest_their_groups_longest_prompt_capped_at_the_limit():
    # The pilot saw 50-token answers to 100-token prompts and 2-token answers to 10-token ones: a group
    # led by a 100-token prompt answers at length, whatever its shortest prompt; a job allowed 40 new
    # tokens caps the long answers at 40.
    seen = OutputLengths([(100, [50]), (10, [2])])
    requests = stream_forecast.queue_outputs([10, 100, 20, 90, 10, 12, 11, 9], 4, 64, seen)
    assert requests == [(100, 50), (90, 50), (20, 50), (12, 50), (11, 2), (10, 2), (10, 2), (9, 2)]
    assert [output for _, output in stream_forecast.queue_outputs([100] * 4, 4, 40, seen)] == [40] * 4


def test_a_streams_forecast_with_startup_adds_the_jobs_start_and_exit():
    known = dataclasses.replace(stream_timings(), startup_seconds=3.0, exit_seconds=1.0)
    job = dict(prompts_per_call=4, max_new_tokens=8, timings=known, outputs=OutputLengths([(50, [3])]))
    without = stream_forecast.simulate_stream([50] * 8, include_startup=False, **job)
    assert stream_forecast.simulate_stream([50] * 8, **job).seconds == pytest.approx(without.seconds + 3.0 + 1.0)


def test_a_split_streams_forecast_is_the_slowest_processs():
    # Two processes take every other prompt of the sorted list: [100, 10] and [10]; the job ends with the first.
    job = dict(prompts_per_call=2, max_new_tokens=8, timings=stream_timings(), outputs=OutputLengths([(50, [3])]))
    split = stream_forecast.simulate_stream([10, 100, 10], processes=2, **job)
    assert split.seconds == pytest.approx(stream_forecast.simulate_stream([100, 10], **job).seconds)
    assert split.seconds > stream_forecast.simulate_stream([10], **job).seconds


def test_a_streams_batch_shares_weigh_prompt_and_output_tokens():
    # Each group's share of the stream's stepping: its prompts' and outputs' tokens over the whole's.
    outputs = OutputLengths([(50, [30]), (10, [2])])
    result = stream_forecast.simulate_stream([50, 50, 10, 10], prompts_per_call=2, max_new_tokens=32,
                                             timings=stream_timings(), outputs=outputs, include_startup=False)
    stepping = result.prefill_seconds + result.decode_seconds
    assert result.batch_seconds == pytest.approx([stepping * 160 / 184, stepping * 24 / 184])


def test_a_streams_step_is_described_by_its_sequences_queries_keys_and_mask():
    # One step of transformers' manager: a 5-token prompt chunk and two decoding requests (10 and 20
    # keys), a padded slot with no query; per layer type, the full-attention layers' keys and mask count.
    full_keys, window_keys = torch.tensor([0, 5, 15, 35, 35]), torch.tensor([0, 5, 9, 13, 13])
    kwargs = {"input_ids": torch.zeros(1, 7, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 5, 6, 7, 7]),
              "cu_seq_lens_k": {"sliding_attention": window_keys, "full_attention": full_keys},
              "attention_mask": {"sliding_attention": torch.zeros(1, 1, 7, 13), "full_attention": torch.zeros(1, 1, 7, 35)}}
    (work,) = stream_forecast.step_work((), kwargs)
    assert work == stream_forecast.StepWork(steps=1, tokens=7, sequences=3, prefill_pairs=5 * 5, decode_keys=10 + 20,
                                            mask_pairs=7 * 35)


def test_the_eta_plan_left_beside_the_output_prices_the_jobs_batches_as_the_forecasts_model_does(tmp_path):
    """The forecast leaves its ETA plan as plain data (seconds per prompt, by prompt length); the
    job, reading it with generation's own code, plans each of the batches the forecast priced at the
    model's seconds, and a prompt length the forecast never saw at its nearest one's."""
    known = timings()
    made = {"mode": "generate", "timings": known.to_dict(), "pilot": {"output_lengths": [[60, [6, 3]], [20, [2]]]}}
    prompts = [generation.Prompt(i, [1] * length, 8) for i, length in enumerate([60, 58, 57, 40, 39, 38, 20])]
    batches = [prompts[0:3], prompts[3:6], prompts[6:]]  # the engine's: longest first, cut every 3
    model_seconds = eta.planned_batch_seconds(made)(batches)
    (tmp_path / "out.forecast.json").write_text(json.dumps({**made, "eta_plan": eta.eta_plan(batches, model_seconds)}))
    planned = progress.planned_by_prompt(recorded_forecast.eta_plan(recorded_forecast.generation_file(tmp_path / "out.jsonl")))
    assert planned(batches) == pytest.approx(model_seconds)
    assert model_seconds[0] > model_seconds[1] > model_seconds[2]  # the longest prompts first, the dearest
    unseen = [generation.Prompt(9, [1] * 59, 8)]  # nearest priced length: 58 (the first batch's)
    assert planned([unseen]) == pytest.approx([model_seconds[0] / 3])
    # Without a plan (an older forecast, or none) the job plans by positions.
    (tmp_path / "old.forecast.json").write_text(json.dumps(made))
    assert recorded_forecast.eta_plan(tmp_path / "old.forecast.json") is None


# ---------------------------------------------------------------------------------------------
# The training pilot: steps drawn across the run, each step of the run priced by what it holds.


def test_the_training_pilots_steps_are_spread_over_every_epoch_not_the_first_ones():
    steps = training_steps.pick_steps(total_steps=300, steps_per_epoch=50, count=30)
    assert len(steps) == 30 and steps != list(range(30))
    # Evenly over the run, so every epoch in proportion (15 pairs over 6 epochs: 2 or 3 pairs each).
    assert all(sum(s // 50 == epoch for s in steps) in (4, 6) for epoch in range(6))
    every = training_steps.pick_steps(total_steps=300, steps_per_epoch=50, count=60)
    assert [sum(s // 50 == epoch for s in every) for epoch in range(6)] == [10] * 6
    # In pairs of neighbours within one epoch: a step that starts its epoch's loader always has one that does not.
    pairs = [steps[i:i + 2] for i in range(0, len(steps), 2)]
    assert all(b == a + 1 and a // 50 == b // 50 for a, b in pairs)
    # The first, middle and last tenth of the run are each timed; never the last step (it would finish the run).
    assert all(any(begin * 300 <= s < end * 300 for s in steps) for begin, end in training_steps.PHASES.values())
    assert max(steps) < 299
    # An epoch of one step has no neighbour in it: the pair spans two epochs.
    assert training_steps.pick_steps(10, 1, 4) == [1, 2, 5, 6] and training_steps.pick_steps(1, 1, 4) == [0]
    assert training_steps.loader_starts([3, 4, 51, 52, 55], 50) == [True, False, True, False, False]


def test_each_step_of_the_run_holds_the_rows_the_loop_serves_it():
    """A step's content is what the loop's loader gives it: epoch e's micro-batches, step s taking
    s x A x W up to (s + 1) x A x W - 1, per process; a new epoch deals the rows out afresh."""
    from types import SimpleNamespace
    from workbook.training import batches
    lengths = [5, 60, 7, 3, 40, 9, 12, 30, 2, 50, 8, 6]
    rows = batches.plan_rows(lengths, "packing", 64)
    run = SimpleNamespace(gradient_accumulation_steps=1, processes=2, micro_batch_size=1, steps_per_epoch=len(rows) // 2,
                          total_steps=len(rows))  # two epochs
    contents = training_steps.run_step_contents(rows, lengths, "packing", run, seed=0)
    assert len(contents) == run.total_steps
    for epoch in range(2):
        micro = batches.epoch_micro_batches(rows, lengths, "packing", micro_batch_size=1, seed=0, epoch=epoch)
        for step in range(run.steps_per_epoch):
            documents = [lengths[i] for batch in micro[2 * step:2 * step + 2] for row in batch for i in row]
            content = contents[epoch * run.steps_per_epoch + step]
            assert (content.tokens, content.attention_pairs) == (sum(documents) / 2, sum(n * n for n in documents) / 2)
    assert contents[:run.steps_per_epoch] != contents[run.steps_per_epoch:]  # the order changes with the epoch


def test_a_step_the_pilot_did_not_run_is_priced_by_what_it_holds():
    """Steps whose seconds follow 0.01 + 1e-5 per token + 2e-7 per attention pair: the model fitted to
    a few of them prices every other step, a row of few long documents dearer than one of many short."""
    truth = training_steps.StepModel(0.01, 1e-5, 2e-7)
    rng = random.Random(0)
    contents = [training_steps.StepContent(tokens, tokens * rng.choice([8, 64, 500]))
                for tokens in (rng.randint(200, 1000) for _ in range(200))]
    timed = [3, 4, 50, 51, 100, 101, 150, 151]
    model = training_steps.fit([contents[s] for s in timed], [truth.seconds(contents[s]) for s in timed])
    assert [model.seconds(c) for c in contents] == pytest.approx([truth.seconds(c) for c in contents], rel=1e-6)
    assert model.fit_error == pytest.approx(0.0, abs=1e-9)
    few_long = training_steps.StepContent(512, 2 * 256 ** 2)
    many_short = training_steps.StepContent(512, 32 * 16 ** 2)
    assert model.seconds(few_long) > model.seconds(many_short)
    # Per phase of the run (first, middle and last tenth): the mean of the steps in it.
    phases = training_steps.phase_means([1.0] * 10 + [2.0] * 80 + [3.0] * 10)
    assert phases == {"first tenth": 1.0, "middle tenth": 2.0, "last tenth": 3.0}
    assert training_steps.phase_means([None] * 10 + [2.0] * 90)["first tenth"] is None


def test_the_loop_runs_only_the_pilots_steps_each_with_the_rows_the_run_gives_it(tmp_path):
    """The pilot's steps run through the training loop itself (its loader, its step, its timing), each
    with the rows the whole run would give that step, so a step's time in the pilot is the run's."""
    from workbook import training
    from workbook.training import batches, prepare, run_plan
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + {i % 9}?" + " please" * (i % 7),
                                        "output": str(i + i % 9)}) + "\n" for i in range(48)))
    config = training.TrainConfig(model="tiny", data_path=str(data), data_description="test data",
                                  output_dir=str(tmp_path / "out"), validation_fraction=0.0, micro_batch_size=2,
                                  learning_rate=1e-3, max_steps=0, epochs=3, warmup_steps=0, save_every_steps=0,
                                  dtype="fp32", tf32=False, dataloader_workers=0, pin_memory=False,
                                  use_chat_template=False)
    prepared = prepare.prepare_data(config, log=lambda line: None)
    run = run_plan.plan_run(config, prepared)
    lengths = [example.length for example in prepared.train]
    contents = training_steps.run_step_contents(batches.plan_rows(lengths, config.padding, prepared.max_seq_length),
                                                lengths, config.padding, run, config.seed)
    chosen = training_steps.pick_steps(run.total_steps, run.steps_per_epoch, 6)
    assert len({step // run.steps_per_epoch for step in chosen}) == 3  # every epoch
    result = training.train(dataclasses.replace(config, run_only_steps=tuple(chosen)), prepared)
    assert [record["step"] for record in result["history"]] == [step + 1 for step in chosen]
    assert [record["tokens"] for record in result["history"]] == [contents[step].tokens for step in chosen]
    assert result["status"] != "finished"  # the last step is never the pilot's: no final model saved
