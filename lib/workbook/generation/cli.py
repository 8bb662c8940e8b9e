"""``workbook generate`` and ``python -m workbook.generation`` (also under ``accelerate launch``),
and the end-of-run report in words."""

from __future__ import annotations

import sys
from pathlib import Path

from workbook import arithmetic, job_keys, jsonl, notebook, params as params_module, runner, runtime
from workbook.arguments import WorkbookParser, add_set_argument
from workbook.generation import verify
from workbook.generation.engine import GenerationError
from workbook.generation.files import resolve_output_path
from workbook.generation.processes import start
from workbook.generation.settings import GenerationSettings
from workbook.planner import DoesNotFitError


def summary_lines(summary: dict) -> list[str]:
    """The end-of-run report in words."""
    waste = summary["padding_waste"]
    # With several samples per prompt, each sample is one output: the rate counts outputs, not examples.
    outputs = "examples" if summary.get("samples_per_prompt", 1) == 1 else "outputs"
    lines = [
        f"generated {summary['generated']} {outputs} in {summary['seconds']:.1f} s: {summary['examples_per_minute']} "
        f"{outputs}/min, {summary['output_tokens_per_second']} output tokens/s"
        + (f", padding waste {waste:.1%}" if waste is not None else "")
        + f" ({summary['backend']}, batch {summary['batch_size']}, {summary['processes']} process(es))",
        f"output: {summary['output_path']} ({summary['in_output']} of {summary['examples']} examples)"
        if summary.get("samples_per_prompt", 1) == 1 else
        f"output: {summary['output_path']} ({summary['in_output']} of {summary['candidates']} outputs: "
        f"{summary['examples']} examples x {summary['samples_per_prompt']} samples)",
    ]
    if summary.get("backend_choice", "").startswith("backend auto"):
        lines.append(summary["backend_choice"])
    longest = sorted(batch["longest_output_tokens"] for batch in summary["batch_list"])
    if longest:
        limit = summary["generation_params"]["max_new_tokens"]
        lines.append(f"longest output per batch: {longest[0]} to {longest[-1]} tokens, median "
                     f"{longest[len(longest) // 2]} (max_new_tokens {limit}; every row of a static batch waits "
                     "for its longest)")
    if summary["in_failures"]:
        lines.append(f"failures: {summary['failures_path']} ({summary['in_failures']} lines: "
                     f"{summary['bad_input_lines']} bad input, {summary['too_long']} too long, "
                     f"{summary['failed']} failed alone in this run); rerunning retries the generation failures")
    if not summary.get("merged", True):
        lines.append(f"warning: the disk was full at the end, so {summary['output_path']} is not merged into input "
                     "order: every output is safe in it and its part files; free space and rerun to merge")
    if summary.get("verification"):
        lines += verify.summary_lines(summary["verification"])
    if summary["unaccounted"]:
        lines.append(f"ERROR: {summary['unaccounted']} examples are neither in the output nor in the failures "
                     f"file, e.g. {summary['unaccounted_ids'][:5]}; please report this")
    return lines


def task_accuracy(records: list[dict]) -> dict | None:
    """Accuracy on a checkable task: the arithmetic records (domain 'arithmetic' with a reference
    answer) scored by ``workbook.arithmetic``; None when the output holds none."""
    checkable = [r for r in records if r.get("domain") == arithmetic.DOMAIN
                 and r["metadata"].get("original_output") is not None]
    if not checkable:
        return None
    references = [{"id": r["metadata"]["example_id"], "output": r["metadata"]["original_output"]} for r in checkable]
    decoding = checkable[0]["metadata"].get("generation_params") or {}
    how = (f"sampled at temperature {decoding.get('temperature')}, top_p {decoding.get('top_p')}"
           if decoding.get("do_sample") else "greedy")
    return {"task": arithmetic.DOMAIN, "scored": len(checkable), "decoding": how,
            "accuracy": arithmetic.accuracy(references, [r["output"] for r in checkable])}


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook generate --params FILE [--set key=value ...]`. Exit 0 when every example was
    generated, 1 when some are in the failures file, 2 when the job could not run."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    run = None  # the run folder this command records itself in (manifest.json), when it made one
    try:
        params, params_file, _ = runner.resolve_params(params_arg, overrides, log=say)
        settings = GenerationSettings.from_params(params)  # once: the job below reads these
        output_path = None
        if not settings.output_path and runtime.launched_processes() == 1:
            run = runner.start_job(notebook.new_run_dir(settings.profile), "generate", params, params_file, overrides)
            output_path = resolve_output_path("", run.run_dir)
            given = " ".join(overrides)
            say(f"writing to {output_path}; to resume after an interruption: workbook generate --params "
                f"{params_arg} --set {given + ' ' if given else ''}output_path={output_path}")
        elif runtime.launched_processes() == 1 and runner.job_folder(Path(settings.output_path), "generate"):
            run = runner.start_job(Path(settings.output_path).parent, "generate", params, params_file, overrides)
        summary = start(settings, output_path, log=say)
    except (params_module.ParamsError, jsonl.DataError, GenerationError, DoesNotFitError) as error:
        say(f"error: {error}")
        return runner.finish_job(run, 2, error)
    except Exception as error:  # a bug's traceback: the manifest says 'failed', not 'running' for ever
        runner.finish_job(run, 3, error)
        raise
    if summary is None:
        return 0
    for line in summary_lines(summary):
        print(line)
    return runner.finish_job(run, 0 if summary["in_failures"] == 0 and summary["unaccounted"] == 0 else 1)


def verify_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook verify --params FILE --set output_path=... verifier=...`: check an existing output
    again (another rule, another cap) without generating; exit 2 when it cannot run."""
    try:
        params = runner.resolve_params(params_arg, overrides, log=lambda line: print(line, file=sys.stderr))[0]
        settings = GenerationSettings.from_params(params)  # verify reads the generation job's output and verifier
        if not settings.output_path:
            raise verify.VerifyError("output_path is '': set it to the output to verify (--set output_path=...)")
        summary = verify.verify_output(settings.output_path, settings.verifier, settings.max_accepted_per_prompt)
    except (params_module.ParamsError, jsonl.DataError, verify.VerifyError, GenerationError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(verify.summary_lines(summary)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = WorkbookParser(prog="python -m workbook.generation", keys=job_keys.READ_BY["generate"],
                            schema=params_module.SCHEMA,
                            description="Batched generation of teacher outputs: JSONL in, JSONL out, resumable.")
    parser.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
    add_set_argument(parser)
    args = parser.parse_args(argv)
    return cli_main(args.params, args.set)

