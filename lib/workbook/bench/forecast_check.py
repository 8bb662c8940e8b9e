"""The forecast against the run it forecast, on this machine. A benchmark, not a test: it writes
``forecast.json`` and ``forecast.md``.

    workbook forecast-check --out outputs/reference/cpu
    workbook forecast-check --profile h100 --generate-model Llama-3.1-8B \
        --train-model Llama-3.2-1B --repeats 1 --time-budget-seconds 500 --out $OUT/forecast

Each case runs `workbook forecast --json` (a pilot of at most 10% of the job) and then the whole job
as a fresh run into another output, each command in its own process as a user would run it, and
compares the forecast's ``predicted_wall_seconds`` with the job's measured wall time (process
start to exit). Cases on the cpu profile (the tiny model): the shipped prompts; a generated set of
mixed-length prompts with outputs that end at end of sequence, and the same cut at a fixed length;
a training run of a few hundred steps on the shipped sample; and a training run on pairs of widely
mixed lengths (packing: a row of a few long examples costs more attention than one of many short
ones, and each epoch deals the rows out afresh), where the run's own step times per phase (first
tenth, middle tenth, last tenth of its steps) are set beside the forecast's step model; in all about
15 minutes of a 2-core CPU (``--only-training``: the training cases alone). On a GPU profile:
the mixed-length prompts at a fixed output length (``--max-new-tokens``: random weights rarely end
a sequence) and the training run; the markdown adds the generation forecast's projection to every
profile beside seed 000's claims for its own job.

A preset model name (``--generate-model``, ``--train-model``) is built first as a local directory
with random weights on this machine's device (``workbook.random_weights``), since the generation job
loads only directories. ``--time-budget-seconds`` ends every command by its deadline: a job whose
forecast does not fit in the time left is not run, and a case stopped or not run is recorded as not
finished, with whatever it measured (its forecast, when it got that far).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from workbook import gpu, launcher_watch, models, params as params_module
from workbook.bench.claims import SEED_000_CLAIMS, SEED_000_JOB
from workbook.bench.forecast_report import markdown
from workbook.generation.files import OutputFiles, resolve_input_path
from workbook.forecast import training_steps
from workbook.paths import REPO_ROOT
from workbook.training.config import RESULT_FILE
from workbook.generation.progress import ETA_CHECKPOINTS, eta_errors
from workbook.recorded_forecast import FORECAST_SUFFIX

GOAL = 0.10  # |forecast - measured| / measured
RESERVE_SECONDS = 15  # kept back from --time-budget-seconds: stopping a command and writing the results
# The options a GPU check adds, with their defaults: the recorded command names one only when it differs,
# so the cpu reference's command reads (and reproduces) as before.
MIXED_TRAINING = (2000, 200, 16)  # the mixed-length training case: pairs, steps, micro-batch (packed rows)
GPU_OPTIONS = {"profile": "cpu", "generate_model": "tiny", "train_model": "tiny", "max_new_tokens": 256,
               "time_budget_seconds": None}


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


def mixed_training_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """Input/output pairs of widely mixed lengths: most a short question (~25 tokens of the tiny
    model's characters), one in five behind a preamble of 20 to 200 tokens. Packed, a row then holds
    one or two long examples (many attention pairs) or many short ones (few)."""
    rng = random.Random(seed)
    words = ["please", "answer", "the", "following", "question", "carefully", "and", "briefly", "now"]
    lines = []
    for i in range(count):
        long = rng.random() < 0.2
        preamble = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30) if long else rng.randint(0, 2)))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append({"id": f"pair-{i:05d}", "input": f"{preamble} What is {a} + {b}?".strip(), "output": str(a + b)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class NotFinished(Exception):
    """A command stopped at the time budget's deadline, not started for lack of time, or failed;
    ``forecast``: what its trial had measured before (the forecast), if it got that far."""

    def __init__(self, reason: str, forecast: dict | None = None):
        super().__init__(reason)
        self.forecast = forecast


@dataclasses.dataclass
class Session:
    """What every command of a check shares."""

    env: dict
    profile: str
    device: str = "cpu"  # where a preset's random weights are built: the profile's GPU, else the CPU
    # Wall and CPU seconds on the cpu profile; a GPU job's CPU seconds are only its host's part: wall alone.
    clocks: tuple[str, ...] = ("wall", "cpu")
    deadline: float | None = None  # time.monotonic() by which every command has ended; None: no budget
    projects: bool = False  # record each forecast's projection to the other profiles (GPU profiles)
    log: Callable[[str], None] = print

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


def command(argv: list[str], session: Session) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run ``python <argv>`` in a fresh process: (wall seconds, its CPU seconds (user + system), the
    completed process). Its own process group, so that a stop at the deadline ends its children too.
    Raises NotFinished at the deadline, or when it fails (an exit code besides 0, and 1: a job with
    failed examples, whose time still counts)."""
    left = session.seconds_left()
    if left is not None and left <= 0:
        raise NotFinished(f"no time left in the budget to start python {' '.join(argv[:3])}")
    began, cpu_began = time.perf_counter(), _children_cpu_seconds()
    process = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=launcher_watch.child_environment(session.env), cwd=REPO_ROOT,
                               start_new_session=True)  # its own group; it still ends with this process
    try:
        stdout, stderr = process.communicate(timeout=left)
    except BaseException as stop:  # the deadline, or Ctrl-C, which no longer reaches the command's own group
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if not isinstance(stop, subprocess.TimeoutExpired):
            raise
        raise NotFinished(f"python {' '.join(argv[:3])} stopped at the time budget's deadline after "
                          f"{time.perf_counter() - began:.0f} s") from None
    seconds, cpu_seconds = time.perf_counter() - began, _children_cpu_seconds() - cpu_began
    if process.returncode not in (0, 1):
        raise NotFinished(f"python {' '.join(argv)} failed ({process.returncode}):\n{stderr[-3000:]}")
    return seconds, cpu_seconds, subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def workbook(args: list[str], session: Session) -> tuple[float, float, subprocess.CompletedProcess]:
    """``python -m workbook ...`` in a fresh process (``command``)."""
    return command(["-m", "workbook", *args], session)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def model_directory(model: str, work: Path, session: Session, dtype: str, built: dict) -> str:
    """``model`` as the jobs load it: 'tiny' or a directory as is; a preset is first built under
    ``work`` as a directory of random ``dtype`` weights on this profile's device (once; recorded in
    ``built``), since the generation job loads only directories."""
    if not models.is_preset(model):
        return model
    if model not in built:
        directory = work / f"{model}-random-{dtype}"
        seconds, _, done = command(["-m", "workbook.random_weights", "--preset", model, "--out", str(directory),
                                    "--dtype", dtype, "--device", session.device], session)
        built[model] = {**json.loads(done.stdout.strip().splitlines()[-1]), "directory": str(directory),
                        "command_seconds": round(seconds, 1)}
        session.log(f"{model}: random {dtype} weights built on {session.device} into {directory} in {seconds:.0f} s")
    return built[model]["directory"]


