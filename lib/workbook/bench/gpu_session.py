"""A lent GPU's calls, planned: each call is one command that runs a whole sweep of steps, writes
everything under one folder and stops itself inside its time budget, so none of the session's minutes go
to typing or to a step that hangs.

A session lent a GPU has 15 minutes of device time in all, the machine's start (a minute or more), idle
waits and transfers included: what it can count on is one command of about 8 minutes. That command is
``first-light``, the first of any session with a GPU:

    PYTHONPATH=lib python3 -m workbook gpu-session --call first-light --profile auto --out $OUT

given ``timeout_s`` 540 (its 480 s budget counts from its own start, imports and packing included; the
60 s more let it pack what it measured even if a step overruns its stop), with ``carry
["outputs/models"]`` (the tiny model built here once: the forecast step's random-weights directory takes
its tokenizer, which a bare machine spends ~45 s building). ``--list`` prints its steps and budgets. Back
here: ``workbook gpu-session --unpack <files_at> --into outputs/reference/<h100|h200>`` (the profile its
``first-light.json`` names) extracts the files, writes the measured CUDA context into that profile
(``overhead_probe.apply``) and ``SUMMARY.md`` (``gpu_summary``: every goal beside its figure, each planner
case beside its fake-tensor trace, traced on this CPU). A second call only if ``status`` leaves at least 5
minutes, its steps in the same order of value.

``first-light``'s steps, in order of value, each under a budget of its own (``first_light`` says how each
was sized): the measured ceilings and the CUDA context probe; the planner against the measured peak on
six cases (``python3 -m workbook.planner.calibration --cases first-light``: 8B generation at batch 32
and 128, the 1B full fine-tune plain and checkpointed, a 1B LoRA, the checkpointed 1B near the planner's
largest micro-batch); the 8B
generation sweep (static-sorted at the planner's batch, the seeds' batch 32) and continuous against static
on uneven outputs, both judged at the measured ceilings; the 1B full fine-tune at the planner's
micro-batch (tokens/s, MFU, peak beside the plan); and, with the time the others saved, the forecast of a
short 8B generation job against the job run.

The calls below were sized for a 30-minute session; each still runs as one command of at most 9 minutes:

    PYTHONPATH=lib python3 -m workbook gpu-session --call smoke --profile auto --out $OUT

A GPU image without TRL (it has no pip to fetch it) takes it as carried wheels, installed first in the
same command (``.whl``: trl, datasets, dill, multiprocess; outputs/reference/README.md); without them the
TRL rows say so and the rest runs.

The 30-minute calls, in the order such a session spends them (``--list`` prints the commands):

- ``smoke`` (~3 min): the measured ceilings of this GPU (a large device-to-device copy, a large
  bf16 matmul), the CUDA context probe, two calibration cases (a generation and a checkpointed training step of a 1B-shaped
  model) and a tiny benchmark through every generation strategy and the training sweep's compile
  and checkpointing points and the HF Trainer and TRL SFTTrainer baselines, so what breaks on this
  machine shows in the first minutes.
- ``calibration`` (~9 min): the CUDA context probe (``planner.overhead_probe``: the profile's constant,
  applied here afterwards with ``--apply``), the planner's whole calibration grid planned with it, and
  the generation sweep on an 8B-shaped model (256 new tokens, batch 32 and the planner's batch capped
  at its 128 prompts), Hugging Face's ``pipeline("text-generation")`` measured beside it at each.
- ``training`` (~9 min): continuous against static batching on uneven outputs (8B-shaped), the 1B
  training sweep with each memory setting and the HF Trainer and TRL's SFTTrainer beside each
  micro-batch's plain point, and the 8B LoRA point.
- ``forecast`` (~8 min): the engine's overhead per decode step on the 8B model, then the forecast
  against the whole run it forecast (``forecast_check``) for an
  8B-shaped generation job and a 1B-shaped training run, each model a local directory of random bf16
  weights built first, and the generation forecast's projection to every profile beside seed 000's
  claims; it stops itself inside the budget and records a case it could not finish.

The device returns at most 8 files of 16 MiB from ``$OUT``, none more than two folders down, so a call
runs in ``<out>/<call>/`` and ends by packing that folder into ``<out>/<call>.tar.gz`` (split into
``.partNN`` files of 15 MiB when larger; a file over 16 MiB is left out and named in ``<call>.json``)
beside ``<call>.json``; ``--no-pack`` keeps the plain folder (a rented machine of one's own). Back
here, ``--unpack <folder the files came back to> --into outputs/reference/h100`` puts the files where
the call wrote them, as if it had run here.

Every step runs as its own process (its output in ``<out>/<call>.log``, unbuffered), is given its
allowance (``allowance``: its own budget and what the steps before it saved, or the time left less a
reserve for the summary) and is stopped when it runs out; a failed step does not stop the next. A step that writes a run folder under ``outputs/`` has it copied into ``<out>``, stopped or
not: a benchmark stopped by the budget leaves there ``points.jsonl``, every point it finished.
``<out>/<call>.json`` records each step's command, exit status, seconds and last line, and the same
table is printed last. Models are real architectures built from their configs with random bf16
weights on the GPU (nothing is downloaded; speed and memory do not depend on the values).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from workbook.paths import MODELS_DIR, OUTPUTS_DIR, REPO_ROOT
from workbook import gpu, launcher_watch, params, runtime

RESERVE_SECONDS = 20  # kept back from the last step: the summary and copying the results
BUDGET_MARGIN_SECONDS = 20  # a step's own budget is this much less than it is given: its imports and writing
# What the device brings back from $OUT (its README's limits): 8 files of at most 16 MiB each. The pack
# is split below that; a single file above it would not come back inside the pack either.
PART_BYTES = 15 * 2 ** 20
LARGEST_MEMBER_BYTES = 16 * 2 ** 20
MOST_PARTS = 7  # and <call>.json: 8 files
DEFAULT_BUDGET_SECONDS = 540  # 9 minutes: inside the device's 10-minute limit per command
# A session lent a GPU has 15 minutes of device time in all (the machine's start, idle waits and transfers
# included): one command of 8 minutes is what it can count on, this process's own start and packing included.
FIRST_LIGHT_BUDGET_SECONDS = 480
CALL_BUDGET_SECONDS = {"first-light": FIRST_LIGHT_BUDGET_SECONDS}
# The forecast call's 8B generation job, sized from bandwidth for about 2 minutes. The planner's batch is
# 505 on an H100 and 995 on an H200 (prompt_len 512, 256 new tokens), so 5,000 and 10,000 prompts make 10
# static batches (the pilot's one batch is 10% of the job) of 256 decode steps each: 2,560 steps. On an
# H100 a step reads the 16 GB of bf16 weights and the KV cache (505 rows x ~200 positions x 128 KiB =
# 13 GB): ~9 ms at 3.35 TB/s, ~23 s in all as a floor; the cache's copy each step, 8 TFLOP of matmuls and
# the host's launches make it 2-4x that. An H200 reads twice the cache at 4.8 TB/s: about the same.
FORECAST_PROMPTS = {"h100": 5000, "h200": 10000}
FORECAST_NEW_TOKENS = 256
# A training step's benchmark also runs a generation point (the sweep needs one strategy): on the 1B
# model it costs seconds, where the profile's 8B would spend a minute of the step building and decoding.
QUICK_GENERATION = "bench_generate_model=Llama-3.2-1B"


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]  # after the python executable
    needs_seconds: int  # skipped when less than this is left: a step that cannot finish measures nothing
    budget_flag: str | None = None  # the step's own time-budget option, given the time it may take
    reserve_seconds: int = 0  # kept back for the steps after it: a step that would take all it is given leaves them theirs
    # Its own budget: the most it may take when time is short (a slow step cannot eat the next one's), and
    # whatever the steps before it saved when not; the budgeted steps after it keep theirs either way.
    budget_seconds: int | None = None
    ceilings_options: bool = False  # given --bandwidth-gbs and --peak-tflops from the call's ceilings.json, if written


def calls(profile: str, out: Path) -> dict[str, list[Step]]:
    """The steps of each call for ``profile`` (a GPU profile), writing under ``out``."""
    workbook = ["-m", "workbook"]
    bench = [*workbook, "bench", "--params", profile, "--set"]
    on_gpu = ["--device", "cuda", "--dtype", "bf16"]
    return {
        "first-light": first_light(profile, out),
        "smoke": [
            Step("ceilings", ["-m", "workbook.ceilings", "--profile", profile, "--out", str(out)], 30),
            Step("CUDA context probe", ["-m", "workbook.planner.overhead_probe", "--profile", profile,
                                        "--out", str(out)], 30),
            Step("calibration, 2 cases", [*workbook, "calibrate", "--profile", profile, "--out",
                                          str(out / "smoke-calibration"),
                                          "--only", "llama-3.2-1b/generate,llama-3.2-1b/train-checkpointed"], 45),
            Step("every strategy and training path, tiny sizes", [
                *bench, "bench_generate_model=Llama-3.2-1B", "bench_train_model=Llama-3.2-1B",
                "bench_strategies=seed-after,static-sorted,static-compiled,continuous,hf-pipeline", "bench_batch_sizes=4",
                "bench_examples=8", "bench_max_new_tokens=16", "bench_repeats=1", "prompt_len=256",
                "bench_train_micro_batches=2", "bench_train_steps=3", "seq_len=512",
                "bench_train_baselines=hf-trainer,trl-sft"], 90, "--time-budget-seconds"),
        ],
        "calibration": [
            # The context constant from its own probe (a fresh process), then the grid planned with it.
            Step("CUDA context probe", ["-m", "workbook.planner.overhead_probe", "--profile", profile,
                                        "--out", str(out)], 30),
            # The grid leaves the sweep its time: it writes each case as it is measured, so a cut keeps them.
            Step("calibration grid", [*workbook, "calibrate", "--profile", profile, "--out", str(out),
                                      "--overhead-from", str(out / "cuda_overhead.json")], 240, reserve_seconds=200),
            Step("generation sweep at 32 and the planner's batch, 8B, 256 new tokens, beside Hugging Face's pipeline", [
                # Issue 10's fixed output length (256-512): decode, not prefill, is what the roofline judges.
                # 128 prompts keep the seeds' batch-32 baseline (4 batches of 255 eager steps) within a
                # minute; 'auto' (the planner's batch, 505 on an H100) is capped at them. The sweep stops
                # itself and writes its goals; one timed run a point (a GPU's runs differ by little).
                # Order: the baseline, ours eager, ours compiled (the likeliest to meet the goal), the
                # pipeline beside ours; continuous last (issue 19 compares it on uneven outputs).
                *bench, "bench_strategies=seed-after,static-sorted,static-compiled,hf-pipeline,continuous",
                "bench_batch_sizes=32,auto", "bench_examples=128", "bench_max_new_tokens=256", "bench_repeats=1",
                "bench_train_steps=0"], 150, "--time-budget-seconds"),
        ],
        "training": [
            # Each step leaves the later ones their time: continuous ~3 min (256 prompts, three arms), the 1B
            # sweep what remains but the LoRA point's 90 s (its compile points last: the first a budget cuts).
            Step("continuous vs static on uneven outputs, 8B", [
                "-m", "workbook.bench.continuous_batching", "--model", "Llama-3.1-8B", *on_gpu,
                # 256 prompts of up to 512 new tokens: static's batches each run to their longest output,
                # so its three arms fit the step's ~3 minutes (384 of up to 1,024 left time for one or two).
                "--max-new-tokens", "512", "--memory-gib", "40", "--workloads", "uneven", "--repeats", "1",
                "--examples", "256", "--out", str(out / "continuous_batching")], 120, "--time-budget-seconds",
                reserve_seconds=330),
            Step("training sweep with each memory setting, 1B", [
                *bench, "bench_strategies=seed-after", "bench_examples=32", QUICK_GENERATION,
                "bench_train_model=Llama-3.2-1B",
                # auto: each setting at the planner's largest micro-batch for it (issue 20's "a micro-batch 2x
                # larger at no loss of tokens/s"; and no point the planner says fits may run out of memory)
                "bench_train_micro_batches=auto", "bench_train_steps=12", "bench_train_baselines=hf-trainer,trl-sft",
                "bench_train_settings=loss_chunk_tokens,precision_bf16,chunked_loss_bf16,offload_activations,sdpa_block_mask"],
                120, "--time-budget-seconds",
                reserve_seconds=100),  # the LoRA step's 90 s and its start: a sweep that stops at its budget leaves them
            Step("8B LoRA training point", [
                *bench, "bench_strategies=seed-after", "bench_examples=32", QUICK_GENERATION,
                "bench_train_model=Llama-3.1-8B",
                "lora_rank=16", "bench_train_micro_batches=auto", "bench_train_steps=12",
                "bench_train_baselines=none"], 90, "--time-budget-seconds"),  # the Trainer and TRL are compared on the 1B full fine-tune above
        ],
        "forecast": [
            # The engine's overhead per decode step on the 8B model: why the generation goal is missed, if it is.
            Step("engine overhead, 8B", ["-m", "workbook.bench.engine_overhead", "--model", "Llama-3.1-8B", *on_gpu,
                                         "--profile", profile, "--batch-size", "32", "--out", str(out)], 90,
                 reserve_seconds=260),  # more than the forecast step needs: a stopped step costs seconds
            Step("forecast against the whole run: 8B generation, 1B training", [
                "-m", "workbook.bench.forecast_check", "--profile", profile, "--generate-model", "Llama-3.1-8B",
                "--train-model", "Llama-3.2-1B", "--mixed-prompts", str(FORECAST_PROMPTS.get(profile, 5000)), "--max-new-tokens",
                str(FORECAST_NEW_TOKENS), "--train-steps", "300", "--train-micro-batch", "16", "--repeats", "1",
                "--out", str(out / "forecast")], 240, "--time-budget-seconds"),
        ],
    }


def first_light(profile: str, out: Path) -> list[Step]:
    """The first call of any session with a GPU: the headline numbers in one command of at most 8 minutes
    (``FIRST_LIGHT_BUDGET_SECONDS``), its steps in order of value, each under its own budget.

    The budgets, from the timings the other calls' steps were sized by (no GPU run has been recorded
    yet, so these are estimates with room): each step is a fresh process, and importing torch and
    transformers costs 10-20 s of it on a cold disk; an 8B-shaped model of random bf16 weights builds on
    the GPU in about 10 s (16 GB), a 1B in 2-3 s; HF's eager decode step of the 8B is ~25-35 ms at batch
    32-128 (the weights' 16 GB at 3.35 TB/s are 5 ms of it; Python's launches over 32 layers the rest).
    """
    workbook = ["-m", "workbook"]
    bench = [*workbook, "bench", "--params", profile, "--set"]
    return [
        # 1. The ceilings every roofline below is judged at: a 2 GiB copy and an 8192^3 bf16 matmul, best of
        # 5 (seconds), after torch's import. Then the CUDA context probe: a two-layer model's generation and
        # training steps, flex attention compiled by Triton on first use (~20 s of the 50).
        Step("ceilings", ["-m", "workbook.ceilings", "--profile", profile, "--out", str(out)], 15,
             budget_seconds=30),
        Step("CUDA context probe", ["-m", "workbook.planner.overhead_probe", "--profile", profile, "--out", str(out)],
             25, budget_seconds=50),
        # 2. Six cases (calibration.first_light_cases): two 8B builds (~10 s each) and their generations (256
        # steps: ~8 s at batch 32, ~10 s at 128), four 1B builds and training steps (~5 s each, peft's import
        # for LoRA). Each case is written as it is measured, so a cut keeps those before it.
        Step("planner against the measured peak, 6 cases", [
            "-m", "workbook.planner.calibration", "--out", str(out), "--profile", profile, "--cases", "first-light",
            "--overhead-from", str(out / "cuda_overhead.json")], 40, budget_seconds=100),
        # 3. The 8B generation goals on the same 480 prompts (128-512 tokens, 128 new): static-sorted at the
        # planner's batch first (470 on an H100: every prompt in one batch; an H200's 927 is capped at the
        # 480, which the sweep records), then the seeds' static batches of 32 (15 batches x 127 steps, ~60 s).
        # The sweep measures the ceilings again in-process for its roofline (seconds).
        Step("8B generation: static-sorted at the planner's batch, the seeds' batch 32", [
            *bench, "bench_generate_model=Llama-3.1-8B", "bench_strategies=static-sorted,seed-after",
            "bench_batch_sizes=auto", "bench_examples=480", "bench_max_new_tokens=128", "prompt_len=512",
            "bench_repeats=1", "bench_train_steps=0"], 60, "--time-budget-seconds", budget_seconds=100),
        # Continuous against static on uneven outputs (lognormal, median 32, capped at 256) at the same 24 GiB:
        # static-sorted runs 3 batches of 108 to their longest (~750 steps, ~25 s), continuous and the direct
        # call keep 81 slots full (~256 steps each, ~12 s); the roofline at the measured ceilings.
        Step("8B continuous vs static on uneven outputs", [
            "-m", "workbook.bench.continuous_batching", "--model", "Llama-3.1-8B", "--device", "cuda",
            "--dtype", "bf16", "--max-new-tokens", "256", "--memory-gib", "24", "--workloads", "uneven",
            "--repeats", "1", "--examples", "256", "--out", str(out / "continuous_batching")], 50,
             "--time-budget-seconds", budget_seconds=90, ceilings_options=True),
        # 4. The 1B full fine-tune at the planner's micro-batch: 8 steps (2 warm-up) of ~0.3 s; the sweep's
        # generation point is the 1B's, 16 tokens (seconds), since a benchmark needs one strategy.
        Step("1B full fine-tune at the planner's micro-batch", [
            *bench, "bench_strategies=seed-after", "bench_examples=32", "bench_max_new_tokens=16", QUICK_GENERATION,
            "bench_train_model=Llama-3.2-1B", "bench_train_micro_batches=auto", "bench_train_steps=8",
            "bench_train_baselines=none"], 35, "--time-budget-seconds", budget_seconds=60),
        # 5. With the time the steps above saved (none has a budget of its own here): the forecast of a short
        # 8B generation job (1,000 prompts, 128 new tokens: 2-3 of the planner's batches) against the job run.
        # Writing the random-weights directory (16 GB) and loading it twice take most of 2.5 minutes; the 1B
        # training case after it (60 steps) runs only if its forecast fits the time left.
        Step("forecast against the run: a short 8B generation job", [
            "-m", "workbook.bench.forecast_check", "--profile", profile, "--generate-model", "Llama-3.1-8B",
            "--train-model", "Llama-3.2-1B", "--mixed-prompts", "1000", "--max-new-tokens", "128",
            "--train-steps", "60", "--train-micro-batch", "8", "--repeats", "1", "--out", str(out / "forecast")],
             150, "--time-budget-seconds"),
    ]


def allowance(steps: list[Step], index: int, left: float) -> float:
    """The seconds step ``index`` may run with ``left`` seconds left of the call. A step with a budget of
    its own gets it and what the steps before it saved, less the budgets of the budgeted steps after it;
    when time is short it still gets its own (in order of value: the last steps are skipped). A step
    without one gets what is left less its ``reserve_seconds``."""
    step = steps[index]
    if step.budget_seconds is None:
        return left - step.reserve_seconds
    later = sum(other.budget_seconds or 0 for other in steps[index + 1:])
    return min(left, max(step.budget_seconds, left - later))


def ceilings_options(out: Path) -> list[str]:
    """``--bandwidth-gbs`` and ``--peak-tflops`` from the call's measured ceilings (``workbook.ceilings``'s
    ceilings.json in ``out``), so a roofline is judged at what this GPU does; none before it is written."""
    path = out / "ceilings.json"
    if not path.is_file():
        return []
    measured = json.loads(path.read_text())["measured"]
    return ["--bandwidth-gbs", f"{measured['copy_gb_per_second']:.0f}", "--peak-tflops", f"{measured['matmul_tflops']:.0f}"]


def run_call(steps: list[Step], out: Path, log_path: Path, budget_seconds: float, *, python: str = sys.executable,
             outputs: Path = OUTPUTS_DIR, clock=time.monotonic, say=print, run=None) -> list[dict]:
    """Run ``steps`` in order within ``budget_seconds``; returns one record per step. ``run(argv, env, log,
    log_path, timeout)`` runs one step and returns (status, last line): a process, unless a test gives another."""
    run = run or _run
    deadline = clock() + budget_seconds - RESERVE_SECONDS
    # Offline: the device reaches no network, so a lookup on the Hub fails at once instead of timing out.
    # Each step ends with this process if it is killed (launcher_watch), as it does at the budget's end.
    env = launcher_watch.child_environment({
        **os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "lib"), os.environ.get("PYTHONPATH")]))})
    records = []
    with log_path.open("a") as log:
        for index, step in enumerate(steps):
            left = allowance(steps, index, deadline - clock())
            argv = [python, *step.argv, *(ceilings_options(out) if step.ceilings_options else [])]
            if step.budget_flag:  # less the step's imports (seconds on a cold disk), which its own clock misses
                argv += [step.budget_flag, str(int(max(left - BUDGET_MARGIN_SECONDS, 1)))]
            record = {"step": step.name, "command": " ".join(["python3", *argv[1:]])}
            if left < step.needs_seconds:
                records.append({**record, "status": f"skipped: {left:.0f} s left of the budget, it needs "
                                                     f"{step.needs_seconds} s", "seconds": 0.0, "last_line": ""})
                say(f"[{step.name}] {records[-1]['status']}")
                continue
            log.write(f"\n===== {step.name}: {record['command']}\n")
            log.flush()
            before = _run_folders(outputs)
            began = clock()
            status, last_line = run(argv, env, log, log_path, timeout=left)
            records.append({**record, "status": status, "seconds": round(clock() - began, 1), "last_line": last_line,
                            "run_folders": [str(folder) for folder in _copy_new_folders(outputs, before, out)]})
            say(f"[{step.name}] {status} in {records[-1]['seconds']:.0f} s: {last_line}")
    return records


def _run(argv: list[str], env: dict, log, log_path: Path, timeout: float) -> tuple[str, str]:
    start = log.tell()
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    try:
        code = process.wait(timeout=timeout)
        status = "ok" if code == 0 else f"failed (exit {code})"
    except BaseException as stop:  # the budget, or Ctrl-C
        _kill_tree(process.pid)
        process.wait()
        if not isinstance(stop, subprocess.TimeoutExpired):
            raise
        status = f"stopped: the budget ran out after {timeout:.0f} s"
    log.flush()
    with log_path.open() as text:
        text.seek(start)
        lines = [line.strip() for line in text.read().replace("\r", "\n").splitlines() if line.strip()]
    return status, (lines[-1][:200] if lines else "")


def _kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process below it, also those in a session of their own (the forecast check
    starts its jobs so): one left behind would hold the GPU through the session's later steps."""
    import psutil  # a dependency of the benchmarks; imported here, where it is needed
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    # Stopped first, so that none starts another child between the listing and the kill (one forked
    # in that gap survived under load); listed again once all are stopped, before any dies and is
    # reparented away.
    family = {parent}
    for _ in range(3):
        with contextlib.suppress(psutil.NoSuchProcess):
            family |= set(parent.children(recursive=True))
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.suspend()
    with contextlib.suppress(psutil.NoSuchProcess):
        family |= set(parent.children(recursive=True))
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    # Gone before the next step starts: a kill is delivered when the process next runs, which on a
    # busy machine is later, and until then it still holds what it held (on the device, GPU memory).
    deadline = time.monotonic() + 30
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:  # dead, unreaped
                time.sleep(0.02)


