"""The continuous-batching benchmark's CPU path, at a tiny size: the same drawn lengths in every arm, the
figures the GPU run is for (tokens/s, peak memory, roofline fraction), and its time budget."""

import json

import pytest

from workbook.bench import continuous_batching

TINY_RUN = ["--examples", "6", "--max-new-tokens", "4", "--threads", "1", "--bandwidth-gbs", "10", "--peak-tflops", "1"]


@pytest.mark.slow
def test_every_arm_generates_the_drawn_lengths_and_the_report_has_the_gpu_figures(tmp_path, tiny_model_path):
    assert continuous_batching.main([*TINY_RUN, "--repeats", "1", "--memory-gib", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    lengths = {"full": [4] * 6, "uneven": continuous_batching.drawn_lengths(6, 4)}
    assert [result["workload"] for result in report["results"]] == ["full", "uneven"] and report["stopped"] is None
    for result in report["results"]:
        # A fair comparison: every arm generates exactly the drawn lengths, nothing fails.
        assert set(result["output_tokens"].values()) == {sum(lengths[result["workload"]])}
        assert set(result["failed"].values()) == {0}
        assert all(1 <= size <= 6 for size in result["batch_size"].values())  # planned in 2 GiB, one per prompt
        for arm in continuous_batching.ARMS:
            assert result["output_tokens_per_second"][arm] > 0 and result["peak_memory_bytes"][arm] >= 0
            roofline = result["roofline_seconds"][arm]
            assert result["roofline_fraction"][arm] > 0 and roofline["prefill"] > 0
            assert roofline["total"] == pytest.approx(roofline["prefill"] + roofline["decode"], rel=0.01)
        # The manager's start (once per job) is timed apart, so a short benchmark can be read without it.
        starts = result["manager_start_seconds"]
        assert starts["static-sorted"] is None and starts["continuous"] > 0
        # Direct: timed where it starts its own manager (uneven); one generate_batch call hides it (full).
        assert (starts["direct"] is None) == (result["workload"] == "full")
        assert result["continuous_vs_static_after_start"] >= result["continuous_vs_static"]
        # The static arm's end-at-length processor belongs to the workload: its cost is measured apart.
        assert 0 < result["static_end_processor_seconds"] < result["median_seconds"]["static-sorted"]
        assert result["continuous_vs_static_without_processor"] <= result["continuous_vs_static"]
    text = (tmp_path / "continuous_batching.md").read_text()
    assert "Hardware: " in text and "load average" in text and "--memory-gib 2" in text
    assert "Beside vLLM's published figures" in text  # issue 19: the fraction set beside vLLM's, not by hand
    # Which attention transformers' manager ran (sdpa here: no flash attention on CPU), and what that costs.
    assert {result["continuous_attention"] for result in report["results"]} == {"sdpa"}
    assert "continuous ran attention sdpa (one dense mask over every request in flight" in text


def test_the_time_budget_stops_the_run_and_keeps_what_it_measured(tmp_path, tiny_model_path):
    # One second: the deadline passes while the model loads or the first arm runs (the run takes several).
    code = continuous_batching.main([*TINY_RUN, "--repeats", "3", "--time-budget-seconds", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    assert code == 3 and "time budget of 1 s ran out" in report["stopped"]
    assert "Stopped early" in (tmp_path / "continuous_batching.md").read_text()


@pytest.mark.slow
def test_a_budget_that_ends_inside_an_arm_keeps_the_arms_it_finished(tmp_path, tiny_model_path, monkeypatch):
    """The GPU session's uneven workload alone: the budget ends as the third arm (direct) starts. The
    static and continuous arms it finished are the result, their ratio with them; direct says n/a."""

    class EndsAtTheThirdArm(continuous_batching.TimeBudget):
        arms_started = 0

        def check(self):
            EndsAtTheThirdArm.arms_started += 1
            if EndsAtTheThirdArm.arms_started == 3:
                self.expired = True
            super().check()

    monkeypatch.setattr(continuous_batching, "TimeBudget", EndsAtTheThirdArm)
    code = continuous_batching.main([*TINY_RUN, "--repeats", "2", "--workloads", "uneven", "--time-budget-seconds",
                                     "600", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    [result] = report["results"]
    assert code == 3 and result["stopped_by_budget"] and result["arms"] == ["static-sorted", "continuous"]
    assert result["continuous_vs_static"] > 0 and result["continuous_vs_direct"] is None
    assert set(result["output_tokens"]) == {"static-sorted", "continuous"} and result["repeats_done"] == 1
    assert "the arms of 'uneven' that finished (static-sorted, continuous)" in report["stopped"]
    text = (tmp_path / "continuous_batching.md").read_text()
    assert "| uneven | continuous |" in text and "| uneven | direct |" not in text
    assert "n/a (an arm not measured: the time budget ran out) direct" in text
