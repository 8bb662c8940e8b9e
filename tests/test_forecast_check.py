"""The forecast check's GPU form, without a GPU and without timing anything: the cases a GPU profile
runs, a preset built first as a random-weights directory, the command that reproduces the check, the
time budget that stops a command and records a case it could not finish, and the projection beside
seed 000's claims."""

import json
import subprocess
import time

import pytest

from workbook.bench import forecast_check, forecast_report
from workbook.bench.claims import SEED_000_CLAIMS, SEED_000_JOB


def arguments(*argv: str):
    return forecast_check.parser().parse_args(list(argv))


def session(**changes) -> forecast_check.Session:
    return forecast_check.Session(**{"env": {}, "profile": "h100", "device": "cuda", "clocks": ("wall",), "projects": True,
                                     "log": lambda line: None, **changes})


def forecast_output(predicted: float, prompts: int = 1500, max_new_tokens: int = 256) -> str:
    profiles = [{"profile": "h100", "wall_seconds": predicted, "gpu_hours": predicted / 3600, "usd": predicted / 1440,
                 "basis": "measured here (pilot)"},
                {"profile": "h200", "wall_seconds": predicted * 0.7, "gpu_hours": 0.1, "usd": 0.05, "basis": "projected"},
                {"profile": "cpu", "wall_seconds": None, "gpu_hours": None, "usd": None, "basis": "not projected"}]
    return json.dumps({"predicted_wall_seconds": predicted, "predicted_wall_seconds_range": [predicted * 0.9, predicted * 1.1],
                       "pilot": {"batches": 1, "prompts": 150, "seconds": 9.0, "share_of_job_batches": 0.1},
                       "timings": {}, "profiles": profiles,
                       "job": {"prompts": prompts, "batches": 2, "batch_size": 768, "backend": "static",
                               "model": "/work/Llama-3.1-8B-random-bf16", "max_new_tokens": max_new_tokens,
                               "batch_seconds_planned": [1.0, 2.0]}})


def test_the_cpu_profile_keeps_its_cases_and_its_recorded_command(tmp_path):
    args = arguments("--out", "outputs/reference/cpu", "--mixed-prompts", "1000", "--train-steps", "100")
    names = [name for name, _, _ in forecast_check.cases(args, tmp_path, on_gpu=False)]
    # The cpu profile draws 8 samples a prompt: each is an output of its own, and the names say so.
    assert names == ["the profile's 1,500 prompts x 8 samples, EOS-ended", "1000 mixed-length prompts x 8 samples, EOS-ended",
                     "1000 mixed-length prompts x 8 samples, fixed length (cut at max_new_tokens 3)",
                     "1000 mixed-length prompts, EOS-ended, continuous backend (one sample each, up to 16 new tokens)",
                     "training, 100 steps (shipped sample, micro-batch 4)",
                     "training, 200 steps of 2,000 pairs of widely mixed lengths (packing, micro-batch 16: rows change "
                     "in cost across the epoch)"]
    mixed = forecast_check.cases(args, tmp_path, on_gpu=False)[-1][2]
    assert f"train_data_path={tmp_path / 'mixed-pairs.jsonl'}" in mixed and "padding=packing" in mixed
    only = forecast_check.cases(arguments("--only-training"), tmp_path, on_gpu=False)
    assert [mode for _, mode, _ in only] == ["train", "train"]
    [(name, _, _)] = forecast_check.cases(arguments("--only-mixed-training"), tmp_path, on_gpu=False)
    assert "widely mixed lengths" in name
    assert forecast_check.command_line(args) == (
        "workbook forecast-check --out outputs/reference/cpu --mixed-prompts 1000 "
        "--train-steps 100 --train-micro-batch 4 --threads 1 --repeats 3")