def _run_folders(outputs: Path) -> set[Path]:
    return {path for path in outputs.iterdir() if path.is_dir()} if outputs.is_dir() else set()


def _copy_new_folders(outputs: Path, before: set[Path], out: Path) -> list[Path]:
    """Run folders the step made under ``outputs`` (a benchmark's), copied into ``out``; not the
    model cache (``outputs/models``: the tiny model a fresh machine builds on first use)."""
    copied = []
    for folder in sorted(_run_folders(outputs) - before):
        if folder.name == MODELS_DIR.name:
            continue
        target = out / folder.name
        shutil.copytree(folder, target, dirs_exist_ok=True)
        copied.append(target)
    return copied


def pack(folder: Path, out: Path, name: str) -> dict:
    """``folder`` as ``<out>/<name>.tar.gz`` (members relative to ``folder``), split into parts of
    PART_BYTES when larger, and ``folder`` removed: what the device returns. Returns what was
    packed, split and left out (a file over LARGEST_MEMBER_BYTES)."""
    archive = out / f"{name}.tar.gz"
    left_out = []
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if size > LARGEST_MEMBER_BYTES:
                    left_out.append(f"{path.relative_to(folder)} ({size / 2 ** 20:.0f} MiB: over "
                                    f"{LARGEST_MEMBER_BYTES // 2 ** 20} MiB)")
                    continue
                tar.add(path, arcname=str(path.relative_to(folder)))
    parts = _split(archive)
    shutil.rmtree(folder)
    return {"files": [part.name for part in parts], "bytes": sum(part.stat().st_size for part in parts),
            "left_out": left_out,
            "note": "" if len(parts) <= MOST_PARTS else f"{len(parts)} parts: more than the device returns"}