def check(name: str, mode: str, settings: list[str], fresh: list[str], session: Session, repeats: int = 1) -> dict:
    """``repeats`` trials back to back, each a forecast with ``settings`` (pilot output there) once per
    clock (wall seconds, CPU seconds), then the whole job fresh with ``fresh``, measured both ways.
    Each forecast is compared with the run that follows it; the trials show how much the machine
    itself moves the same job's time. A trial that does not finish ends the case (``not_finished``);
    the figures are those of the trials that did."""
    trials, not_finished = [], None
    for trial in range(repeats):
        try:
            trials.append(_trial(name, mode, _tagged(settings, str(trial)), _tagged(fresh, str(trial)), session))
        except NotFinished as stopped:
            session.log(f"{name}: trial {trial + 1} of {repeats} not finished: {stopped}")
            not_finished = {"trial": trial + 1, "reason": str(stopped), "forecast": stopped.forecast}
            break
    row = {"case": name, "mode": mode, "settings": settings, "trials": trials}
    if not_finished:
        row["not_finished"] = not_finished
    if not trials:
        return row
    for clock in session.clocks:
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
    if any(trial.get("phases") for trial in trials):  # the step model against the run's steps, per phase
        row["phases"] = {phase: {key: [trial["phases"][phase][key] for trial in trials if trial.get("phases")]
                                 for key in ("planned_step_seconds", "measured_step_seconds", "error")}
                         for phase in training_steps.PHASES}
    if any(trial.get("eta") for trial in trials):  # each trial's ETA error at each checkpoint
        row["eta_errors"] = {str(share): [next((c["error"] for c in trial.get("eta", []) if c["share_of_batches"] == share),
                                               None) for trial in trials] for share in ETA_CHECKPOINTS}
    return row


