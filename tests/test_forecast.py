"""The forecast: the job simulated from a pilot's timings, the pilot drawn across the length
distribution, its outputs kept by the job (generated once), and the ETA from the same model."""

import json
import random

import pytest

from workbook import cli, generation, params
from workbook.paths import PARAMS_DIR, REPO_ROOT
from workbook.planner import forecast, pilot
from workbook.planner.forecast import GenerationTimings, OutputLengths


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


def test_fitted_timings_predict_batches_the_pilot_did_not_run():
    """Calls made from known costs: the fit recovers them, and the simulation then predicts the
    time of a batch of other lengths."""
    truth = timings(call_overhead_seconds=0.0, write_seconds_per_output=0.0)

    def fake_call(rows, longest, outputs):
        forwards, clock = [], 0.0
        prefill = truth.prefill_fixed_seconds + truth.prefill_seconds_per_token * rows * longest
        forwards.append((clock, clock + prefill, longest))
        clock += prefill
        for step in range(1, max(outputs)):
            seconds = truth.step_fixed_seconds + truth.step_seconds_per_context_token * rows * (longest + step)
            forwards.append((clock, clock + seconds, longest + step))
            clock += seconds
        return pilot.Call(rows, longest, clock, forwards, outputs, written_seconds=clock)

    calls = [fake_call(8, 100, [6] * 8), fake_call(8, 20, [6] * 8)]
    fitted, error = pilot.fit_generation(calls, warm_up_seconds=0.0, startup_seconds=0.0)
    assert fitted.prefill_seconds_per_token == pytest.approx(truth.prefill_seconds_per_token, rel=1e-6)
    assert fitted.step_seconds_per_context_token == pytest.approx(truth.step_seconds_per_context_token, rel=1e-6)
    assert error == pytest.approx(0.0, abs=1e-9)
    unseen = fake_call(8, 60, [6] * 8)
    predicted = forecast.simulate_generation([60] * 8, prompts_per_call=8, max_new_tokens=8, timings=fitted,
                                             outputs=OutputLengths([(60, [6])]), include_startup=False)
    assert predicted.seconds == pytest.approx(unseen.seconds, rel=1e-6)


def test_pilot_batches_span_the_length_distribution():
    batches = [[length] * 4 for length in range(200, 0, -10)]  # 20 full batches, longest first
    chosen = pilot.pick_batches(batches, share=0.1)
    assert chosen == [5, 15]  # 10% of 20 batches, one from each half, not the first lines
    assert len(pilot.pick_batches(batches, share=0.01)) == 1  # at least one batch
    assert pilot.pick_batches(batches + [[1]], share=1.0)[-1] == 19  # the short last batch is not the job's shape


def test_eta_counts_the_planned_time_left_not_the_examples_left():
    planned = [4.0, 3.0, 2.0, 1.0]  # longest prompts first: the first batch is the slowest
    # One batch done in 8 s, twice its plan: the rest takes twice theirs.
    assert forecast.remaining_seconds(planned, batches_done=1, elapsed_seconds=8.0) == pytest.approx(12.0)
    examples_left_estimate = 8.0 * 3  # 8 s per batch so far, 3 batches left
    assert forecast.remaining_seconds(planned, 1, 8.0) < examples_left_estimate
    assert forecast.remaining_seconds(planned, 0, 0.0) == pytest.approx(10.0)


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
                  interactive=False)
    for key, value in changes.items():
        values[key] = params.validate_value(key, value, "test")
    return values


def test_pilot_outputs_are_kept_by_the_job_and_generated_once(tmp_path, tiny_model_path):
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    prompts, output = write_prompts(tmp_path / "prompts.jsonl", 40), tmp_path / "out.jsonl"
    job = job_params(prompts, output, batch_size=4, max_new_tokens=4)
    result = pilot.forecast_generation(job, share=0.2, log=lambda line: None, model=model, tokenizer=tokenizer)
    piloted = [json.loads(line)["metadata"]["example_id"] for line in output.read_text().splitlines()]
    assert result.pilot["batches"] == 2 and len(piloted) == 8  # 20% of the 10 batches
    assert result.predicted_wall_seconds_range[0] <= result.predicted_wall_seconds <= result.predicted_wall_seconds_range[1]
    assert result.remaining_wall_seconds < result.predicted_wall_seconds
    assert {row["profile"] for row in result.profiles} == set(params.profile_names())
    output.with_suffix(forecast.FORECAST_SUFFIX).write_text(json.dumps(result.to_dict()))  # as the CLI does
    summary = generation.run_job(job, output, model=model, tokenizer=tokenizer, log=lambda line: None,
                                 show_progress=False)
    # The run records the forecast it started with: the time left after the pilot, beside its own.
    assert summary["forecast"]["compared_with"] == "remaining after the pilot"
    assert summary["forecast"]["predicted_wall_seconds"] == pytest.approx(result.remaining_wall_seconds, rel=1e-3)
    ids = [json.loads(line)["metadata"]["example_id"] for line in output.read_text().splitlines()]
    assert summary["generated"] == 40 - 8  # the job generated only what the pilot had not
    assert sorted(ids) == sorted(f"q{i}" for i in range(40))  # each once


def test_forecast_cli_refuses_a_bad_pilot_share(capsys):
    assert cli.main(["forecast", "--params", "cpu", "--pilot-share", "2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("error: --pilot-share 2")


def test_the_jobs_eta_uses_the_forecasts_timings(tmp_path):
    """The job's ETA plans each batch with the timings its forecast measured (the same model)."""
    known = timings()
    made = {"mode": "generate", "timings": known.to_dict(), "pilot": {"output_lengths": [[30, [4, 4]]]},
            "job": {"max_new_tokens": 8}}
    (tmp_path / "out.forecast.json").write_text(json.dumps(made))
    planned = forecast.planned_batch_seconds(tmp_path / "out.forecast.json")
    batch = [generation.Prompt(i, [1] * length, 8) for i, length in enumerate([50, 40])]
    assert planned(batch) == pytest.approx(sum(forecast.batch_seconds(2, 50, 4, known)))
    assert forecast.planned_batch_seconds(tmp_path / "none.forecast.json") is None


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
    assert plots.forecast_against_measured(points).axes and plots.forecast_against_measured([]).axes
    rows = [{"profile": "cpu", "wall_seconds": 3600.0, "usd": 0.0, "basis": "measured here (pilot)"},
            {"profile": "h100", "wall_seconds": 60.0, "usd": 0.04, "basis": "projected from here"},
            {"profile": "v100", "wall_seconds": None, "usd": None, "basis": "not projected"}]
    assert len(plots.forecast_costs(rows, "test").axes) == 2
