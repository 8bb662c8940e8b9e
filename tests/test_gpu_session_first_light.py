"""The first call of a session with a GPU (``gpu_session --call first-light``), rehearsed here: every step's
command parses with its own tool's parser, its budgets fit the 8 minutes a session can count on, and the
budget logic, run on a fake clock, keeps a cut step's results and still gives the later steps theirs."""

import argparse
import importlib
import json

import pytest
import torch

from workbook import params
from workbook.bench import gpu_session
from workbook.bench.counting import parse_strategies
from workbook.bench.settings import BenchSettings
from workbook.planner import calibration

STARTUP_SECONDS = 10  # the session's own interpreter, imports and GPU detection before its first step


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parsed_by_its_tool(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``python3 <argv>`` parsed by the parser of the tool it runs (nothing after the parse runs)."""
    assert argv[0] == "-m"
    module = importlib.import_module("workbook.cli" if argv[1] == "workbook" else argv[1])
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        with pytest.raises(Parsed) as stopped:
            module.main(argv[2:])
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    return stopped.value.namespace


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_every_first_light_command_parses_with_its_own_tool(profile, tmp_path, monkeypatch):
    (tmp_path / "ceilings.json").write_text(json.dumps({"measured": {"copy_gb_per_second": 2900.4,
                                                                     "matmul_tflops": 701.2}}))
    profile_params = params.load(params.profile_path(profile))
    for step in gpu_session.calls(profile, tmp_path)["first-light"]:
        argv = [*step.argv, *([step.budget_flag, "100"] if step.budget_flag else []),
                *(gpu_session.ceilings_options(tmp_path) if step.ceilings_options else [])]
        namespace = parsed_by_its_tool(argv, monkeypatch)  # a misspelt option exits 2 here, not on the GPU
        if step.budget_flag:
            assert namespace.time_budget_seconds == 100, step.name
        if step.ceilings_options:  # the roofline at this GPU's measured ceilings
            assert (namespace.bandwidth_gbs, namespace.peak_tflops) == (2900, 701), step.name
        if "--set" in step.argv:  # every override a key of this profile, with a value it takes
            settings = BenchSettings.from_params(params.apply_overrides(profile_params,
                                                                        params.parse_overrides(namespace.set)))
            parse_strategies(settings.bench_strategies)  # a misspelt strategy fails here, not at the sweep's start
        if getattr(namespace, "cases", None):
            assert namespace.cases in calibration.NAMED_CASES
            assert namespace.overhead_from == str(tmp_path / "cuda_overhead.json")  # the probe step's file


def test_the_named_case_list_spans_generation_and_training_and_one_case_near_the_largest_batch():
    for profile in ("h100", "h200"):
        cases = calibration.named_cases("first-light", profile)
        memory = calibration._profile_gpu_memory_bytes(profile)
        assert len(cases) >= 6 and len({case.name for case in cases}) == len(cases)
        generation = [case for case in cases if case.mode == "generate" and case.model == "llama-3.1-8b"]
        assert len({case.batch_size for case in generation}) == 2
        training = [case for case in cases if case.mode == "train"]
        assert any(not c.grad_checkpointing and not c.lora_rank for c in training)
        assert any(c.grad_checkpointing for c in training) and any(c.lora_rank for c in training)
        near = cases[-1]
        largest = calibration.plan_for_case(near, gpu_memory_bytes=memory).max_batch_size
        assert largest * 0.8 <= near.batch_size < largest  # near the planner's largest, and planned to fit
    with pytest.raises(SystemExit, match="no such case list; the lists: first-light"):
        calibration.named_cases("first-lite", "h100")


def test_first_light_budgets_fit_eight_minutes_in_order_of_value():
    steps = gpu_session.calls("h100", gpu_session.Path("/out"))["first-light"]
    budgeted = [step.budget_seconds for step in steps if step.budget_seconds is not None]
    assert sum(budgeted) + gpu_session.RESERVE_SECONDS + STARTUP_SECONDS <= gpu_session.FIRST_LIGHT_BUDGET_SECONDS
    assert gpu_session.FIRST_LIGHT_BUDGET_SECONDS <= 8 * 60
    assert all(step.needs_seconds <= (step.budget_seconds or step.needs_seconds) for step in steps)
    assert [step.name.split(":")[0] for step in steps][:3] == [
        "ceilings", "CUDA context probe", "planner against the measured peak, 6 cases"]
    assert steps[-1].budget_seconds is None  # the forecast runs on what the others saved


def test_list_prints_each_step_with_its_budget(capsys, tmp_path):
    assert gpu_session.main(["--call", "first-light", "--profile", "h100", "--out", str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out
    assert "first-light: 480 s in all" in listed
    assert "ceilings (budget 30 s, skipped under 15 s): python3 -m workbook.ceilings --profile h100" in listed
    assert "(what is left, at least 150 s): python3 -m workbook.bench.forecast_check" in listed
    assert not (tmp_path / "first-light").exists()


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cut_step_keeps_its_results_and_the_later_steps_still_get_their_budget(tmp_path, monkeypatch):
    """On a fake clock: the calibration hangs after writing two cases; it is stopped at its allowance, its
    file stays and is packed, the steps after it run with their full budgets, the last is skipped."""
    clock, given = FakeClock(), {}
    takes = {"ceilings": 12, "probe": 20, "calibration": 1000, "bench": 40, "training": 70}

    def fake_run(argv, env, log, log_path, timeout):
        name = argv[3]  # python -c pass <name> [budget flag]
        given[name] = timeout
        if name == "calibration":  # writes each case as it is measured, then hangs
            (tmp_path / "out" / "memory_accuracy.json").write_text('{"cases": [1, 2]}')
        clock.now += min(takes[name], timeout)
        return ("ok", "done") if takes[name] <= timeout else (f"stopped: the budget ran out after {timeout:.0f} s", "")

    def step(name, needs, budget, flag=None):
        return gpu_session.Step(name, ["-c", "pass", name], needs, flag, budget_seconds=budget)

    steps = [step("ceilings", 15, 30), step("probe", 25, 50), step("calibration", 40, 100),
             step("bench", 60, 100, "--time-budget-seconds"), step("training", 35, 60),
             gpu_session.Step("forecast", ["-c", "pass", "forecast"], 150)]
    (tmp_path / "out").mkdir()
    records = gpu_session.run_call(steps, tmp_path / "out", tmp_path / "out" / "call.log", budget_seconds=400,
                                   outputs=tmp_path / "none", clock=clock, say=lambda line: None, run=fake_run)

    status = {record["step"]: record["status"] for record in records}
    # 380 s after the reserve: the first step gets what the budgets after it leave (70 s of slack).
    assert given["ceilings"] == 380 - 310
    assert given["probe"] == 368 - 260  # what ceilings saved flows to the next step
    # Its own budget and what the steps before it saved, never the budgets of the steps after it.
    assert given["calibration"] == 348 - (100 + 60)
    assert status["calibration"].startswith("stopped") and json.loads(
        (tmp_path / "out" / "memory_accuracy.json").read_text()) == {"cases": [1, 2]}
    assert given["bench"] == 100 and given["training"] == 60 + (100 - 40)  # their whole budgets, and bench's savings
    assert records[3]["command"].endswith("--time-budget-seconds 80")  # less the step's own imports
    assert status["forecast"].startswith("skipped") and "it needs 150 s" in status["forecast"]
    packed = gpu_session.pack(tmp_path / "out", tmp_path, "first-light")
    gpu_session.unpack(tmp_path, tmp_path / "back")
    assert packed["files"] == ["first-light.tar.gz"] and (tmp_path / "back" / "memory_accuracy.json").is_file()


def test_when_time_is_short_the_steps_of_more_value_keep_their_budget(tmp_path):
    """A late start (a slow cold disk) takes from the last steps, never from the first ones."""
    steps = [gpu_session.Step("first", [], 10, budget_seconds=100), gpu_session.Step("second", [], 10, budget_seconds=100)]
    assert gpu_session.allowance(steps, 0, left=150) == 100
    assert gpu_session.allowance(steps, 1, left=50) == 50
    assert gpu_session.allowance(steps, 0, left=80) == 80


def test_unpacking_a_call_writes_the_measured_context_into_its_profile_and_the_summary(tmp_path, monkeypatch):
    from workbook.planner import overhead_probe
    applied = []
    monkeypatch.setattr(overhead_probe, "apply", lambda path: applied.append(path) or "params/h100.yaml")
    folder = tmp_path / "returned" / "first-light"
    folder.mkdir(parents=True)
    (folder / "cuda_overhead.json").write_text(json.dumps({"profile": "h100", "overhead_bytes": 2 ** 29,
                                                           "hardware_name": "NVIDIA H100 80GB HBM3"}))
    gpu_session.pack(folder, tmp_path / "returned", "first-light")
    into = tmp_path / "reference" / "h100"
    assert gpu_session.main(["--unpack", str(tmp_path / "returned"), "--into", str(into)]) == 0
    assert applied == [into / "cuda_overhead.json"]
    assert "| CUDA context constant measured by its own probe | 0.50 GiB" in (into / "SUMMARY.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the cases are measured")
def test_a_named_case_list_without_a_gpu_measures_nothing_and_spends_no_time_on_the_cpu_checks(tmp_path, capsys):
    assert calibration.main(["--out", str(tmp_path), "--profile", "h100", "--cases", "first-light"]) == 0
    assert "nothing measured" in capsys.readouterr().out and not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        calibration.main(["--out", str(tmp_path), "--profile", "h100", "--cases", "first-light", "--only", "llama"])
    assert calibration.command_line("out", "h100", "first-light").endswith("--profile h100 --cases first-light")
