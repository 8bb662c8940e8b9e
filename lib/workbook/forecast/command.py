"""`workbook forecast`: run the pilot (``pilot``), print the forecast, and record it where the job
reads it back (``<output>.forecast.json``; training: ``<train_output_dir>/forecast.json``)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from workbook import jsonl, notebook, params as params_module, recorded_forecast, runner
from workbook.forecast import model as forecast, roofline, seed_example
from workbook.forecast.settings import ForecastSettings
from workbook.forecast.pilot import forecast_generation, forecast_training
from workbook.generation.engine import GenerationError
from workbook.generation.files import OUTPUT_FILE_NAME
from workbook.hardware import Hardware
from workbook.planner import network
from workbook.planner.fit import lines_for_unfit_run
from workbook.planner.plans import DoesNotFitError
from workbook.training.config import TrainError


def forecast_lines(result: forecast.Forecast) -> list[str]:
    """The forecast in words and a table, for the terminal."""
    low, high = result.predicted_wall_seconds_range
    nodes = result.network.get("num_nodes", 1)
    where = "here" if nodes == 1 else f"on {nodes} nodes like this one"
    pilot = result.pilot
    what = (f"{pilot['batches']} batch(es), {pilot['prompts']} outputs ({pilot['share_of_job_batches']:.1%} of the "
            f"job's batches), written to {pilot['written_to']}" if result.mode == "generate" else
            f"{pilot['steps']} steps ({pilot['share_of_job_steps']:.1%} of the run; not reused by it)")
    lines = [f"pilot on this machine ({result.profile}): {what}, {pilot['seconds']:.1f} s",
             f"forecast, the whole job as a fresh run {where}: {result.predicted_wall_seconds:.1f} s "
             f"(range {low:.1f}-{high:.1f} s), {result.cost['gpu_hours']:.3f} GPU-hours, ${result.cost['usd']:.2f} "
             f"at ${result.cost['usd_per_gpu_hour']:g}/GPU-hour (usd_per_gpu_hour: your rate)"]
    if result.mode == "generate":
        lines.append(f"still to run after the pilot (its outputs count): {result.remaining_wall_seconds:.1f} s")
    if nodes > 1:
        lines.append(network.traffic_line(result.network))
    rows = [{"profile": row["profile"], "wall": "-" if row["wall_seconds"] is None else units_seconds(row["wall_seconds"]),
             "GPU-hours": row["gpu_hours"], "USD": row["usd"], "basis": row["basis"]} for row in result.profiles]
    return lines + ["", notebook.markdown_table(rows)] + [f"note: {note}" for note in result.notes]


def units_seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def cli_main(params_arg: str, overrides: list[str], *, mode: str | None, as_json: bool, share: float,
             seconds: float | None, clock: str = "wall", method: str = "pilot", expected_new_tokens: str | None = None,
             seed_000: str | None = None) -> int:
    """`workbook forecast`: pilot, forecast, print; the forecast is also written beside the job's
    output (``<output>.forecast.json``; training: ``<train_output_dir>/forecast.json``) so the
    run records the forecast it started with. ``method`` 'work' forecasts from the job's work
    without a pilot (``roofline``), 'both' shows the two side by side, 'auto' pilots where this
    machine can run the model; ``expected_new_tokens``: the key of that name, given on the command line;
    ``seed_000``: a folder for seed 000's job forecast on every profile."""

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if seed_000:
        record = seed_example.write(seed_000, f"workbook forecast --seed-000 {seed_000}", log=say)
        print(json.dumps(record, indent=2) if as_json else (Path(seed_000) / "seed_000_forecast.md").read_text())
        return 0
    params, _, _ = runner.resolve_params(params_arg, overrides, log=say)
    if expected_new_tokens is not None:
        try:
            params = params_module.apply_overrides(params, {"expected_new_tokens": params_module.validate_value(
                "expected_new_tokens", expected_new_tokens, "--expected-new-tokens")})
        except params_module.ParamsError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    own = ForecastSettings.from_params(params)  # the forecast's own keys; the jobs build theirs at their entry
    mode = mode or own.plan_mode
    method = roofline.pilot_or_work(own.model, Hardware.from_params(params)) if method == "auto" else method
    if method == "work":
        return _without_pilot(params, mode, as_json, None, say)
    if not 0 < share <= 1:
        print(f"error: --pilot-share {share}: expected a share of the job in (0, 1], e.g. 0.1", file=sys.stderr)
        return 2
    if seconds is not None and not 0 < seconds < float("inf"):  # NaN fails it too
        print(f"error: --pilot-seconds {seconds}: expected a number of seconds > 0, e.g. 60", file=sys.stderr)
        return 2
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the training loop prints its progress; --json owns stdout
            result, record = _forecast_and_record(params, own, params_arg, overrides, mode, share, seconds, say, clock)
    except (GenerationError, TrainError, jsonl.DataError, ValueError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        if isinstance(error, DoesNotFitError):
            for line in lines_for_unfit_run(params, error):
                print(line, file=sys.stderr)
        return 2
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if method == "both":
        say(f"pilot forecast recorded in {record}")
        return _without_pilot(params, mode, as_json, result, say)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print("\n".join(forecast_lines(result)) + f"\nforecast: {record}")
    return 0


def _forecast_and_record(params, own: ForecastSettings, params_arg, overrides, mode, share, seconds, say, clock):
    """The forecast, and the file it is recorded in for the run to read back."""
    if mode == "generate":
        job, output_path = None, own.output_path
        if not output_path:
            folder = notebook.new_run_dir(own.profile)
            output_path = str(folder / OUTPUT_FILE_NAME)
            params = params_module.Params({**params, "output_path": output_path})
            # The pilot's folder is the job's: notebook 05 lists it, and `workbook generate` resumes its record.
            job = runner.start_job(folder, "generate", params, params_arg, overrides)
        settings = " ".join(item for item in overrides if not item.startswith("output_path="))
        resume = (f"workbook generate --params {params_arg} --set {settings + ' ' if settings else ''}"
                  f"output_path={output_path}")
        try:
            result = forecast_generation(params, share=share, seconds=seconds, log=say, clock=clock)
        except Exception as error:
            runner.finish_job(job, 2, error)
            raise
        runner.finish_job(job, 1, f"the forecast's pilot only; the job resumes after it: {resume}")
        record = recorded_forecast.generation_file(output_path)
        say(f"the pilot's outputs are in {output_path}; the job resumes after them: {resume}")
    else:
        result = forecast_training(params, share=share, seconds=seconds, log=say, clock=clock)
        record = recorded_forecast.training_file(own.train_output_dir or notebook.new_run_dir(own.profile))
    return result, record


def _without_pilot(params, mode: str, as_json: bool, pilot: forecast.Forecast | None, say) -> int:
    """The forecast from the job's work on every profile (no pilot, no weights, no GPU); a pilot
    forecast's rows beside it when one was made."""
    try:
        made = (roofline.forecast_without_pilot(params, log=say) if mode == "generate"
                else roofline.forecast_training_without_pilot(params))
    except (jsonl.DataError, ValueError, OSError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        if isinstance(error, DoesNotFitError):
            for line in lines_for_unfit_run(params, error):
                print(line, file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"without_pilot": made.to_dict(), **({"pilot": pilot.to_dict()} if pilot else {})}, indent=2))
    else:
        print("\n".join((forecast_lines(pilot) + [""] if pilot else [])
                        + roofline.forecast_lines(made, pilot.profiles if pilot else None)))
    return 0
