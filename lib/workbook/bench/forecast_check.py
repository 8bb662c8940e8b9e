"""The forecast against the run it forecast, on this machine. A benchmark, not a test: it writes
``forecast.json`` and ``forecast.md``.

    python -m workbook.bench.forecast_check --out outputs/reference/cpu

Each case runs `workbook forecast --json` (a pilot of at most 10% of the job) and then the whole job
as a fresh run into another output, each command in its own process as a user would run it, and
compares the forecast's ``predicted_wall_seconds`` with the job's measured wall time (process
start to exit). Cases: the tiny model over the shipped prompts; a generated set of mixed-length
prompts with outputs that end at end of sequence, and the same cut at a fixed length; a training
run of a few hundred steps. Sized to take about 10 minutes of a 2-core CPU in all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbook import gpu
from workbook.paths import REPO_ROOT

GOAL = 0.10  # |forecast - measured| / measured


def mixed_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """Arithmetic questions behind a preamble of 0-25 words: the tiny model's character tokens give
    prompts of ~20 to ~220 tokens, most of them short (the word count is skewed low)."""
    rng = random.Random(seed)
    words = ["please", "answer", "the", "following", "question", "carefully", "and", "briefly", "now"]
    lines = []
    for i in range(count):
        preamble = " ".join(rng.choice(words) for _ in range(int(rng.random() ** 2 * 25)))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append({"id": f"mixed-{i:05d}", "input": f"{preamble} What is {a} + {b}?".strip()})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def workbook(args: list[str], env: dict) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run ``python -m workbook ...`` in a fresh process: (wall seconds, its CPU seconds (user +
    system), the completed process)."""
    began, cpu_began = time.perf_counter(), _children_cpu_seconds()
    done = subprocess.run([sys.executable, "-m", "workbook", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT)
    seconds, cpu_seconds = time.perf_counter() - began, _children_cpu_seconds() - cpu_began
    if done.returncode not in (0, 1):
        raise RuntimeError(f"workbook {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, cpu_seconds, done


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def check(name: str, mode: str, settings: list[str], fresh: list[str], env: dict, log, repeats: int = 1) -> dict:
    """``repeats`` trials back to back, each a forecast with ``settings`` (pilot output there) once in
    wall seconds and once in CPU seconds, then the whole job fresh with ``fresh``, measured both
    ways. Each forecast is compared with the run that follows it; the trials show how much the
    machine itself moves the same job's time."""
    trials = [_trial(name, mode, _tagged(settings, str(trial)), _tagged(fresh, str(trial)), env, log)
              for trial in range(repeats)]
    row = {"case": name, "mode": mode, "settings": settings, "trials": trials}
    for clock in ("wall", "cpu"):
        entries = [trial[clock] for trial in trials]
        measured = [entry["measured_seconds"] for entry in entries]
        errors = [entry["error"] for entry in entries]
        row[clock] = {"predicted_seconds_median": statistics.median(e["predicted_seconds"] for e in entries),
                      "measured_seconds_median": statistics.median(measured), "errors": errors,
                      "median_error": round(statistics.median(errors), 4),
                      "within_goal": abs(statistics.median(errors)) <= GOAL,
                      "trials_within_goal": sum(e["within_goal"] for e in entries),
                      "trials_in_range": sum(e["in_range"] for e in entries),
                      "job_spread": round((max(measured) - min(measured)) / statistics.median(measured), 4),
                      "pilot": entries[0]["pilot"]}
    row["job"] = trials[0]["job"]
    return row


def _tagged(settings: list[str], tag: str) -> list[str]:
    """Each trial (and clock) writes its own output: a pilot's output counts toward its own job only."""
    return [f"{item}-{tag}" if item.startswith("train_output_dir=") else
            item.replace(".jsonl", f"-{tag}.jsonl") if item.startswith("output_path=") else item
            for item in settings]


def _trial(name: str, mode: str, settings: list[str], fresh: list[str], env: dict, log) -> dict:
    forecasts = {}
    for clock in ("wall", "cpu"):
        seconds, _, done = workbook(["forecast", "--params", "cpu", "--mode", mode, "--json", "--clock", clock,
                                     "--set", *_tagged(settings, clock)], env)
        forecasts[clock] = (json.loads(done.stdout), seconds)
    measured = dict(zip(("wall", "cpu"), workbook(["generate" if mode == "generate" else "train", "--params", "cpu",
                                                    "--set", *fresh], env)[:2]))
    trial = {}
    for clock, (result, seconds) in forecasts.items():
        predicted, (low, high) = result["predicted_wall_seconds"], result["predicted_wall_seconds_range"]
        error = (predicted - measured[clock]) / measured[clock]
        trial[clock] = {"predicted_seconds": predicted, "range": [low, high], "measured_seconds": round(measured[clock], 2),
                        "error": round(error, 4), "within_goal": abs(error) <= GOAL, "in_range": low <= measured[clock] <= high,
                        "forecast_command_wall_seconds": round(seconds, 2),
                        "pilot": {k: result["pilot"].get(k) for k in ("batches", "prompts", "steps", "seconds",
                                                                      "share_of_job_batches", "share_of_job_steps")},
                        "timings": result["timings"]}
        log(f"{name} [{clock}]: forecast {predicted:.1f} s ({low:.1f}-{high:.1f}), measured {measured[clock]:.1f} s, "
            f"error {error:+.1%}")
    trial["job"] = {k: v for k, v in forecasts["wall"][0]["job"].items() if k != "batch_seconds_planned"}
    return trial


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args, work: Path, log=say) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib"), "OMP_NUM_THREADS": str(args.threads)}
    load_at_start = os.getloadavg()  # the neighbours' work: what stretches the wall times
    shipped = ["verifier=final_number"]
    mixed = mixed_prompts(work / "mixed.jsonl", args.mixed_prompts)
    cases = [
        ("shipped prompts (300), EOS-ended", "generate", shipped),
        (f"{args.mixed_prompts} mixed-length prompts, EOS-ended", "generate",
         [f"prompts_path={mixed}", "verifier=", "max_new_tokens=8"]),
        (f"{args.mixed_prompts} mixed-length prompts, fixed length (cut at max_new_tokens 3)", "generate",
         [f"prompts_path={mixed}", "verifier=", "max_new_tokens=3"]),
    ]
    rows = []
    for index, (name, mode, settings) in enumerate(cases):
        rows.append(check(name, mode, settings + [f"output_path={work / f'pilot-{index}.jsonl'}"],
                          settings + [f"output_path={work / f'fresh-{index}.jsonl'}"], env, log, args.repeats))
        if args.only_first:
            break
    train = [f"max_steps={args.train_steps}", "save_every_steps=0", f"micro_batch_size={args.train_micro_batch}"]
    rows.append(check(f"training, {args.train_steps} steps (shipped sample, micro-batch {args.train_micro_batch})", "train",
                      train + [f"train_output_dir={work / 'pilot-train'}"],
                      train + [f"train_output_dir={work / 'fresh-train'}"], env, log, args.repeats))
    return {"what": "workbook forecast (pilot of at most 10% of the job) against the measured wall time of the "
                    "whole job run fresh (process start to exit), tiny model, cpu profile",
            "command": f"PYTHONPATH=lib python -m workbook.bench.forecast_check --out {args.out} --mixed-prompts "
                       f"{args.mixed_prompts} --train-steps {args.train_steps} --train-micro-batch {args.train_micro_batch} "
                       f"--threads {args.threads} --repeats {args.repeats}",
            "goal": f"|error| <= {GOAL:.0%}", "threads": args.threads, "hardware": gpu.cpu_facts(),
            "machine_note": "a 2-core virtual machine on a shared host: back-to-back runs of the same job differ in "
                            "wall and in CPU seconds alike (the job's own spread over the trials, max - min over "
                            "the median), which no forecast made before the run can see; so each case runs several "
                            "trials, each forecast is compared with the run right after it, and the goal is judged "
                            "on the median error, every trial's error listed",
            "load_average_1_5_15_min": {"start": [round(x, 2) for x in load_at_start],
                                        "end": [round(x, 2) for x in os.getloadavg()]},
            "cases": rows}


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", result["what"] + f"; goal {result['goal']}. "
             f"OMP_NUM_THREADS={result['threads']}; {result['machine_note']}.", "",
             *([f"Load average (1, 5, 15 min) of the {result['hardware'].get('logical_cores', '?')}-core machine: "
                f"{load['start']} at the start, {load['end']} at the end.", ""]
               if (load := result.get("load_average_1_5_15_min")) else []),
             "| case | seconds of | pilot | forecast (s), median | measured (s), median | error of each trial | "
             "median error | trials within goal | trials in range | the job's own spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        for clock in ("wall", "cpu"):
            entry, pilot = row[clock], row[clock]["pilot"]
            size = (f"{pilot['batches']} batches, {pilot['share_of_job_batches']:.0%}" if row["mode"] == "generate"
                    else f"{pilot['steps']} steps, {pilot['share_of_job_steps']:.0%}")
            trials = len(entry["errors"])
            lines.append(f"| {row['case']} | {clock} | {size} | {entry['predicted_seconds_median']:.1f} | "
                         f"{entry['measured_seconds_median']:.1f} | {', '.join(f'{e:+.1%}' for e in entry['errors'])} | "
                         f"{entry['median_error']:+.1%} | {entry['trials_within_goal']} of {trials} | "
                         f"{entry['trials_in_range']} of {trials} | {entry['job_spread']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/reference/cpu")
    parser.add_argument("--mixed-prompts", type=int, default=1000)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--train-micro-batch", type=int, default=4, help="small, so a few hundred steps stay minutes")
    parser.add_argument("--only-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="trials per case, back to back: the machine's own "
                        "spread between runs of the same job is part of the answer")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the measured processes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="forecast-check-") as work:
        result = run(args, Path(work))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forecast.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "forecast.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