def _tagged(settings: list[str], tag: str) -> list[str]:
    """Each trial (and clock) writes its own output: a pilot's output counts toward its own job only."""
    return [f"{item}-{tag}" if item.startswith("train_output_dir=") else
            item.replace(".jsonl", f"-{tag}.jsonl") if item.startswith("output_path=") else item
            for item in settings]


def _trial(name: str, mode: str, settings: list[str], fresh: list[str], session: Session) -> dict:
    forecasts = {}
    for clock in session.clocks:
        seconds, _, done = workbook(["forecast", "--params", session.profile, "--mode", mode, "--json", "--clock", clock,
                                     "--set", *_tagged(settings, clock)], session)
        forecasts[clock] = (json.loads(done.stdout), seconds)
    forecast = _forecast_summary(forecasts["wall"][0])
    left = session.seconds_left()
    if left is not None and forecast["predicted_seconds"] > left:  # it would be stopped: keep the time for the next case
        raise NotFinished(f"the whole job was not run: its forecast, {forecast['predicted_seconds']:.0f} s, is more "
                          f"than the {left:.0f} s left of the time budget", forecast)
    # The run's ETA plans by this forecast, as it would after `workbook forecast` for its own output.
    output, made = (_output(fresh), _output(_tagged(settings, "wall"))) if mode == "generate" else (None, None)
    plan = made.with_suffix(FORECAST_SUFFIX) if made else None
    if output and plan and plan.is_file():
        shutil.copyfile(plan, output.with_suffix(FORECAST_SUFFIX))
    try:
        measured = dict(zip(("wall", "cpu"), workbook(["generate" if mode == "generate" else "train", "--params",
                                                        session.profile, "--set", *fresh], session)[:2]))
    except NotFinished as stopped:
        raise NotFinished(str(stopped), forecast) from None
    trial = {}
    summary = OutputFiles(output).summary if output else None
    if summary and summary.is_file():
        trial["eta"] = eta_errors(json.loads(summary.read_text())["batch_list"])
    trained = _train_output(fresh)
    if trained and (trained / RESULT_FILE).is_file():
        trial["phases"] = step_phases(forecasts["wall"][0], json.loads((trained / RESULT_FILE).read_text())["history"])
    for clock, (result, seconds) in forecasts.items():
        predicted, (low, high) = result["predicted_wall_seconds"], result["predicted_wall_seconds_range"]
        error = (predicted - measured[clock]) / measured[clock]
        trial[clock] = {"predicted_seconds": predicted, "range": [low, high], "measured_seconds": round(measured[clock], 2),
                        "error": round(error, 4), "within_goal": abs(error) <= GOAL, "in_range": low <= measured[clock] <= high,
                        "forecast_command_wall_seconds": round(seconds, 2),
                        "pilot": {k: result["pilot"].get(k) for k in ("batches", "prompts", "steps", "seconds",
                                                                      "share_of_job_batches", "share_of_job_steps")},
                        "timings": result["timings"],
                        "efficiency": result.get("efficiency", {}).get(mode)}
        session.log(f"{name} [{clock}]: forecast {predicted:.1f} s ({low:.1f}-{high:.1f}), measured {measured[clock]:.1f} s, "
                    f"error {error:+.1%}")
    trial["job"] = forecast["job"]
    if session.projects:
        trial["profiles"] = forecast["profiles"]
    return trial