def _split(archive: Path) -> list[Path]:
    size = archive.stat().st_size
    if size <= PART_BYTES:
        return [archive]
    parts = []
    with archive.open("rb") as whole:
        while chunk := whole.read(PART_BYTES):
            parts.append(archive.with_name(f"{archive.name}.part{len(parts):02d}"))
            parts[-1].write_bytes(chunk)
    archive.unlink()
    return parts


def unpack(returned: Path, into: Path) -> list[str]:
    """Every call's pack found in ``returned`` (whole or in parts), extracted into ``into``;
    returns the names of the packs."""
    into.mkdir(parents=True, exist_ok=True)
    names = sorted({path.name.split(".tar.gz")[0] for path in returned.glob("*.tar.gz*")})
    for name in names:
        parts = sorted(returned.glob(f"{name}.tar.gz.part*")) or [returned / f"{name}.tar.gz"]
        joined = into / f".{name}.tar.gz"
        joined.write_bytes(b"".join(part.read_bytes() for part in parts))
        try:
            with tarfile.open(joined) as tar:
                tar.extractall(into, filter="data")  # no member may land outside ``into``
        finally:
            joined.unlink()
    return names


def after_unpack(into: Path) -> None:
    """What follows a call back here: the measured CUDA context written into its profile, then SUMMARY.md
    (every goal beside its figure, the planner's cases beside their trace) in ``into``."""
    probe = into / "cuda_overhead.json"
    if probe.is_file():
        from workbook.planner import overhead_probe
        print(f"wrote cuda_overhead_gib into {overhead_probe.apply(probe)}")
    from workbook.bench import gpu_summary
    gpu_summary.main([str(into)])


