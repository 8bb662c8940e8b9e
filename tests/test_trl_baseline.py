"""TRL's SFTTrainer beside the workbook's loop (``bench_train_baselines: trl-sft``): it packs and batches
its own way, so its ratio is only fair if it trains on exactly the workbook's examples and scores exactly
their response tokens. The tiny model on CPU in fp32, a few seconds a run."""

import importlib
import importlib.util
import math

import pytest
import torch

from workbook import bench, params as params_module
from workbook.params import ParamsError

training_sweep = importlib.import_module("workbook.bench.training_sweep")  # the package exports a function so named


@pytest.fixture
def cpu_params(tiny_model_path):
    return bench.BenchSettings.from_params({**params_module.load_all()["cpu"], "bench_train_micro_batches": "8",
                                            "bench_train_steps": 3, "bench_train_settings": "",
                                            "bench_train_baselines": "trl-sft"})


@pytest.mark.slow
def test_trl_trains_one_epoch_on_exactly_the_workbooks_examples_and_their_response_tokens(cpu_params, tmp_path):
    from workbook.bench import trl_baseline
    from workbook.training.prepare import prepare_data
    from workbook import models

    plain = training_sweep.training_points(cpu_params, torch.device("cpu"))[0]
    workbook = training_sweep.training_point(cpu_params, plain, tmp_path, log=lambda line: None)
    first = training_sweep.baseline_point(cpu_params, workbook, tmp_path, log=lambda line: None, tool="trl-sft")
    assert first["loop"].startswith("TRL SFTTrainer (trl ") and first["steps"] == 3 and first["timed_steps"] == 1
    # Nothing dropped or cut by TRL's packing: its rows hold every token of the workbook's examples.
    assert first["epoch_tokens"] == first["examples_tokens"] > 0
    # A step never holds more than its micro-batch of rows, each at most max_seq_length tokens.
    config = training_sweep.point_config(cpu_params, plain, tmp_path / "epoch")
    prepared = prepare_data(config, models.load_tokenizer(config.model), log=lambda line: None)
    assert max(first["step_tokens"]) <= 8 * prepared.max_seq_length

    # One whole epoch: every row once, so TRL sees every example's tokens and scores exactly their response
    # tokens (it would score every token without completion_only_loss: the workbook's examples carry no
    # prompt/completion columns for TRL to infer it from).
    epoch = trl_baseline.sft_run(config.__class__(**{**config.__dict__, "max_steps": math.ceil(first["epoch_rows"] / 8)}),
                                 str(tmp_path / "epoch"))
    assert sum(epoch["step_tokens"]) == sum(example.length for example in prepared.train)
    assert sum(epoch["step_loss_tokens"]) == sum(example.response_tokens for example in prepared.train)
    assert all(math.isfinite(loss) for loss in epoch["step_losses"])

    versus = first["versus"]
    assert versus["tokens_per_second_ratio"] == pytest.approx(workbook["tokens_per_second"] / first["tokens_per_second"])
    report = {"training": {"points": [workbook], "baselines": [first]}}
    row = bench.training_rows(report)[1]
    assert row["workbook / baseline"] == f"tokens/s {versus['tokens_per_second_ratio']:.2f}x, peak memory not measured"
    note = bench.baseline_note(report)
    assert "workbook / TRL SFTTrainer = tokens/s" in note and "each packing and batching them its own way" in note
    assert f"TRL SFTTrainer {first['final_loss']:.6g}" in note and "Still different: batches:" in note


def test_without_trl_installed_the_row_says_so_and_the_sweep_goes_on(cpu_params, tmp_path, monkeypatch):
    # A GPU image without pip may lack trl: the sweep's other points must not be lost to it.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "trl" else real_find_spec(name, *args))
    workbook = {"micro_batch_size": 8, **training_sweep.PLAIN, "tokens_per_second": 100.0}
    record = training_sweep.baseline_point(cpu_params, workbook, tmp_path, log=lambda line: None, tool="trl-sft")
    assert "trl not installed here" in record["skipped"] and "carry the wheels" in record["skipped"]
    report = {"training": {"points": [], "baselines": [record]}}
    assert bench.training_rows(report)[0]["tokens/s"] == record["skipped"]
    assert bench.baseline_note(report) == ""


def test_the_baselines_key_takes_a_list_of_known_tools_and_names_a_wrong_one():
    assert params_module.validate_value("bench_train_baselines", "trl-sft,hf-trainer", "--set") == "trl-sft,hf-trainer"
    assert params_module.choice_list({"bench_train_baselines": "trl-sft, hf-trainer"}, "bench_train_baselines") == [
        "trl-sft", "hf-trainer"]
    for wrong in ("trl", "hf-trainer,trl", ","):
        with pytest.raises(ParamsError, match="'bench_train_baselines' is .*each one of 'none', 'hf-trainer', 'trl-sft'"):
            params_module.validate_value("bench_train_baselines", wrong, "--set")


def test_a_baseline_that_fails_is_recorded_with_its_error_and_the_sweep_goes_on(cpu_params, tmp_path, monkeypatch):
    # TRL and the Trainer are other projects' code on a GPU image nobody tested them on: their failure is a
    # finding, not the end of the sweep that measured the workbook's points before them.
    from workbook.bench import trl_baseline

    def broken(config, work_dir):
        raise RuntimeError("flex attention got an unexpected keyword argument 'cu_seq_lens_q'")
    monkeypatch.setattr(trl_baseline, "sft_run", broken)
    monkeypatch.setattr(training_sweep, "training_point",
                        lambda params, point, work_dir, log: {**point, "tokens_per_second": 1.0})
    sweep = training_sweep.training_sweep(cpu_params, tmp_path, log=lambda line: None)
    assert len(sweep["points"]) == 4 and len(sweep["baselines"]) == 1
    assert sweep["baselines"][0]["skipped"] == ("not measured: it failed with RuntimeError: flex attention got an "
                                                "unexpected keyword argument 'cu_seq_lens_q'")


def test_trl_trains_a_preset_without_its_tokenizer_or_the_hub(tmp_path, monkeypatch):
    """A GPU session's 1B preset has random weights and no tokenizer: SFTTrainer gets a stand-in for its
    pad and end-of-sequence tokens instead of fetching the model's from the Hub (no network there)."""
    from workbook import presets
    from workbook.bench import trl_baseline
    small = {**presets.PRESETS["Llama-3.2-1B"], "_name_or_path": "meta-llama/Small-Llama", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 512}
    monkeypatch.setitem(presets.PRESETS, "Small-Llama", small)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub lookup fails at once instead of passing unnoticed here
    params = bench.BenchSettings.from_params({
        **params_module.load_all()["cpu"], "bench_train_model": "Small-Llama", "seq_len": 64,
        "bench_train_micro_batches": "2", "bench_train_steps": 3, "bench_train_settings": ""})
    plain = training_sweep.training_points(params, torch.device("cpu"))[0]
    measured = trl_baseline.sft_run(training_sweep.point_config(params, plain, tmp_path), str(tmp_path / "trl"))
    assert measured["steps"] == 3 and all(math.isfinite(loss) for loss in measured["step_losses"])
    assert sum(measured["step_tokens"]) == 3 * 2 * 64  # full synthetic rows of 64 tokens
