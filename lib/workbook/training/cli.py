"""``workbook train`` and ``python -m workbook.training`` (the entry point for ``accelerate launch``
and ``torchrun``, one process per GPU; every process gets the same --run-dir)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from workbook import jsonl, notebook, runner, runtime
from workbook.planner import DoesNotFitError
from workbook.training.config import TrainError, config_from_params
from workbook.training.loop import train
from workbook.training.prepare import prepare_data
from workbook.training.processes import launch
from workbook.training.report import summary_lines


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook train --params FILE [--set key=value ...]`: train into a new run folder (or
    train_output_dir); train_processes > 1 forks that many processes here (one per GPU)."""
    params = runner.resolve_params(params_arg, overrides, log=lambda line: print(line, file=sys.stderr))[0]
    run_dir = notebook.new_run_dir(params["profile"])
    return _run_and_report(params, run_dir, created=True)


def _run_and_report(params, run_dir: Path, created: bool = False) -> int:
    try:
        config = config_from_params(params, run_dir)
        prepared = prepare_data(config)
        print(f"data: {prepared.source}; {len(prepared.train)} train / {len(prepared.validation)} validation examples; "
              f"max_seq_length {prepared.max_seq_length} ({prepared.max_seq_length_rule}); "
              f"{prepared.truncation['truncated']} truncated", flush=True)
        result = launch(config, prepared)
    except (TrainError, jsonl.DataError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if still empty: leave no folder behind for a run that never started
        return 2
    (Path(run_dir) / "training_metrics.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    for line in summary_lines(result):
        print(line)
    print(f"metrics: {Path(run_dir) / 'training_metrics.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m workbook.training`: the entry point for `accelerate launch` and `torchrun`, one
    process per GPU; every process gets the same --run-dir."""
    parser = argparse.ArgumentParser(prog="python -m workbook.training",
                                     description="Supervised fine-tuning on input/output JSONL.")
    parser.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override a parameter")
    parser.add_argument("--run-dir", help="run folder shared by all processes (required with several processes)")
    args = parser.parse_args(argv)
    params = runner.resolve_params(args.params, args.set, log=lambda line: print(line, file=sys.stderr))[0]
    if runtime.launched_processes() > 1 and not args.run_dir:
        print("error: pass --run-dir DIR: every process of the launch must write to the same folder", file=sys.stderr)
        return 2
    if args.run_dir:
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = notebook.new_run_dir(params["profile"])
    if not runtime.inside_launcher():
        return _run_and_report(params, run_dir, created=not args.run_dir)
    try:  # one of the launched processes: the launcher made them, train here
        result = train(config_from_params(params, run_dir))
    except (TrainError, jsonl.DataError, DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        (run_dir / "training_metrics.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        print("\n".join(summary_lines(result)))
    return 0
