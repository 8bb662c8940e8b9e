"""The GPU session's summary: every goal row read from the files the calls wrote (here the committed CPU
reference, plus the GPU-only files made up in the shape their writers give)."""

import json
import shutil

from workbook.bench import claims, gpu_summary
from workbook.paths import OUTPUTS_DIR
from workbook.units import GiB


def test_the_summary_reads_each_goal_from_its_file_and_says_which(tmp_path):
    folder = tmp_path / "h100"
    shutil.copytree(OUTPUTS_DIR / "reference" / "cpu", folder)
    (folder / "calibration").mkdir()
    (folder / "calibration" / "memory_accuracy.json").write_text(json.dumps({
        "summary": {"median_abs_relative_error": 0.012, "max_abs_relative_error": 0.051, "counted_toward_goal": 16,
                    "out_of_memory": [], "meets_goal": False},
        "cuda_context_term": "0.620 GiB, the overhead probe's constant"}))
    (folder / "cuda_overhead.json").write_text(json.dumps({"overhead_bytes": int(0.62 * GiB),
                                                           "hardware_name": "NVIDIA H100 80GB HBM3"}))
    assert gpu_summary.main([str(folder)]) == 0
    table = {row["goal"]: row for row in gpu_summary.rows(gpu_summary.found(folder))}
    accuracy = table["planner: median |error| <= 1.5%, max <= 4%, no case the planner says fits runs out of memory"]
    assert accuracy["measured"].startswith("median 1.20%, max 5.10% over 16 cases") and accuracy["met"] == "no"
    assert accuracy["source"] == "calibration/memory_accuracy.json"
    assert table["CUDA context constant measured by its own probe"]["measured"].startswith("0.62 GiB")
    # The forecast rows are the file's own median errors, judged against 10%.
    forecast = json.loads((folder / "forecast.json").read_text())
    for case in forecast["cases"]:
        row = table[f"forecast from a pilot within 10% of the measured wall time: {case['case']}"]
        assert row["measured"].startswith(f"{case['wall']['median_error']:+.1%}")
        assert row["met"] == ("yes" if abs(case["wall"]["median_error"]) <= 0.10 else "no")
    # Too slow or too fast by 30% misses the goal alike; 5% either way meets it.
    made_up = {"cases": [{"case": name, "wall": {"median_error": error, "errors": [error]}}
                         for name, error in (("slow", 0.3), ("fast", -0.3), ("close", -0.05))]}
    judged = {row["goal"].rsplit(": ", 1)[1]: row["met"] for row in gpu_summary.rows({
        **gpu_summary.found(folder), "forecast.json": [("forecast.json", made_up)]}) if row["goal"].startswith("forecast")}
    assert judged == {"slow": "no", "fast": "no", "close": "yes"}
    uneven = table["continuous >= 1.5x static-sorted at the same memory (uneven outputs)"]
    ratio = next(r["continuous_vs_static"] for r in json.loads((folder / "continuous_batching.json").read_text())["results"]
                 if r["workload"] == "uneven")
    assert uneven["measured"].startswith(f"{ratio}x") and uneven["met"] == ("yes" if ratio >= 1.5 else "no")
    # Every goal of the benchmark has a row: the benchmark's own words, or, where no file has the goal, said so.
    measured = {row["goal"]: row["measured"] for row in json.loads((folder / "benchmark.json").read_text())["goals"]}
    assert {goal: table[goal]["measured"] for goal in claims.GOALS} == {
        goal: measured.get(goal, "not measured in this session") for goal in claims.GOALS}
    (folder / "benchmark.json").unlink()
    without = {row["goal"]: row for row in gpu_summary.rows(gpu_summary.found(folder))}
    assert all(without[goal]["measured"] == "not measured in this session" for goal in claims.GOALS)
    assert "Beside vLLM's published figures" in (folder / gpu_summary.SUMMARY_FILE).read_text()


def test_a_goal_two_benchmarks_measured_has_a_row_from_each(tmp_path):
    for run, mfu in (("20261201-000000-bench-h100", "41.0% (best training point)"),
                     ("20261201-000100-bench-h100", "52.0% (best training point)")):
        (tmp_path / run).mkdir()
        goals = [{"goal": claims.GOALS[2], "measured": mfu, "met": "yes" if mfu.startswith("52") else "no: 91% of the goal"}]
        (tmp_path / run / "benchmark.json").write_text(json.dumps({"goals": goals, "claims": []}))
    rows = [row for row in gpu_summary.rows(gpu_summary.found(tmp_path)) if row["goal"] == claims.GOALS[2]]
    assert [(row["measured"][:5], row["met"][:2], row["source"]) for row in rows] == [
        ("41.0%", "no", "20261201-000000-bench-h100/benchmark.json"),
        ("52.0%", "ye", "20261201-000100-bench-h100/benchmark.json")]
    # A point that failed on the GPU is listed, with its error, as something to fix.
    failed = {"strategy": "static-compiled", "batch_size": 32, "skipped": "failed: RuntimeError: no kernel",
              "error": "RuntimeError: no kernel"}
    (tmp_path / "20261201-000100-bench-h100" / "benchmark.json").write_text(json.dumps(
        {"goals": [], "claims": [], "generation": {"points": [failed]}}))
    row = next(row for row in gpu_summary.rows(gpu_summary.found(tmp_path)) if row["goal"] == "every benchmark point runs")
    assert row["measured"] == "1 failed: generation static-compiled batch 32: RuntimeError: no kernel" and row["met"] == "no"


