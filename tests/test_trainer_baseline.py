"""The HF Trainer beside the workbook's loop (``bench_train_baselines: hf-trainer``): it must train
on exactly the workbook's batches from the same weights with the same optimizer settings, or its
ratio compares two different jobs. The tiny model on CPU in fp32, a few seconds a run."""

import dataclasses
import importlib

import pytest
import torch

from workbook import bench, params as params_module

training_sweep = importlib.import_module("workbook.bench.training_sweep")  # the package exports a function so named

# Per-step losses of the two loops agree to 2.2e-6 (relative) on the tiny model: fp32 rounding of different
# kernels (the Trainer's fused AdamW against torch's default one on CPU, the model's own loss against the
# workbook's). 2e-5 leaves 9x room; a learning rate 10% off moves the 4th step's loss by 3%, weight decay 0.1
# (against 0) by 1.3e-4, another data order changes every step after the first.
LOSS_TOLERANCE = 2e-5


@pytest.fixture
def cpu_params(tiny_model_path):
    return bench.BenchSettings.from_params({**params_module.load_all()["cpu"], "bench_train_micro_batches": "8",
                                            "bench_train_steps": 4, "bench_train_settings": "",
                                            "bench_train_baselines": "hf-trainer"})


@pytest.mark.slow
def test_the_trainer_sees_the_workbooks_batches_reaches_its_loss_and_the_report_shows_the_ratio(cpu_params, tmp_path):
    plain = training_sweep.training_points(cpu_params, torch.device("cpu"))[0]
    workbook = training_sweep.training_point(cpu_params, plain, tmp_path, log=lambda line: None)
    trainer = training_sweep.baseline_point(cpu_params, workbook, tmp_path, log=lambda line: None)

    # The same batches, step by step: tokens and loss tokens as the Trainer's forward received them.
    assert trainer["step_tokens"] == workbook["step_tokens"] and len(set(workbook["step_tokens"])) > 1
    assert trainer["step_loss_tokens"] == workbook["step_loss_tokens"]
    # The same initial weights, data order, learning rate schedule, decay and clipping: the same losses.
    assert trainer["step_losses"] == pytest.approx(workbook["step_losses"], rel=LOSS_TOLERANCE)
    assert trainer["steps"] == workbook["steps"] == 4 and trainer["timed_steps"] == workbook["timed_steps"] == 2

    versus = trainer["versus"]
    assert versus["tokens_per_second_ratio"] == pytest.approx(workbook["tokens_per_second"] / trainer["tokens_per_second"])
    assert versus["peak_memory_ratio"] is None and "not measured" in versus["note"]  # CPU: no high-water mark
    assert trainer["mfu"] is None and trainer["mfu_note"] == workbook["mfu_note"]  # the same rule: n/a on CPU

    report = {"training": {"points": [workbook], "baselines": [trainer]}}
    workbook_row, trainer_row = bench.training_rows(report)
    assert workbook_row["loop"] == "workbook" and trainer_row["loop"].startswith("HF Trainer (transformers ")
    assert trainer_row["workbook / baseline"] == (f"tokens/s {versus['tokens_per_second_ratio']:.2f}x, "
                                                 "peak memory not measured")
    assert trainer_row["peak memory"] == bench.NOT_MEASURED
    note = bench.baseline_note(report)
    assert trainer["hardware"] in note and "on CPU: " in note and "fp32" in note and "Still different" in note
    assert f"workbook {workbook['final_loss']:.6g}, HF Trainer {trainer['final_loss']:.6g}" in note

    # The tolerance has teeth: the same Trainer run with a learning rate 10% off fails it.
    from workbook.bench import trainer_baseline
    config = training_sweep.point_config(cpu_params, plain, tmp_path / "control")
    control = trainer_baseline.trainer_run(dataclasses.replace(config, learning_rate=1.1 * config.learning_rate),
                                           str(tmp_path / "control"))
    assert control["step_tokens"] == workbook["step_tokens"]
    assert control["step_losses"] != pytest.approx(workbook["step_losses"], rel=LOSS_TOLERANCE)


