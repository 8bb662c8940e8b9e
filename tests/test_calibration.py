"""The planner's calibration: exact CPU checks, a well-formed GPU grid, the CLI on CPU.

The GPU grid itself is a benchmark run by `python -m workbook.planner.calibration` on a GPU; here only
its shape, its planner predictions and its summary arithmetic are checked.
"""

import json
import subprocess
import sys

import pytest
import torch

from workbook import planner
from workbook.paths import REPO_ROOT
from workbook.planner import calibration, exact_checks
from workbook.planner.calibration import (
    CalibrationCase,
    calibration_grid,
    compare,
    measure_case,
    plan_for_case,
    skip_reason,
    summarize,
)
from workbook.planner.exact_checks import cpu_exact_checks
from workbook.planner.finder import ProbeMeasurement
from workbook.units import GiB, MiB

H200_BYTES = int(140.4 * GiB)  # params/h200.yaml: gpu_memory_gib
EXPECTED_CHECKS = {"parameters", "weights_fp32", "weights_bf16", "kv_cache_after_generate",
                   "activations_per_layer"}


# ---------------------------------------------------------------------------------------------
# What CPU checks exactly.


@pytest.fixture(scope="module")
def cpu_checks():
    pytest.importorskip("workbook.tiny_model")
    return cpu_exact_checks()


def test_cpu_exact_checks_are_exact(cpu_checks):
    checks = {check["name"]: check for check in cpu_checks["checks"]}
    assert set(checks) == EXPECTED_CHECKS
    assert cpu_checks["all_exact"]
    for check in checks.values():
        assert check["predicted"] == check["measured"] and check["exact"], check
    assert checks["weights_fp32"]["measured"] == 4 * checks["parameters"]["measured"]
    assert checks["weights_bf16"]["measured"] == 2 * checks["parameters"]["measured"]
    assert checks["kv_cache_after_generate"]["generated_tokens"] == exact_checks.KV_CHECK_NEW_TOKENS
    assert json.loads(json.dumps(cpu_checks)) == cpu_checks


# ---------------------------------------------------------------------------------------------
# The grid, and the planner's predictions for it (computable without a GPU).


def test_grid_is_well_formed_and_planned_without_a_gpu():
    grid = calibration_grid("h200")
    assert len({case.name for case in grid}) == len(grid)
    assert {case.model for case in grid} == {"tiny", "qwen2.5-0.5b", "llama-3.2-1b",
                                             "llama-3.1-8b"}
    kinds = {(case.mode, case.grad_checkpointing, case.lora_rank > 0) for case in grid}
    assert kinds == {("generate", False, False), ("train", False, False),
                     ("train", True, False), ("train", False, True)}
    budget = planner.budget_bytes(H200_BYTES, planner.DEFAULT_SAFETY_MARGIN)
    for case in grid:
        assert case.batch_size >= 1
        if case.mode == "generate":
            assert case.prompt_len >= 1 and case.new_tokens >= 1 and case.seq_len == 0
        else:
            assert case.seq_len >= 1 and case.prompt_len == case.new_tokens == 0
        assert case.counts_toward_goal == (case.model != "tiny")
        plan = plan_for_case(case, gpu_memory_bytes=H200_BYTES)
        assert plan.mode == case.mode and plan.batch_size == case.batch_size
        assert 0 < plan.total_bytes <= calibration.GRID_BUDGET_FRACTION * budget
        assert json.loads(json.dumps(case.to_dict()))["name"] == case.name


def test_plan_for_case_takes_the_measured_overhead():
    case = calibration_grid("h200")[0]
    default = plan_for_case(case, gpu_memory_bytes=H200_BYTES)
    measured = plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=600 * MiB)
    assert measured.total_bytes - default.total_bytes == 88 * MiB


def test_the_grid_runs_without_the_probes_constant_when_its_probe_failed(tmp_path, capsys):
    """The GPU session's calibration call: a failed context probe leaves no file; the grid still runs,
    each case then planned with the memory outside PyTorch's allocator measured in its own run."""
    (tmp_path / "cuda_overhead.json").write_text(json.dumps({"overhead_bytes": 536870912}))
    assert calibration._probed_overhead(str(tmp_path / "cuda_overhead.json")) == 536870912
    assert calibration._probed_overhead(str(tmp_path / "missing.json")) is None
    assert "missing.json is missing (its probe did not run or failed)" in capsys.readouterr().out
    assert calibration._probed_overhead(None) is None


def test_smaller_gpus_get_a_shorter_grid_and_cpu_has_none():
    a100_40gb = {case.name for case in calibration_grid("a100-40gb")}
    assert a100_40gb < {case.name for case in calibration_grid("h200")}
    assert not any(name.startswith("llama-3.1-8b/train") for name in a100_40gb)
    with pytest.raises(ValueError, match="no GPU.*h200"):
        calibration_grid("cpu")