def test_a_gpu_profile_runs_one_fixed_length_generation_case_and_the_training_run(tmp_path):
    args = arguments("--profile", "h100", "--generate-model", "Llama-3.1-8B", "--train-model", "Llama-3.2-1B",
                     "--mixed-prompts", "1500", "--max-new-tokens", "256", "--repeats", "1",
                     "--time-budget-seconds", "500", "--out", "/tmp/out")
    (generate, train) = forecast_check.cases(args, tmp_path, on_gpu=True)
    assert generate[:2] == ("1500 mixed-length prompts, fixed length (max_new_tokens 256)", "generate")
    assert "max_new_tokens=256" in generate[2] and f"prompts_path={tmp_path / 'mixed.jsonl'}" in generate[2]
    assert train[1] == "train" and "max_steps=300" in train[2]
    assert forecast_check.command_line(args).endswith(
        "--repeats 1 --profile h100 --generate-model Llama-3.1-8B --train-model Llama-3.2-1B --time-budget-seconds 500")


def test_a_preset_is_built_once_as_a_random_weights_directory_on_the_device(tmp_path, monkeypatch):
    ran = []

    def fake_command(argv, session):
        ran.append(argv)
        return 12.0, 1.0, subprocess.CompletedProcess(argv, 0, json.dumps({"preset": argv[3], "dtype": "bf16",
                                                                           "built_on": "cuda", "parameters": 8}), "")

    monkeypatch.setattr(forecast_check, "command", fake_command)
    built = {}
    assert forecast_check.model_directory("tiny", tmp_path, session(), "bf16", built) == "tiny"
    for _ in range(2):
        directory = forecast_check.model_directory("Llama-3.1-8B", tmp_path, session(), "bf16", built)
    assert directory == str(tmp_path / "Llama-3.1-8B-random-bf16") and len(ran) == 1
    assert ran[0][:2] == ["-m", "workbook.random_weights"] and ran[0][-2:] == ["--device", "cuda"]
    assert built["Llama-3.1-8B"]["built_on"] == "cuda" and built["Llama-3.1-8B"]["command_seconds"] == 12.0


@pytest.mark.multiprocess
def test_a_command_past_the_deadline_is_stopped_with_its_children():
    began = time.monotonic()
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print('started', flush=True); time.sleep(60)"
    with pytest.raises(forecast_check.NotFinished, match="stopped at the time budget's deadline"):
        forecast_check.command(["-c", child], session(deadline=time.monotonic() + 2))
    assert time.monotonic() - began < 10
    with pytest.raises(forecast_check.NotFinished, match="no time left"):
        forecast_check.command(["-c", "print(1)"], session(deadline=time.monotonic() - 1))
    with pytest.raises(forecast_check.NotFinished, match=r"failed \(3\)"):
        forecast_check.command(["-c", "import sys; sys.exit(3)"], session())


def test_a_job_whose_forecast_does_not_fit_the_time_left_is_not_run_and_the_case_is_recorded(monkeypatch):
    ran = []

    def fake_workbook(args, session):
        ran.append(args[0])
        return 30.0, 1.0, subprocess.CompletedProcess(args, 0, forecast_output(predicted=400.0), "")

    monkeypatch.setattr(forecast_check, "workbook", fake_workbook)
    row = forecast_check.check("8B", "generate", ["output_path=/p.jsonl"], ["output_path=/f.jsonl"],
                               session(deadline=time.monotonic() + 100), repeats=1)
    assert ran == ["forecast"]  # the job itself was not started
    assert row["trials"] == [] and "wall" not in row
    assert row["not_finished"]["reason"].startswith("the whole job was not run: its forecast, 400 s")
    assert row["not_finished"]["forecast"]["predicted_seconds"] == 400.0
    assert "batch_seconds_planned" not in row["not_finished"]["forecast"]["job"]


def test_a_case_keeps_the_trials_that_finished_before_the_budget_ran_out(monkeypatch):
    calls = []

    def fake_workbook(args, session):
        calls.append(args[0])
        if args[0] == "forecast":
            return 30.0, 1.0, subprocess.CompletedProcess(args, 0, forecast_output(predicted=100.0), "")
        if calls.count("generate") == 2:
            raise forecast_check.NotFinished("python -m workbook generate stopped at the time budget's deadline")
        return 110.0, 20.0, subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(forecast_check, "workbook", fake_workbook)
    row = forecast_check.check("8B", "generate", ["output_path=/p.jsonl"], ["output_path=/f.jsonl"], session(), 3)
    assert calls == ["forecast", "generate", "forecast", "generate"]
    assert len(row["trials"]) == 1 and row["wall"]["errors"] == [pytest.approx(-10 / 110, abs=1e-4)]
    assert row["not_finished"]["trial"] == 2 and row["not_finished"]["forecast"]["predicted_seconds"] == 100.0
    assert row["trials"][0]["profiles"][1]["profile"] == "h200"  # a GPU check keeps the projection


