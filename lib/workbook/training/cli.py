"""``workbook train`` and ``python -m workbook.training`` (the entry point for ``accelerate launch``
and ``torchrun``, one process per GPU; every process gets the same --run-dir).

Without --run-dir the run folder is chosen by ``run_folder.choose``: the same command after a kill
resumes the run it interrupted, otherwise a new folder; the console says which.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from workbook import job_keys, jsonl, notebook, params as params_module, recorded_forecast, runner, runtime
from workbook.arguments import WorkbookParser, add_set_argument
from workbook.params import ParamsError
from workbook.planner import DoesNotFitError, fit
from workbook.training import checkpoints, run_folder
from workbook.training.config import TrainError, config_from_params
from workbook.training.loop import train
from workbook.training.prepare import prepare_data
from workbook.training.processes import launch
from workbook.training.report import summary_lines
from workbook.training.run_plan import plan_run

METRICS_FILE = "training_metrics.json"  # in the run folder, beside the training folder it describes


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook train --params FILE [--set key=value ...]`: train in a new run folder, or resume the
    one the same command left unfinished (or train_output_dir); train_processes > 1 forks that many
    processes here (one per GPU)."""
    params = runner.resolve_params(params_arg, overrides, log=lambda line: print(line, file=sys.stderr))[0]
    return _train_in_chosen_folder(params, run_folder.FolderSettings.from_params(params), params_arg, overrides)


def _train_in_chosen_folder(params, wanted: run_folder.FolderSettings, params_arg: str, overrides: list[str]) -> int:
    command = shlex.join(["workbook", "train", "--params", params_arg] + (["--set", *overrides] if overrides else []))
    try:
        folder = run_folder.choose(wanted, command)
    except TrainError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. a read-only outputs folder: said before any model loads
        where = (f"train_output_dir {wanted.train_output_dir} must be a folder you can write (or one that can be "
                 "created)" if wanted.train_output_dir else
                 f"make {run_folder.OUTPUTS_DIR} writable, or set train_output_dir to a writable folder")
        print(f"error: cannot create or lock a run folder ({error}); {where}", file=sys.stderr)
        return 2
    print(folder.note, flush=True)
    job = runner.start_job(folder.path, "train", params, params_arg, overrides)  # notebook 05 lists the run
    try:
        code = _run_and_report(params, folder.path)
    except Exception as error:  # a bug's traceback: the manifest says 'failed', not 'running' for ever
        runner.finish_job(job, 3, error)
        raise
    finally:
        folder.release()
    runner.finish_job(job, code)
    if code != 0:
        folder.discard()  # leaves no folder behind for a run that never started
    return code


def _run_and_report(params, run_dir: Path) -> int:
    try:
        config = config_from_params(params, run_dir)
        prepared = prepare_data(config)
        print(f"data: {prepared.source}; {len(prepared.train)} train / {len(prepared.validation)} validation examples; "
              f"max_seq_length {prepared.max_seq_length} ({prepared.max_seq_length_rule}); "
              f"{prepared.truncation['truncated']} truncated", flush=True)
        run = plan_run(config, prepared)  # too little data for the processes' steps: said here, not by every child
        checkpoint = checkpoints.latest_checkpoint(config.output_dir)
        if checkpoint is not None:  # refuse a checkpoint of other data or settings before the model loads
            checkpoints.resumable_state(checkpoint, checkpoints.fingerprint(config, prepared, run))
        result = launch(config, prepared)
    except (TrainError, jsonl.DataError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        if isinstance(error, DoesNotFitError):
            for line in fit.lines_for_unfit_run(params, error):
                print(line, file=sys.stderr)
        return 2
    write_metrics(result, config, run_dir)
    for line in summary_lines(result):
        print(line)
    print(f"metrics: {Path(run_dir) / METRICS_FILE}")
    return 0


def write_metrics(result: dict, config, run_dir: Path) -> None:
    """The run's metrics file, with the forecast `workbook forecast --mode train` left in the
    training folder beside what this run measured."""
    clock = "this process's start to the end of training (start-up included, as forecast)"
    if runtime.inside_launcher():
        clock += "; launched: this rank's start, after the launcher's own"
    result["forecast"] = recorded_forecast.beside_measured(recorded_forecast.training_file(config.output_dir),
                                                           runtime.process_age_seconds(), clock)
    (Path(run_dir) / METRICS_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m workbook.training`: the entry point for `accelerate launch` and `torchrun`, one
    process per GPU; every process gets the same --run-dir."""
    parser = WorkbookParser(prog="python -m workbook.training", keys=job_keys.READ_BY["train"],
                            schema=params_module.SCHEMA,
                            description="Supervised fine-tuning on input/output JSONL.")
    parser.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
    add_set_argument(parser)
    parser.add_argument("--run-dir", help="run folder shared by all processes (required with several processes)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        params = runner.resolve_params(args.params, args.set, log=lambda line: print(line, file=sys.stderr))[0]
        wanted = run_folder.FolderSettings.from_params(params)
    except ParamsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if runtime.launched_processes() > 1 and not args.run_dir:
        print("error: pass --run-dir DIR: every process of the launch must write to the same folder", file=sys.stderr)
        return 2
    if not runtime.inside_launcher():
        if not args.run_dir:
            return _train_in_chosen_folder(params, wanted, args.params, args.set)
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        return _run_and_report(params, Path(args.run_dir))
    run_dir = Path(args.run_dir) if args.run_dir else notebook.new_run_dir(wanted.profile)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:  # one of the launched processes: the launcher made them, train here
        config = config_from_params(params, run_dir)
        result = train(config)
    except (TrainError, jsonl.DataError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        write_metrics(result, config, run_dir)
        print("\n".join(summary_lines(result)))
    return 0
