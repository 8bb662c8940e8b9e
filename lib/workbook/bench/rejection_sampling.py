"""Rounds of rejection-sampling fine-tuning on CPU (seed 002's workflow), measured: sample several
answers per question, keep the ones a verifier accepts, fine-tune on them, and score held-out
questions before and after; the next round does the same with the model the round trained. A benchmark, not a test: it writes ``rejection_sampling.json`` and
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
    """``args.rounds`` rounds: the first samples the tiny model, each later one the model the previous
    round trained (seed 002's loop), which is also the model it fine-tunes further."""
    profile = params_module.load(params_module.profile_path("cpu"))
    pool, held = arithmetic.variant_task_records(args.pool, args.held_out)
    held_path = arithmetic.write_records(work / "held_out.jsonl", held)
    pool_path = arithmetic.write_records(work / "pool.jsonl", pool)
    model = "tiny"
    began = time.perf_counter()
    before = held_out_accuracy(profile, model, held_path, work / "before.jsonl")
    score_seconds = time.perf_counter() - began
    log(f"held-out accuracy before: {before:.1%}")
    rounds = []
    for number in range(1, args.rounds + 1):
        folder = work / f"round-{number}"
        timings = {"score_before_seconds": score_seconds}
        began = time.perf_counter()
        sampled = generate(profile, pool_path, folder / "samples.jsonl", model=model, do_sample=True,
                           temperature=args.temperature, samples_per_prompt=args.samples, verifier="final_number",
                           max_accepted_per_prompt=args.max_accepted_per_prompt)
        timings["sample_and_verify_seconds"] = time.perf_counter() - began
        verification = sampled["verification"]
        log(f"round {number}: sampled {verification['candidates']}: {verification['accepted_candidates']} accepted, "
            f"{verification['written']} kept for training")

        began = time.perf_counter()
        settings = {**profile, "model": model, "train_data_path": verification["accepted_path"],
                    "train_output_dir": str(folder / "train"), "epochs": args.epochs,
                    "learning_rate": args.learning_rate, "validation_fraction": 0.0, "save_every_steps": 0}
        config = training.config_from_params(settings, folder)
        result = training.launch(config, training.prepare_data(config))
        timings["train_seconds"] = time.perf_counter() - began

        began = time.perf_counter()
        trained = result["output"]["final_model_dir"]
        after = held_out_accuracy(profile, trained, held_path, folder / "after.jsonl")
        timings["score_after_seconds"] = score_seconds = time.perf_counter() - began
        log(f"round {number}: held-out accuracy after: {after:.1%}")
        rounds.append({
            "round": number, "sampled_model": "tiny" if number == 1 else f"round {number - 1}'s trained model",
            "sampling": {"samples_per_prompt": args.samples, "temperature": args.temperature,
                         "verifier": "final_number", "max_accepted_per_prompt": args.max_accepted_per_prompt,
                         **{key: verification[key] for key in ("candidates", "accepted_candidates",
                                                               "acceptance_rate", "prompts_with_an_accepted_sample",
                                                               "written")}},
            "training": {"examples": result["data"]["examples"]["train"], "epochs": args.epochs,
                         "learning_rate": args.learning_rate, "steps": result["steps"]["reached"],
                         "loss_by_epoch": result["loss"]["epoch_means"]},
            "held_out_accuracy": {"before": before, "after": after},
            "seconds": timings,
        })
        model, before = trained, after  # the next round samples and fine-tunes the model this one trained
    return {
        "what": f"{args.rounds} round(s) of rejection-sampling fine-tuning of the tiny model on questions asked in "
                "unseen words, each round sampling the model the previous one trained",
        "task": {"style": arithmetic.VARIANT_STYLE, "example": held[0]["input"], "held_out_questions": len(held),
                 "pool_questions": len(pool), "disjoint": True},
        "rounds": rounds,
        "held_out_accuracy_how": "greedy answers to the held-out questions, first integer against the true sum",
        "threads": torch.get_num_threads(),
        "versions": gpu.software_versions(),
        "command": "workbook bench-rejection-sampling " + " ".join(args.argv),
    }


def markdown(report: dict) -> str:
    lines = [f"`{report['command']}`\n",
             "| round | sampled model | held-out questions | pool x samples | accepted | kept for training "
             "| accuracy before | after |",
             "|---|---|---|---|---|---|---|---|"]
    for entry in report["rounds"]:
        sampling, accuracy = entry["sampling"], entry["held_out_accuracy"]
        lines.append(f"| {entry['round']} | {entry['sampled_model']} | {report['task']['held_out_questions']} "
                     f"({report['task']['example']!r}) | {report['task']['pool_questions']} x "
                     f"{sampling['samples_per_prompt']} | {sampling['accepted_candidates']} "
                     f"({sampling['acceptance_rate']:.1%}) | {sampling['written']} | {accuracy['before']:.1%} | "
                     f"{accuracy['after']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook bench-rejection-sampling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=arithmetic.VARIANT_POOL_SIZE, help="questions sampled for training data")
    parser.add_argument("--held-out", type=int, default=arithmetic.VARIANT_HELD_OUT_SIZE, help="questions scored before and after")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each after the first samples the model the "
                        "previous round trained")
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