def test_the_markdown_lists_unfinished_cases_and_the_projection_beside_seed_000(tmp_path):
    summary = forecast_check._forecast_summary(json.loads(forecast_output(predicted=120.0)))
    result = {"command": "workbook forecast-check --profile h100", "what": "the check",
              "goal": "|error| <= 10%", "threads": 1, "machine_note": "one GPU", "hardware": {"cpu": {}, "gpus": []},
              "profile": "h100", "seed_000": {"job": SEED_000_JOB, "claims": SEED_000_CLAIMS},
              "models_built": {"Llama-3.1-8B": {"dtype": "bf16", "parameters": 8030261248, "built_on": "cuda",
                                                "command_seconds": 40.0}},
              "cases": [{"case": "8B generation", "mode": "generate", "settings": [], "trials": [],
                         "not_finished": {"trial": 1, "reason": "stopped at the time budget's deadline",
                                          "forecast": summary}},
                        {"case": "1B training", "mode": "train", "settings": [], "trials": [],
                         "not_finished": {"trial": 1, "reason": "no time left in the budget", "forecast": None}},
                        {"case": "continuous", "mode": "generate", "settings": [], "trials": [],
                         "eta_errors": {"0.1": [-0.071, 0.02], "0.25": [None, -0.5]}}]}
    text = forecast_report.markdown(result)
    assert "| case | after 10% | after 25% |" in text and "| continuous | -7%, +2% | -, -50% |" in text
    assert "Llama-3.1-8B: random bf16 weights (8,030,261,248 parameters) built on cuda in 40 s" in text
    assert "- 8B generation, trial 1: stopped at the time budget's deadline (its forecast: 120.0 s)" in text
    assert "- 1B training, trial 1: no time left in the budget" in text
    assert "53,597 prompts to an 8B model" in text and "x286" in text  # 53,597 x 2,048 over 1,500 x 256
    lines = text.splitlines()
    h200 = next(line for line in lines if line.startswith("| h200 |"))
    assert h200.startswith("| h200 | 84.0 s | $0.0500 | projected | 6.67 h | $14.29 | ~2-3 h; $1.00-2.40")
    assert next(line for line in lines if line.startswith("| cpu |")).startswith("| cpu | - | - | not projected | - | - | - |")


def test_the_mixed_length_training_set_holds_short_and_long_pairs(tmp_path):
    pairs = [json.loads(line) for line in forecast_check.mixed_training_pairs(tmp_path / "pairs.jsonl", 500).read_text().splitlines()]
    lengths = sorted(len(pair["input"]) for pair in pairs)
    assert len(pairs) == 500 and lengths[len(lengths) // 2] < 30 and lengths[-1] > 5 * lengths[len(lengths) // 2]


def test_the_runs_steps_are_set_beside_the_step_model_per_phase_without_the_loader_starts():
    """The run's own step seconds per phase (first, middle and last tenth of its steps), each epoch's
    first step (the loader's start, the warm-up) left out, against the forecast's planned step."""
    history = [{"step": step, "seconds": 5.0 if (step - 1) % 10 == 0 else (0.2 if step <= 50 else 0.1)}
               for step in range(1, 101)]
    made = {"job": {"steps_per_epoch": 10},
            "pilot": {"step_model": {"planned_step_seconds_by_phase": {"first tenth": 0.22, "middle tenth": 0.1,
                                                                       "last tenth": 0.09}}}}
    phases = forecast_check.step_phases(made, history)
    assert phases["first tenth"] == {"planned_step_seconds": 0.22, "measured_step_seconds": 0.2, "error": 0.1}
    assert phases["last tenth"]["error"] == pytest.approx(-0.1)
    row = {"case": "mixed", "phases": {phase: {key: [value] for key, value in entry.items()}
                                       for phase, entry in phases.items()}}
    lines = forecast_report.phase_lines({"cases": [row]})
    assert "| mixed | first tenth | 0.2200 | 0.2000 | +10.0% |" in lines