def _budget_text(step: Step) -> str:
    if step.budget_seconds is not None:
        return f"budget {step.budget_seconds} s, skipped under {step.needs_seconds} s"
    return f"what is left, at least {step.needs_seconds} s" + (
        f", {step.reserve_seconds} s kept for the steps after it" if step.reserve_seconds else "")


def table(call: str, records: list[dict]) -> str:
    lines = [f"| {call}: step | status | seconds | last line |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['last_line'].replace('|', '/')} |"
              for r in records]
    return "\n".join(lines) + "\n"


def call_profile(named: str, detected: list[dict] | None = None) -> tuple[str, str]:
    """The profile a call runs with, and why. The device may lend an H200 to a session that asked for
    no kind (when no H100 opens), so the GPU at hand decides: a profile named for another GPU would
    plan its memory and roofline with the wrong capacity and bandwidth."""
    gpus = gpu.detect()["gpus"] if detected is None else detected
    choice = gpu.select_profile(gpus, params.load_all())
    if named == "auto":
        return choice.profile, f"profile {choice.profile}: {choice.reason}"
    if gpus and choice.exact and choice.profile != named:
        return choice.profile, f"profile {choice.profile}, not {named} as named: {choice.reason}"
    return named, f"profile {named}, as named ({choice.reason})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook gpu-session", description=__doc__.split("\n\n")[0])
    parser.add_argument("--call", choices=list(calls("", Path())))
    parser.add_argument("--profile", default="auto", help="the lent GPU's profile: h100, h200, or auto (default: the "
                        "profile of the GPU at hand; a named one that another GPU's profile matches gives way to it)")
    parser.add_argument("--out", help="results folder ($OUT on the device)")
    parser.add_argument("--budget-seconds", type=float, help="the call's seconds from this process's start to its "
                        f"packing (default: {FIRST_LIGHT_BUDGET_SECONDS} for first-light, {DEFAULT_BUDGET_SECONDS} "
                        "for the others)")
    parser.add_argument("--list", action="store_true", help="print the call's commands and stop")
    parser.add_argument("--no-pack", action="store_true", help="leave the results as a folder under --out")
    parser.add_argument("--unpack", metavar="FOLDER", help="here: extract the packs the device returned into --into")
    parser.add_argument("--into", help="with --unpack: e.g. outputs/reference/h100")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more overrides for every `workbook bench` step, after its own (they win): e.g. "
                             "attn_implementation=eager if flex attention fails on this GPU")
    args = parser.parse_args(argv)
    if args.unpack:
        if not args.into:
            parser.error("--unpack needs --into (e.g. outputs/reference/h100)")
        names = unpack(Path(args.unpack), Path(args.into))
        print(f"unpacked {', '.join(names) or 'nothing (no <call>.tar.gz found)'} into {args.into}")
        if names:
            after_unpack(Path(args.into))
        return 0 if names else 1
    if not (args.call and args.profile and args.out):
        parser.error("--call, --profile and --out are required (or --unpack FOLDER --into FOLDER)")
    out = Path(args.out)
    folder = out if args.no_pack else out / args.call
    profile, why = call_profile(args.profile)
    print(why)
    steps = [dataclasses.replace(step, argv=[*step.argv, *args.set]) if step.argv[:3] == ["-m", "workbook", "bench"]
             else step for step in calls(profile, folder)[args.call]]
    budget = args.budget_seconds or CALL_BUDGET_SECONDS.get(args.call, DEFAULT_BUDGET_SECONDS)
    if args.list:
        print(f"{args.call}: {budget:.0f} s in all, {RESERVE_SECONDS} s of them kept for the summary and packing")
        print("\n".join(f"{step.name} ({_budget_text(step)}): python3 {' '.join(step.argv)}"
                         + (" [--bandwidth-gbs --peak-tflops from ceilings.json]" if step.ceilings_options else "")
                         for step in steps))
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    # From this process's start: its imports and the GPU's detection are seconds of the same budget.
    records = run_call(steps, folder, folder / f"{args.call}.log", budget - (runtime.process_age_seconds() or 0))
    summary = {"call": args.call, "profile": profile, "profile_named": args.profile, "profile_why": why,
               "budget_seconds": budget, "steps": records}
    (folder / f"{args.call}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(args.call, records))
    if not args.no_pack:
        summary["pack"] = pack(folder, out, args.call)
        (out / f"{args.call}.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"packed into {', '.join(summary['pack']['files'])} ({summary['pack']['bytes'] / 2 ** 20:.1f} MiB)"
              + "".join(f"; left out {item}" for item in summary["pack"]["left_out"]) + summary["pack"]["note"])
    return 0 if all(record["status"] == "ok" for record in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
