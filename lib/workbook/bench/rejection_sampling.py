"""One round of rejection-sampling fine-tuning on CPU (seed 002's workflow), measured: sample several
answers per question, keep the ones a verifier accepts, fine-tune on them, and score held-out
questions before and after. A benchmark, not a test: it writes ``rejection_sampling.json`` and
``.md``.

    workbook bench-rejection-sampling --out outputs/reference/cpu

The task is the tiny model's arithmetic asked in words it was not trained on ("What's 23 + 45?",
``arithmetic.variant_task_records``: the cpu profile's default run uses the same task from its
shipped files), which it answers right only now and then. Every
step runs through the workbook's own jobs with the cpu profile (``generation.run_job``,
``verify``, ``training.launch``), so this is the loop notebooks 02 and 03 run, with numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from workbook import arithmetic, gpu, notebook, params as params_module, training
from workbook.generation import job, task_accuracy
from workbook.generation.files import read_outputs

def generate(profile: dict, prompts: Path, output: Path, **changes) -> dict:
    """The generation job on ``prompts`` with the cpu profile and ``changes``; its summary."""
    settings = {**profile, "prompts_path": str(prompts), "output_path": str(output), "log_every_batches": 0,
                "interactive": False, **changes}
    return job.run_job(settings, output, show_progress=False, log=lambda line: None)


def held_out_accuracy(profile: dict, model: str, prompts: Path, output: Path) -> float:
    """Greedy answers of ``model`` to the held-out questions, scored against the true sums."""
    generate(profile, prompts, output, model=model, do_sample=False, samples_per_prompt=1, verifier="")
    return task_accuracy(read_outputs(output))["accuracy"]


def run(args: argparse.Namespace, work: Path, log=print) -> dict:
    profile = params_module.load(params_module.profile_path("cpu"))
    pool, held = arithmetic.variant_task_records(args.pool, args.held_out)
    held_path = arithmetic.write_records(work / "held_out.jsonl", held)
    pool_path = arithmetic.write_records(work / "pool.jsonl", pool)
    timings = {}

    began = time.perf_counter()
    before = held_out_accuracy(profile, "tiny", held_path, work / "before.jsonl")
    timings["score_before_seconds"] = time.perf_counter() - began
    log(f"held-out accuracy before: {before:.1%}")

    began = time.perf_counter()
    sampled = generate(profile, pool_path, work / "samples.jsonl", do_sample=True, temperature=args.temperature,
                       samples_per_prompt=args.samples, verifier="final_number",
                       max_accepted_per_prompt=args.max_accepted_per_prompt)
    timings["sample_and_verify_seconds"] = time.perf_counter() - began
    verification = sampled["verification"]
    log(f"sampled {verification['candidates']}: {verification['accepted_candidates']} accepted, "
        f"{verification['written']} kept for training")

    began = time.perf_counter()
    settings = {**profile, "train_data_path": verification["accepted_path"], "train_output_dir": str(work / "train"),
                "epochs": args.epochs, "learning_rate": args.learning_rate, "validation_fraction": 0.0,
                "save_every_steps": 0}
    config = training.config_from_params(settings, work)
    result = training.launch(config, training.prepare_data(config))
    timings["train_seconds"] = time.perf_counter() - began

    began = time.perf_counter()
    after = held_out_accuracy(profile, result["output"]["final_model_dir"], held_path, work / "after.jsonl")
    timings["score_after_seconds"] = time.perf_counter() - began
    log(f"held-out accuracy after: {after:.1%}")
    return {
        "what": "one round of rejection-sampling fine-tuning of the tiny model on questions asked in unseen words",
        "task": {"style": arithmetic.VARIANT_STYLE, "example": held[0]["input"], "held_out_questions": len(held),
                 "pool_questions": len(pool), "disjoint": True},
        "sampling": {"samples_per_prompt": args.samples, "temperature": args.temperature,
                     "verifier": "final_number", "max_accepted_per_prompt": args.max_accepted_per_prompt,
                     **{key: verification[key] for key in ("candidates", "accepted_candidates", "acceptance_rate",
                                                           "prompts_with_an_accepted_sample", "written")}},
        "training": {"examples": result["data"]["examples"]["train"], "epochs": args.epochs,
                     "learning_rate": args.learning_rate, "steps": result["steps"]["reached"],
                     "loss_by_epoch": result["loss"]["epoch_means"]},
        "held_out_accuracy": {"before": before, "after": after,
                              "how": "greedy answers to the held-out questions, first integer against the true sum"},
        "seconds": timings,
        "threads": torch.get_num_threads(),
        "versions": gpu.software_versions(),
        "command": "workbook bench-rejection-sampling " + " ".join(args.argv),
    }


def markdown(report: dict) -> str:
    sampling, accuracy = report["sampling"], report["held_out_accuracy"]
    return (f"`{report['command']}`\n\n"
            f"| held-out questions | pool x samples | accepted | kept for training | accuracy before | after |\n"
            f"|---|---|---|---|---|---|\n"
            f"| {report['task']['held_out_questions']} ({report['task']['example']!r}) | "
            f"{report['task']['pool_questions']} x {sampling['samples_per_prompt']} | "
            f"{sampling['accepted_candidates']} ({sampling['acceptance_rate']:.1%}) | {sampling['written']} | "
            f"{accuracy['before']:.1%} | {accuracy['after']:.1%} |\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook bench-rejection-sampling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=arithmetic.VARIANT_POOL_SIZE, help="questions sampled for training data")
    parser.add_argument("--held-out", type=int, default=arithmetic.VARIANT_HELD_OUT_SIZE, help="questions scored before and after")
    parser.add_argument("--samples", type=int, default=8, help="samples per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-accepted-per-prompt", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--out", help="results folder (default: a new outputs/<timestamp>-rejection-sampling/)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    out = Path(args.out) if args.out else notebook.new_run_dir("rejection-sampling")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        report = run(args, Path(work))
    (out / "rejection_sampling.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "rejection_sampling.md").write_text(markdown(report))
    print(markdown(report) + f"wrote {out / 'rejection_sampling.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