def test_lora_cases_are_skipped_with_the_reason_when_peft_is_missing(monkeypatch):
    lora = next(case for case in calibration_grid("h200") if case.lora_rank > 0)
    monkeypatch.setattr(calibration.importlib.util, "find_spec",
                        lambda name: None if name == "peft" else object())
    assert "peft" in skip_reason(lora)
    full = next(case for case in calibration_grid("h200") if case.mode == "train")
    assert skip_reason(full) is None


@pytest.mark.parametrize("case", [
    CalibrationCase(name="tiny/generate/small", model="tiny", mode="generate", batch_size=2,
                    prompt_len=8, new_tokens=5),
    CalibrationCase(name="tiny/train-checkpointed/small", model="tiny", mode="train",
                    batch_size=2, seq_len=16, grad_checkpointing=True),
], ids=lambda case: case.name)
def test_the_gpu_path_builds_and_probes_the_tiny_model_on_cpu(case):
    # The code measure_case runs on the GPU (random bf16 weights from the config, the finder's
    # probes), run on CPU, where no peak is measured.
    result = calibration.run_case_probe(case, torch.device("cpu"))
    assert result.batch_size == 2 and result.peak_bytes is None
    if case.mode == "generate":
        assert result.generated_tokens == case.new_tokens


# ---------------------------------------------------------------------------------------------
# Comparing and summarizing (stand-in measurements: the arithmetic, not the GPU).


def gpu_like_measurement(reserved, allocated, non_pytorch) -> ProbeMeasurement:
    """A hand-made measurement with the fields a CUDA probe fills (not a real reading)."""
    return ProbeMeasurement(batch_size=1, device="cuda:0", seconds=1.0,
                            peak_reserved_bytes=reserved, peak_allocated_bytes=allocated,
                            non_pytorch_bytes=non_pytorch, sequence_tokens=768)


def test_compare_reports_signed_errors_of_the_peak_and_of_the_tensors():
    case = next(case for case in calibration_grid("h200") if case.model == "llama-3.1-8b")
    plan = plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=500 * MiB)
    tensors = plan.total_bytes - sum(term.bytes for term in plan.terms
                                     if term.name in ("cuda_context", "allocator_fragmentation"))
    measured = gpu_like_measurement(reserved=plan.total_bytes - 500 * MiB - 1000,
                                    allocated=tensors, non_pytorch=500 * MiB)
    record = compare(plan, measured)
    assert record["measured_bytes"] == plan.total_bytes - 1000
    assert record["relative_error"] == pytest.approx(1000 / (plan.total_bytes - 1000))
    assert record["relative_error"] > 0  # overestimate: the safe side
    assert record["tensor_relative_error"] == 0


def record(name, status, error=None, counts=True):
    values = {"case": {"name": name, "counts_toward_goal": counts}, "status": status}
    if status == "measured":
        values["relative_error"] = error
    if status == "skipped":
        values["reason"] = "LoRA cases need the 'peft' package"
    return values


def test_summary_against_the_goal():
    records = [record("a", "measured", 0.01), record("b", "measured", -0.03),
               record("c", "measured", 0.005), record("tiny", "measured", 0.5, counts=False),
               record("lora", "skipped")]
    summary = summarize(records)
    assert summary["median_abs_relative_error"] == pytest.approx(0.01)
    assert summary["max_abs_relative_error"] == pytest.approx(0.03)
    assert summary["measured"] == 4 and summary["counted_toward_goal"] == 3
    assert summary["skipped"] == [{"name": "lora", "reason": "LoRA cases need the 'peft' package"}]
    assert summary["meets_goal"]
    assert not summarize(records + [record("8b", "oom")])["meets_goal"]
    assert not summarize(records + [record("d", "measured", 0.05)])["meets_goal"]
    assert not summarize([record("lora", "skipped")])["meets_goal"]  # nothing measured
    # A case that failed otherwise than out of memory is listed with why; unchecked, it leaves the goal unmet,
    # as does a grid cut short.
    failed = summarize(records + [{"case": {"name": "8b-lora"}, "status": "failed", "reason": "RuntimeError: x"}])
    assert failed["failed"] == [{"name": "8b-lora", "reason": "RuntimeError: x"}] and not failed["meets_goal"]
    assert summarize(records, planned=len(records))["meets_goal"] and not summarize(records, planned=20)["meets_goal"]