def test_a_folder_without_results_is_an_error(tmp_path, capsys):
    assert gpu_summary.main([str(tmp_path)]) == 2
    assert "holds none of" in capsys.readouterr().out


def test_each_planner_case_sits_beside_its_trace_made_here_once(tmp_path, monkeypatch):
    """The GPU measures the cases; the trace of each (hardware-independent) is made on this CPU after the
    files came back, shown beside plan and measurement, and kept so that a rewrite traces nothing again."""
    from workbook.planner import calibration
    cases = [calibration.CalibrationCase("tiny/generate/b4-p16-n8", "tiny", "generate", 4, prompt_len=16, new_tokens=8),
             calibration.CalibrationCase("tiny/train/b2-s64", "tiny", "train", 2, seq_len=64)]
    records = [{"case": case.to_dict(), "status": "measured", "predicted_bytes": int(1.10 * GiB),
                "measured_bytes": int(1.00 * GiB), "relative_error": 0.10, "predicted_tensor_bytes": 2_000_000,
                "measured_allocated_bytes": 2_500_000, "tensor_relative_error": -0.2,
                "measurement": {"peak_reserved_bytes": 4_194_304}} for case in cases]
    (tmp_path / "memory_accuracy.json").write_text(json.dumps({
        "summary": {"median_abs_relative_error": 0.10, "max_abs_relative_error": 0.10, "counted_toward_goal": 0,
                    "out_of_memory": [], "meets_goal": False}, "cases": records, "cases_planned": 2}))
    assert gpu_summary.main([str(tmp_path)]) == 0
    kept = json.loads((tmp_path / gpu_summary.TRACE_FILE).read_text())
    generate = kept["tiny/generate/b4-p16-n8"]["trace"]
    assert generate["mode"] == "generate" and generate["settings"]["batch_size"] == 4
    assert kept["tiny/train/b2-s64"]["trace"]["settings"]["padding"] == "length_grouped"  # unpacked rows, as measured
    text = (tmp_path / gpu_summary.SUMMARY_FILE).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| tiny/generate/b4-p16-n8 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:4] == ["measured", "1.10", "0.00"]  # plan, its tensors (GiB)
    assert cells[4] == f"{generate['peak_bytes'] / GiB:.2f} in {generate['phase']}"
    assert cells[5:8] == ["0.00", "0.00", "1.00"]  # allocated, reserved, device peak
    assert cells[8:] == ["+10.0%", "-20.0%", f"{(generate['peak_bytes'] - 2_500_000) / 2_500_000:+.1%}"]

    def no_second_trace(case):
        raise AssertionError(f"traced {case['name']} again")
    monkeypatch.setattr(gpu_summary, "case_trace", no_second_trace)
    assert gpu_summary.main([str(tmp_path)]) == 0
    assert (tmp_path / gpu_summary.SUMMARY_FILE).read_text() == text


def test_the_summary_lists_each_call_step_that_was_cut_or_skipped(tmp_path):
    (tmp_path / "ceilings.json").write_text(json.dumps({
        "measured": {"copy_gb_per_second": 2900.0, "matmul_tflops": 700.0},
        "datasheet": {"copy_share_of_datasheet": 0.87, "matmul_share_of_datasheet": 0.71}}))
    (tmp_path / "first-light.json").write_text(json.dumps({"call": "first-light", "steps": [
        {"step": "ceilings", "status": "ok", "seconds": 14.2},
        {"step": "planner against the measured peak, 6 cases", "status": "stopped: the budget ran out after 100 s",
         "seconds": 100.0},
        {"step": "forecast against the run", "status": "skipped: 40 s left of the budget, it needs 150 s", "seconds": 0}]}))
    assert gpu_summary.main([str(tmp_path), "--no-trace"]) == 0
    text = (tmp_path / gpu_summary.SUMMARY_FILE).read_text()
    assert "| first-light | planner against the measured peak, 6 cases | stopped: the budget ran out after 100 s | 100 |" in text
    assert "| first-light | forecast against the run | skipped: 40 s left of the budget, it needs 150 s | 0 |" in text