def test_each_micro_batch_plain_point_gets_one_trainer_point_and_none_turns_it_off(cpu_params, tmp_path, monkeypatch):
    monkeypatch.setattr(training_sweep, "training_point",
                        lambda params, point, work_dir, log: {**point, "tokens_per_second": 1.0})
    monkeypatch.setattr(training_sweep, "baseline_point",
                        lambda params, point, work_dir, log, tool: {**point, "loop": tool})
    params = cpu_params.replace(bench_train_micro_batches="2,4", bench_train_settings="loss_chunk_tokens")
    sweep = training_sweep.training_sweep(params, tmp_path, log=lambda line: None)
    assert len(sweep["points"]) == 10  # 5 per micro-batch: plain, checkpointing, grouped, chunked loss, compile
    assert [(p["micro_batch_size"], p["grad_checkpointing"], p["torch_compile"], p["padding"], "loss_chunk_tokens" in p)
            for p in sweep["baselines"]] == [(2, False, False, "packing", False), (4, False, False, "packing", False)]
    both = training_sweep.training_sweep(params.replace(bench_train_baselines="trl-sft, hf-trainer"), tmp_path,
                                         log=lambda line: None)["baselines"]
    assert [(p["loop"], p["micro_batch_size"]) for p in both] == [("trl-sft", 2), ("hf-trainer", 2), ("trl-sft", 4),
                                                                  ("hf-trainer", 4)]
    # Each plain point's baselines right after it (the comparison users ask first survives a time budget), the
    # compiled points last: each compiles for a minute or more on a GPU, so a stopped sweep loses them first.
    order = []
    training_sweep.training_sweep(params, tmp_path, log=lambda line: None, on_point=lambda point: order.append(
        "baseline" if "loop" in point else "compiled" if point["torch_compile"] else "point"))
    assert order == (["point", "baseline"] + ["point"] * 3) * 2 + ["compiled"] * 2
    # One process trains every point: flex attention's recompiles must not run out at dynamo's default of 8.
    assert torch._dynamo.config.recompile_limit >= training_sweep.SWEEP_RECOMPILE_LIMIT
    assert training_sweep.training_sweep(params.replace(bench_train_baselines="none"), tmp_path,
                                         log=lambda line: None)["baselines"] == []


def test_settings_the_trainer_baseline_does_not_mirror_are_refused_by_name(cpu_params, tmp_path):
    from workbook.bench import trainer_baseline
    from workbook.training import TrainError
    plain = training_sweep.training_points(cpu_params, torch.device("cpu"))[0]
    config = training_sweep.point_config(cpu_params, plain, tmp_path)
    with pytest.raises(TrainError, match="gradient accumulation, learning-rate warm-up"):
        trainer_baseline.trainer_run(dataclasses.replace(config, gradient_accumulation_steps=2, warmup_steps=1),
                                     str(tmp_path))


@pytest.mark.slow
def test_a_point_that_runs_out_of_memory_is_recorded_beside_the_plan_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # The GPU session probes micro-batches past the plain point's limit (the memory settings are meant to make
    # them fit): one out-of-memory point must not take the sweep's other points with it.
    from workbook import training
    from workbook.bench import report
    params = bench.BenchSettings.from_params({
        **params_module.load_all()["h100"], "bench_train_model": "Llama-3.2-1B", "bench_train_steps": 4,
        "bench_train_micro_batches": "16", "bench_train_settings": "", "bench_train_baselines": "hf-trainer"})

    def out_of_memory(config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.66 GiB")
    monkeypatch.setattr(training, "train", out_of_memory)
    plain = training_sweep.training_points(params, torch.device("cpu"))[0]
    record = training_sweep.training_point(params, plain, tmp_path, log=lambda line: None)
    config = training_sweep.point_config(params, plain, tmp_path)
    planned = training.memory_plan(config, 16, params.seq_len)
    assert not planned.fits  # the 1B at 16 x 2048 tokens does not fit an H100 without a memory setting
    assert record["out_of_memory"].startswith("OutOfMemoryError: CUDA out of memory")
    assert record["predicted_peak_bytes"] == planned.total_bytes and record["planner_said"] == "does not fit"
    row = report.training_rows({"training": {"points": [record], "baselines": []}})[0]
    assert row["tokens/s"] == "out of memory; the planner said it does not fit"

    # The sweep goes on past it, and no Trainer baseline is run against a point that measured nothing.
    monkeypatch.setattr(training_sweep, "baseline_point", lambda *args, **kwargs: pytest.fail("no baseline"))
    sweep = training_sweep.training_sweep(params.replace(bench_train_micro_batches="16"), tmp_path,
                                          log=lambda line: None)
    assert all("out_of_memory" in p or p.get("skipped") for p in sweep["points"]) and sweep["baselines"] == []

    def broken(config):  # anything but out-of-memory is a bug: raised (the sweep's budget records the point failed)
        raise ValueError("a bug")
    monkeypatch.setattr(training, "train", broken)
    with pytest.raises(ValueError, match="a bug"):
        training_sweep.training_point(params, plain, tmp_path, log=lambda line: None)