# ---------------------------------------------------------------------------------------------
# Without a GPU: the CLI runs the CPU checks and says the GPU part is pending.


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_measure_case_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        measure_case(calibration_grid("h200")[0])
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        calibration.run_calibration("unused", "h200")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_cli_on_cpu_writes_the_exact_checks_and_says_the_gpu_part_is_pending(tmp_path):
    pytest.importorskip("workbook.tiny_model")
    out = tmp_path / "reference" / "h200"
    completed = subprocess.run(
        [sys.executable, "-m", "workbook.planner.calibration", "--out", str(out), "--profile", "h200"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert "GPU calibration pending" in completed.stdout
    written = json.loads((out / exact_checks.CPU_CHECKS_FILE).read_text())
    assert written["all_exact"]
    assert written["gpu_calibration"]["status"] == "pending"
    assert "--profile h200" in written["command"]
    assert not (out / calibration.RESULT_FILE).exists()  # never a placeholder for GPU results


# ---------------------------------------------------------------------------------------------
# On a GPU only.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["generate", "train"])
def test_measure_case_on_the_tiny_model(mode):
    case = next(case for case in calibration_grid("h200")
                if case.model == "tiny" and case.mode == mode)
    result = measure_case(case)
    assert result["status"] == "measured", result
    assert result["measured_bytes"] > 0 and result["predicted_bytes"] > 0
    assert result["measurement"]["non_pytorch_bytes"] > 0  # the CUDA context
    assert abs(result["relative_error"]) < 0.25
    assert json.loads(json.dumps(result))["case"]["name"] == case.name
    if mode == "generate":
        assert result["measurement"]["generated_tokens"] == case.new_tokens


def test_accuracy_figure_draws_a_calibration_record(tmp_path):
    # A hand-made record with the fields run_calibration writes: this checks the figure, not the planner.
    import matplotlib
    matplotlib.use("Agg")
    from workbook import plots
    cases = [{"status": "measured", "case": {"name": f"case-{i}", "mode": mode},
              "measured_bytes": (i + 1) * 2**30, "predicted_bytes": int((i + 1) * 2**30 * 1.02),
              "relative_error": 0.02} for i, mode in enumerate(("generate", "train", "train"))]
    cases.append({"status": "skipped", "case": {"name": "lora", "mode": "train"}, "reason": "peft missing"})
    record = {"profile": "h200", "cases": cases, "hardware": {"gpus": [{"name": "NVIDIA H200"}]},
              "summary": {"median_abs_relative_error": 0.02, "max_abs_relative_error": 0.02}}
    figure = plots.memory_accuracy(record)
    assert "median |error| 2.00%" in figure._suptitle.get_text() and "3 measured cases" in figure._suptitle.get_text()
    figure.savefig(tmp_path / "memory_accuracy.png")
    assert (tmp_path / "memory_accuracy.png").stat().st_size > 10_000


def test_a_grid_cut_part_way_keeps_every_case_it_measured(tmp_path, monkeypatch):
    # A lent GPU's call is cut at its limit: the cases measured before it must be on disk.
    from workbook.planner import calibration
    cases, measured = calibration_grid("h100")[:3], []

    def cut_at_the_third(case, overhead_bytes=None):
        if len(measured) == 2:
            raise KeyboardInterrupt  # as a kill stops it
        measured.append(case.name)
        return {**record(case.name, "measured", 0.01), "predicted_bytes": 2 * GiB, "measured_bytes": GiB}
    monkeypatch.setattr(calibration.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibration, "measure_case", cut_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        calibration.run_calibration(tmp_path, "h100", cases, log=None)
    written = json.loads((tmp_path / calibration.RESULT_FILE).read_text())
    assert [case["case"]["name"] for case in written["cases"]] == measured and written["cases_planned"] == 3
    assert written["summary"]["measured"] == 2


# ---------------------------------------------------------------------------------------------
# The numbers a calibration record carries, the goal it claims, and measure_case's outcomes (its
# CUDA calls stood in for).


def test_compare_divides_by_the_measured_peak_and_signs_the_tensor_error_by_what_the_allocator_held():
    case = next(case for case in calibration_grid("h200") if case.model == "llama-3.1-8b")
    plan = plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=500 * MiB)
    tensors = plan.total_bytes - sum(term.bytes for term in plan.terms
                                     if term.name in ("cuda_context", "allocator_fragmentation"))
    peak = round(plan.total_bytes / 1.1)  # the planner 10% over the device's peak
    allocated = peak - 500 * MiB - 200 * MiB  # 500 MiB outside PyTorch, 200 MiB reserved but not allocated
    record = compare(plan, gpu_like_measurement(reserved=peak - 500 * MiB, allocated=allocated, non_pytorch=500 * MiB))
    assert record["relative_error"] == pytest.approx(0.1, rel=1e-6)  # of the measured peak, not of the plan
    assert record["tensor_relative_error"] == pytest.approx((tensors - allocated) / allocated)
    assert record["measured_fragmentation_bytes"] == 200 * MiB and record["measured_overhead_bytes"] == 500 * MiB


def test_one_case_far_off_fails_the_goal_even_when_the_median_meets_it():
    records = [record("a", "measured", 0.01), record("b", "measured", -0.01), record("c", "measured", 0.005),
               record("d", "measured", 0.10)]
    summary = summarize(records)
    assert summary["median_abs_relative_error"] <= calibration.GOAL_MEDIAN_ABS_RELATIVE_ERROR
    assert summary["max_abs_relative_error"] == pytest.approx(0.10) and not summary["meets_goal"]


def test_a_grid_cut_part_way_is_written_as_not_meeting_the_goal(tmp_path, monkeypatch):
    # Two of three cases measured, both well within the goal: the third was never checked.
    cases, measured = calibration_grid("h100")[:3], []

    def cut_at_the_third(case, overhead_bytes=None):
        if len(measured) == 2:
            raise KeyboardInterrupt
        measured.append(case.name)
        return {**record(case.name, "measured", 0.001), "predicted_bytes": GiB, "measured_bytes": GiB}
    monkeypatch.setattr(calibration.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibration, "measure_case", cut_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        calibration.run_calibration(tmp_path, "h100", cases, log=None)
    summary = json.loads((tmp_path / calibration.RESULT_FILE).read_text())["summary"]
    assert summary["measured"] == 2 and summary["max_abs_relative_error"] < 0.01 and not summary["meets_goal"]


def test_a_grid_with_no_case_is_refused_by_name_not_written_as_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration.torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="profile cpu: no calibration case to measure"):
        calibration.run_calibration(tmp_path, "cpu", [], log=None)
    assert not (tmp_path / calibration.RESULT_FILE).exists()


def test_only_measures_the_first_case_each_beginning_matches_in_the_order_given():
    # The smoke pass: the first (smallest) case of each kind named, not the last.
    chosen = calibration.chosen_cases(calibration_grid("h200"), ["llama-3.2-1b/train", " llama-3.2-1b/generate"])
    assert [case.name for case in chosen] == ["llama-3.2-1b/train/b4-s1024", "llama-3.2-1b/generate/b16-p512-n256"]


def a_gpu_here(monkeypatch, probe):
    """measure_case's CUDA calls stood in for (an H200's memory), ``probe`` run instead of the model."""
    monkeypatch.setattr(calibration.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibration.torch.cuda, "mem_get_info", lambda device: (0, H200_BYTES))
    monkeypatch.setattr(calibration, "clear_device_cache", lambda garbage_collection: None)
    monkeypatch.setattr(calibration, "run_case_probe", lambda case, device: probe())


def test_measure_case_plans_with_the_probes_constant_when_given_else_with_the_cases_own_context(monkeypatch):
    case = next(case for case in calibration_grid("h200") if case.name.startswith("llama-3.1-8b/generate"))
    planned = lambda overhead: plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=overhead).total_bytes
    a_gpu_here(monkeypatch, lambda: gpu_like_measurement(reserved=planned(0), allocated=planned(0) // 2,
                                                         non_pytorch=700 * MiB))
    assert measure_case(case, overhead_bytes=500 * MiB)["predicted_bytes"] == planned(500 * MiB)
    assert measure_case(case)["predicted_bytes"] == planned(700 * MiB)  # what this run measured outside PyTorch


def test_a_case_out_of_memory_is_recorded_with_its_plan_and_any_other_failure_with_its_reason(monkeypatch):
    case = next(case for case in calibration_grid("h200") if case.name.startswith("llama-3.1-8b/generate"))

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    a_gpu_here(monkeypatch, out_of_memory)
    oom = measure_case(case, overhead_bytes=500 * MiB)
    # The planner said it fits and the GPU disagreed: the plan it made, with the probe's constant.
    assert oom["status"] == "oom" and "out of memory" in oom["error"]
    assert oom["predicted_bytes"] == plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=500 * MiB).total_bytes

    def broken():
        raise ValueError("a shape mismatch")
    a_gpu_here(monkeypatch, broken)
    failed = measure_case(case)
    assert failed["status"] == "failed" and "a shape mismatch" in failed["reason"]


def test_a_case_is_kept_only_within_the_grid_fraction_of_a_budget_in_gib():
    # The 8B model's largest generate case plans 32.4 GiB. A 45 GiB GPU's budget (0.95 of it: 42.8 GiB)
    # holds it within 0.8; a 36 GiB one's (34.2 GiB) would hold it, but too close to measure it safely.
    name = "llama-3.1-8b/generate/b64-p1024-n512"
    assert name in {case.name for case in calibration_grid({"gpu_memory_gib": 45.0})}
    assert name not in {case.name for case in calibration_grid({"gpu_memory_gib": 36.0})}