def step_phases(made: dict, history: list[dict]) -> dict:
    """The forecast's step model (mean planned seconds of a step) against the run's own steps, over
    the first, middle and last tenth of the run. The run's steps that start an epoch's loader are
    left out, as the pilot leaves its own out of the model (the loader's start, the warm-up)."""
    every = made["job"]["steps_per_epoch"]
    measured = training_steps.phase_means([None if (record["step"] - 1) % every == 0 else record["seconds"]
                                           for record in history])
    planned = made["pilot"]["step_model"]["planned_step_seconds_by_phase"]
    return {phase: {"planned_step_seconds": round(planned[phase], 5), "measured_step_seconds": round(measured[phase], 5),
                    "error": round((planned[phase] - measured[phase]) / measured[phase], 4)}
            for phase in training_steps.PHASES if planned.get(phase) and measured.get(phase)}


def _train_output(settings: list[str]) -> Path | None:
    return next((Path(item.split("=", 1)[1]) for item in settings if item.startswith("train_output_dir=")), None)


def _output(settings: list[str]) -> Path | None:
    return next((Path(item.split("=", 1)[1]) for item in settings if item.startswith("output_path=")), None)


def _forecast_summary(result: dict) -> dict:
    """A forecast's figures the check keeps: the prediction, the job it is for, its projection to the profiles."""
    return {"predicted_seconds": result["predicted_wall_seconds"], "range": result["predicted_wall_seconds_range"],
            "job": {k: v for k, v in result["job"].items() if k != "batch_seconds_planned"},
            "profiles": result["profiles"]}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cases(args, work: Path, on_gpu: bool) -> list[tuple[str, str, list[str]]]:
    """(name, mode, settings) of each case, the training run last. The cpu profile's tiny model ends
    its outputs at end of sequence; random weights (a GPU check's presets) rarely do, so a GPU's
    generation case is the mixed-length prompts at a fixed output length."""
    shipped = ["verifier=final_number"]
    mixed = mixed_prompts(work / "mixed.jsonl", args.mixed_prompts)
    profile = params_module.load(params_module.profile_path(args.profile))
    samples = profile["samples_per_prompt"]
    each = f" x {samples} samples" if samples > 1 else ""  # each prompt's samples are outputs of their own
    pool = sum(1 for line in resolve_input_path(profile["prompts_path"]).open() if line.strip())
    if on_gpu:
        generation = [(f"{args.mixed_prompts} mixed-length prompts, fixed length (max_new_tokens {args.max_new_tokens})",
                       "generate", [f"prompts_path={mixed}", "verifier=", f"max_new_tokens={args.max_new_tokens}"])]
    else:
        generation = [
            (f"the profile's {pool:,} prompts{each}, EOS-ended", "generate", shipped),
            (f"{args.mixed_prompts} mixed-length prompts{each}, EOS-ended", "generate",
             [f"prompts_path={mixed}", "verifier=", "max_new_tokens=8"]),
            (f"{args.mixed_prompts} mixed-length prompts{each}, fixed length (cut at max_new_tokens 3)", "generate",
             [f"prompts_path={mixed}", "verifier=", "max_new_tokens=3"]),
            # One sample each: a stream of 8 samples of every prompt would run minutes on this CPU.
            (f"{args.mixed_prompts} mixed-length prompts, EOS-ended, continuous backend (one sample each, "
             "up to 16 new tokens)", "generate",
             [f"prompts_path={mixed}", "verifier=", "max_new_tokens=16", "samples_per_prompt=1", "backend=continuous"]),
        ]
    train = [f"max_steps={args.train_steps}", "save_every_steps=0", f"micro_batch_size={args.train_micro_batch}"]
    training = [(f"training, {args.train_steps} steps (shipped sample, micro-batch {args.train_micro_batch})", "train", train)]
    if not on_gpu:
        pairs = mixed_training_pairs(work / "mixed-pairs.jsonl", args.mixed_train_examples)
        training.append((f"training, {args.mixed_train_steps} steps of {args.mixed_train_examples:,} pairs of widely mixed "
                         f"lengths (packing, micro-batch {args.mixed_train_micro_batch}: rows change in cost across the epoch)",
                         "train", [f"train_data_path={pairs}", f"max_steps={args.mixed_train_steps}", "save_every_steps=0",
                                   f"micro_batch_size={args.mixed_train_micro_batch}", "padding=packing"]))
    if args.only_mixed_training:
        return training[1:]
    return [*([] if args.only_training else generation[:1 if args.only_first else None]), *training]


def run(args, work: Path, log=say) -> dict:
    load_at_start = os.getloadavg()  # the neighbours' work: what stretches the wall times
    profile = params_module.load(params_module.profile_path(args.profile))
    on_gpu = profile["gpu_count"] > 0
    deadline = time.monotonic() + args.time_budget_seconds - RESERVE_SECONDS if args.time_budget_seconds else None
    session = Session({**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib"), "OMP_NUM_THREADS": str(args.threads)},
                      args.profile, "cuda" if on_gpu else "cpu", ("wall",) if on_gpu else ("wall", "cpu"), deadline,
                      projects=on_gpu, log=log)
    built, rows = {}, []
    for index, (name, mode, settings) in enumerate(cases(args, work, on_gpu)):
        model = args.generate_model if mode == "generate" else args.train_model
        if model != profile["model"]:
            name = f"{model}, {name}"
            try:
                settings = [f"model={model_directory(model, work, session, profile['dtype'], built)}", *settings]
            except NotFinished as stopped:
                log(f"{name}: not run: {stopped}")
                rows.append({"case": name, "mode": mode, "settings": settings, "trials": [],
                             "not_finished": {"trial": 1, "reason": f"its model was not built: {stopped}",
                                              "forecast": None}})
                continue
        pilot, fresh = ((f"output_path={work / f'pilot-{index}.jsonl'}", f"output_path={work / f'fresh-{index}.jsonl'}")
                        if mode == "generate" else
                        (f"train_output_dir={work / f'pilot-train-{index}'}", f"train_output_dir={work / f'fresh-train-{index}'}"))
        rows.append(check(name, mode, settings + [pilot], settings + [fresh], session, args.repeats))
    models_named = ("tiny model" if args.generate_model == args.train_model == "tiny" else
                    f"generation: {args.generate_model}, training: {args.train_model}")
    result = {"what": "workbook forecast (pilot of at most 10% of the job) against the measured wall time of the "
                      f"whole job run fresh (process start to exit), {models_named}, {args.profile} profile",
              "command": command_line(args), "goal": f"|error| <= {GOAL:.0%}", "threads": args.threads,
              "hardware": {"cpu": gpu.cpu_facts(), "gpus": gpu.detect()["gpus"]} if on_gpu else gpu.cpu_facts(),
              "machine_note": (f"one {args.profile} GPU, lent for a session that allows 10 minutes a command: "
                               f"{args.repeats} trial(s) per case, so the job's own spread between runs is "
                               "measured only with more than one" if on_gpu else
                               "a 2-core virtual machine on a shared host: back-to-back runs of the same job differ in "
                               "wall and in CPU seconds alike (the job's own spread over the trials, max - min over "
                               "the median), which no forecast made before the run can see; so each case runs several "
                               "trials, each forecast is compared with the run right after it, and the goal is judged "
                               "on the median error, every trial's error listed"),
              "load_average_1_5_15_min": {"start": [round(x, 2) for x in load_at_start],
                                          "end": [round(x, 2) for x in os.getloadavg()]},
              "cases": rows, "efficiency": measured_efficiency(rows)}
    if built:
        result["models_built"] = built
    if on_gpu:
        result.update(profile=args.profile, seed_000={"job": SEED_000_JOB, "claims": SEED_000_CLAIMS})
    return result


def measured_efficiency(rows: list[dict]) -> dict:
    """Each mode's achieved share of the profile's peaks (decode: bandwidth, prefill and steps:
    compute), the median over the wall-clock forecasts of its cases: what a forecast on another
    machine projects this one's rows with (``forecast.reference_efficiencies``)."""
    found = {}
    for row in rows:
        for trial in row["trials"]:
            for key, share in ((trial.get("wall") or {}).get("efficiency") or {}).items():
                if share:
                    found.setdefault(row["mode"], {}).setdefault(key, []).append(share)
    return {mode: {key: statistics.median(shares) for key, shares in by_key.items()} for mode, by_key in found.items()}


def command_line(args) -> str:
    """The command that reproduces this check; an option a GPU check adds only where it differs from its default."""
    changed = [f"--{key.replace('_', '-')} {f'{value:g}' if isinstance(value, float) else value}"
               for key, default in GPU_OPTIONS.items() if (value := getattr(args, key)) != default]
    return " ".join([f"workbook forecast-check --out {args.out} --mixed-prompts "
                     f"{args.mixed_prompts} --train-steps {args.train_steps} --train-micro-batch {args.train_micro_batch} "
                     f"--threads {args.threads} --repeats {args.repeats}", *changed,
                     *([f"--mixed-train-examples {args.mixed_train_examples} --mixed-train-steps {args.mixed_train_steps} "
                        f"--mixed-train-micro-batch {args.mixed_train_micro_batch}"] if MIXED_TRAINING != (
                         args.mixed_train_examples, args.mixed_train_steps, args.mixed_train_micro_batch) else []),
                     *(["--only-training"] if args.only_training else []),
                     *(["--only-mixed-training"] if args.only_mixed_training else [])])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbook forecast-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/reference/cpu")
    parser.add_argument("--mixed-prompts", type=int, default=3000, help="prompts in the generated mixed-length set (a job of a few thousand)")
    parser.add_argument("--train-steps", type=int, default=300, help="optimizer steps of the training run (a few hundred)")
    parser.add_argument("--train-micro-batch", type=int, default=4, help="small, so a few hundred steps stay minutes")
    parser.add_argument("--mixed-train-examples", type=int, default=MIXED_TRAINING[0],
                        help="pairs in the generated training set of widely mixed lengths")
    parser.add_argument("--mixed-train-steps", type=int, default=MIXED_TRAINING[1],
                        help="optimizer steps of the training run on it (several epochs)")
    parser.add_argument("--mixed-train-micro-batch", type=int, default=MIXED_TRAINING[2], help="its micro-batch (packed rows)")
    parser.add_argument("--only-training", action="store_true", help="run the training cases alone (the generation "
                        "cases take most of the check's time)")
    parser.add_argument("--only-mixed-training", action="store_true", help="run the mixed-length training case alone")
    parser.add_argument("--only-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="trials per case, back to back: the machine's own "
                        "spread between runs of the same job is part of the answer")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the measured processes")
    parser.add_argument("--profile", default=GPU_OPTIONS["profile"], choices=params_module.profile_names(),
                        help="the params profile every command runs with; a GPU profile runs the GPU cases")
    parser.add_argument("--generate-model", default=GPU_OPTIONS["generate_model"],
                        help="'tiny', a local model directory, or a preset (built first with random weights)")
    parser.add_argument("--train-model", default=GPU_OPTIONS["train_model"], help="as --generate-model")
    parser.add_argument("--max-new-tokens", type=int, default=GPU_OPTIONS["max_new_tokens"],
                        help="the fixed output length of a GPU profile's generation case")
    parser.add_argument("--time-budget-seconds", type=float, default=GPU_OPTIONS["time_budget_seconds"],
                        help="end every command within this many seconds of the start (model building included) "
                             "and write what was measured; exit 3 when a case did not finish")
    return parser


SCRATCH = "<scratch>"  # what the results say for the check's temporary folder


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="forecast-check-") as work:
        result = run(args, Path(work))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The scratch folder is gone once the check ends: its path would only name this machine.
    text = json.dumps(result, indent=2).replace(json.dumps(work)[1:-1], SCRATCH)
    (out / "forecast.json").write_text(text + "\n")
    (out / "forecast.md").write_text(markdown(result))
    print(markdown(result))
    return 3 if any("not_finished" in row for row in result["cases"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
