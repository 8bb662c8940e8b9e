"""The benchmark's counting (bytes, FLOPs, rooflines, cost), its NVML sampler without NVML, the seed
claims table, and notebook 05's loading of run folders, broken ones included. Fast: no model runs."""

import dataclasses
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

from workbook import bench
from workbook.bench import review
from workbook.training import run_plan

# A Llama small enough to count by hand: hidden 64, 2 layers, 4 heads of 16, 2 key/value heads,
# MLP 128, vocabulary 100, embeddings untied.
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, tie_word_embeddings=False)
# Per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128 each, down 128x64, two norms of 64.
LAYER_MATMUL = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # 32,768
MATMUL = 2 * LAYER_MATMUL + 100 * 64  # + lm_head = 71,936
PARAMETERS = MATMUL + 2 * 2 * 64 + 64 + 100 * 64  # + norms, final norm, input embedding = 78,656
KV_PER_TOKEN_BF16 = 2 * 2 * 2 * 16 * 2  # key and value x layers x kv heads x head_dim x 2 bytes = 256


def test_decode_step_bytes_and_flops_match_a_hand_count():
    cost = bench.decode_step_cost(CONFIG, "bf16", batch_size=4, context_tokens=10)
    # Weights read once per step, the untied input embedding excepted (only 4 rows are gathered).
    assert cost.weights_bytes == (PARAMETERS - 100 * 64) * 2
    assert cost.kv_cache_bytes == 4 * 10 * KV_PER_TOKEN_BF16
    assert cost.bytes_read == cost.weights_bytes + cost.kv_cache_bytes
    # 2 FLOPs per matmul weight per token, plus 4 x layers x heads x head_dim x context for attention.
    assert cost.flops == 4 * (2 * MATMUL + 4 * 2 * 64 * 10)


def test_a_pass_is_counted_prompt_by_prompt_and_step_by_step():
    # Prompts of 3, 5 and 4 tokens, batches of 2 rows, 3 new tokens: prefill gives the first, then 2
    # decode steps a batch, the step after k new tokens attending prompt + k positions.
    whole = bench.pass_cost(CONFIG, "bf16", [3, 5, 4], batch_size=2, new_tokens=3)
    step = bench.decode_step_cost(CONFIG, "bf16", batch_size=1, context_tokens=1)
    attention = 4 * 2 * 64  # per token per position attended: 4 x layers x heads x head_dim
    assert whole.prefill_flops == 2 * MATMUL * 12 + attention * (9 + 25 + 16) // 2
    assert whole.prefill_bytes == 2 * step.weights_bytes  # two batches
    attended = sum(length + k for length in (3, 5, 4) for k in (1, 2))
    assert whole.decode_steps == 4
    assert whole.decode_bytes == 4 * step.weights_bytes + KV_PER_TOKEN_BF16 * attended
    assert whole.decode_flops == 2 * MATMUL * 3 * 2 + attention * attended
    # A batch size above the prompts forms one batch of them all, as the pass does.
    assert bench.pass_cost(CONFIG, "bf16", [3, 5, 4], batch_size=32, new_tokens=3).decode_steps == 2
    # Outputs that ended at end of sequence (3, 1 and 4 tokens): each row counts its own steps; static batches
    # of 2 put the longest together (4 and 3 tokens: 3 steps; then 1 token: none), refilled slots pack them.
    uneven = bench.pass_cost(CONFIG, "bf16", [3, 5, 4], batch_size=2, new_tokens=[3, 1, 4])
    attended = (3 + 1) + (3 + 2) + (4 + 1) + (4 + 2) + (4 + 3)
    assert uneven.decode_steps == 3 and uneven.prefill_flops == whole.prefill_flops
    assert uneven.decode_bytes == 3 * step.weights_bytes + KV_PER_TOKEN_BF16 * attended
    assert uneven.decode_flops == 2 * MATMUL * 5 + attention * attended
    assert bench.pass_cost(CONFIG, "bf16", [3, 5, 4], 2, [3, 1, 4], refill=True).decode_steps == 3  # its longest row
    assert bench.pass_cost(CONFIG, "bf16", [3, 5, 4], 2, [3, 3, 4], refill=True).decode_steps == 4  # ceil(7 / 2)
    assert bench.pass_cost(CONFIG, "bf16", [3, 5, 4], 2, [3, 3, 4]).decode_steps == 5  # batches: 4+3 then 3


def test_a_pass_beside_its_roofline_counts_prefill_at_the_compute_peak_and_decode_at_the_bandwidth():
    cost = bench.PassCost(prefill_flops=10**12, prefill_bytes=10**9, decode_flops=10**12, decode_bytes=10**11,
                          decode_steps=100)
    # 100 TFLOP/s: prefill 10 ms (its 1 GB at 1000 GB/s takes 1 ms); decode: 100 GB at 1000 GB/s, 100 ms.
    figures = bench.pass_figures(cost, output_tokens=1000, seconds=0.22, bandwidth_gbs=1000.0, peak_tflops_value=100.0)
    roof = figures["roofline"]["seconds"]
    assert roof["prefill"] == pytest.approx(0.01) and roof["decode"] == pytest.approx(0.1)
    assert figures["roofline"]["tokens_per_second"] == pytest.approx(1000 / 0.11)
    assert figures["fraction_of_roofline"]["datasheet"] == pytest.approx(0.5)
    assert figures["fraction_of_peak"]["bandwidth"] == pytest.approx(101e9 / 0.22 / 1e12)
    assert figures["fraction_of_peak"]["compute"] == pytest.approx(2e12 / 0.22 / 1e14)
    # Beside the datasheet: this GPU's measured copy bandwidth (800 of 1000 GB/s) and matmul (80 TFLOP/s).
    measured = bench.pass_figures(cost, 1000, 0.22, 1000.0, 100.0, {"copy_gb_per_second": 800.0, "matmul_tflops": 80.0})
    assert measured["fraction_of_roofline"]["measured_ceilings"] == pytest.approx((0.0125 + 0.125) / 0.22)
    # The cpu profile has no peaks: n/a, never a number.
    none = bench.pass_figures(cost, 1000, 0.22, 0.0, 0.0)
    assert none["roofline"]["seconds"] is None and none["fraction_of_roofline"]["datasheet"] is None
    assert none["fraction_of_peak"] == {"bandwidth": None, "compute": None}


def test_the_roofline_takes_each_phase_at_its_binding_peak_even_against_the_usual_one():
    # A prefill of one short prompt is bound by reading the weights, not by compute; a decode of huge
    # batches by compute, not the bandwidth: the least time is whichever peak takes longer, phase by phase.
    cost = bench.PassCost(prefill_flops=10**12, prefill_bytes=10**11, decode_flops=10**14, decode_bytes=10**11,
                          decode_steps=100)
    roof = cost.roofline_seconds(bandwidth_gbs=1000.0, peak_tflops_value=100.0)
    assert roof["prefill"] == pytest.approx(0.1)  # 100 GB at 1000 GB/s, not 1 TFLOP at 100 TFLOP/s (0.01 s)
    assert roof["decode"] == pytest.approx(1.0)  # 100 TFLOP at 100 TFLOP/s, not 100 GB at 1000 GB/s (0.1 s)
    assert roof["total"] == pytest.approx(1.1)


def test_cost_per_examples_and_tokens_and_none_without_a_price():
    figures = bench.cost_figures(seconds=3600, examples=2000, output_tokens=4_000_000, usd_per_gpu_hour=3.5)
    assert figures["usd_per_1000_examples"] == pytest.approx(1.75)
    assert figures["usd_per_million_tokens"] == pytest.approx(0.875)
    free = bench.cost_figures(seconds=10, examples=10, output_tokens=100, usd_per_gpu_hour=0.0)
    assert free["usd_per_1000_examples"] is None and free["note"].startswith("n/a")


def test_the_cost_counts_every_gpu_and_has_no_figure_where_nothing_was_counted():
    # Half an hour of 8 GPUs at $2/GPU-hour: $8, for 4,000 examples and 2 million tokens.
    figures = bench.cost_figures(seconds=1800, examples=4000, output_tokens=2_000_000, usd_per_gpu_hour=2.0, gpus=8)
    assert figures["usd_per_1000_examples"] == pytest.approx(2.0)
    assert figures["usd_per_million_tokens"] == pytest.approx(4.0)
    assert figures["note"] == "8 GPU(s) x $2/GPU-hour"
    # No example finished: a price per example is not $0, it does not exist.
    nothing = bench.cost_figures(seconds=60, examples=0, output_tokens=0, usd_per_gpu_hour=2.0)
    assert nothing["usd_per_1000_examples"] is None and nothing["usd_per_million_tokens"] is None


def test_lists_in_params_are_parsed_with_errors_that_name_the_key():
    assert bench.parse_int_list("1, 8,32", "bench_batch_sizes") == [1, 8, 32]
    with pytest.raises(bench.BenchError, match="bench_batch_sizes"):
        bench.parse_int_list("8,x", "bench_batch_sizes")
    with pytest.raises(bench.BenchError, match="static-sorted"):
        bench.parse_strategies("static,continuous")


def test_a_batch_of_zero_an_empty_list_or_no_strategy_is_refused_and_cpu_runs_in_fp32():
    import torch
    for text in ("0,8", "", ","):  # a batch of nothing cannot be timed; an empty list would run no point
        with pytest.raises(bench.BenchError, match="bench_batch_sizes"):
            bench.parse_int_list(text, "bench_batch_sizes")
    with pytest.raises(bench.BenchError, match="bench_strategies"):
        bench.parse_strategies(" , ")
    # bf16 matmuls are emulated on a CPU: the profile's dtype applies on a GPU only.
    assert bench.run_dtype("bf16", torch.device("cpu")) == "fp32"
    assert bench.run_dtype("bf16", torch.device("cuda")) == "bf16"


def test_static_compiled_and_training_compile_are_skipped_with_a_reason_on_cpu():
    import torch
    settings = bench.BenchSettings(bench_batch_sizes="8,32", bench_strategies=",".join(bench.STRATEGIES),
                                   bench_train_micro_batches="4")
    points = bench.sweep_points(settings, torch.device("cpu"))
    assert [(p["strategy"], p["batch_size"]) for p in points][:2] == [("seed-before", 1), ("seed-after", 32)]
    compiled = [p for p in points if p["strategy"] == "static-compiled"]
    assert len(compiled) == 2 and all("skipped on CPU" in p["skipped"] for p in compiled)
    training = bench.training_points(settings, torch.device("cpu"))
    # The compile point comes last (a minute or more of compiling on a GPU), skipped on CPU.
    assert [(p["torch_compile"], bool(p.get("skipped"))) for p in training] == [
        (False, False), (False, False), (False, False), (True, True)]


@pytest.mark.slow
def test_the_training_sweep_runs_each_memory_setting_named_as_one_more_point(tmp_path):
    import torch
    from workbook import params as params_module
    import importlib
    training_sweep = importlib.import_module("workbook.bench.training_sweep")  # the package exports a function so named
    settings = bench.BenchSettings.from_params({
        **params_module.load_all()["cpu"], "bench_train_micro_batches": "2", "bench_train_steps": 3,
        "bench_train_settings": "loss_chunk_tokens,precision_bf16,offload_activations,sdpa_block_mask"})
    points = bench.training_points(settings, torch.device("cpu"))
    added = points[3:7]  # after plain, checkpointing, length grouping; the compile point last
    assert points[7]["torch_compile"] and "loss_chunk_tokens" not in points[7]
    assert [{k: v for k, v in p.items() if k in training_sweep.SETTING_KEYS} for p in added] == [
        {"loss_chunk_tokens": 1024}, {"precision": "bf16"}, {"offload_activations": True},
        {"attn_implementation": "sdpa_block_mask"}]
    assert "needs dtype bf16" in added[1]["skipped"]
    # Every point reads apart in the table, the NVML table and the figure, not only in the JSON.
    assert len({training_sweep.training_label(p) for p in points}) == len(points)
    rows = bench.training_rows({"training": {"points": [{"skipped": "not run here", **p} for p in points]}})
    assert [row["memory setting"] for row in rows[3:7]] == [
        "loss in chunks of 1024", "pure bf16 weights and states", "activations offloaded to host",
        "4D block mask (sdpa)"]
    assert rows[0]["memory setting"] == "" and rows[7]["compile"]
    measured = training_sweep.training_point(settings, added[3], tmp_path, log=lambda line: None)
    assert measured["tokens_per_second"] > 0 and measured["model"].endswith("attention sdpa_block_mask")
    assert len(measured["timed_step_tokens_per_second"]) == measured["timed_steps"] == 1  # 3 steps, 2 warm-up
    with pytest.raises(ValueError, match="bench_train_settings: unknown chunked"):
        bench.training_points(settings.replace(bench_train_settings="chunked"), torch.device("cpu"))


def test_a_point_whose_runs_spread_far_apart_is_marked_noisy_where_it_is_shown():
    # A CPU shared with another job gave runs of 31.8 and 708 tokens/s: a median of them is no measurement.
    assert bench.noise_note([100.0, 90.0, 110.0]) == "" and bench.noise_note([100.0]) == ""
    assert bench.noise_note([31.8, 700.0, 708.2]).startswith("noisy: its runs spread 22.3x")
    assert bench.noise_note([12226, 12943, 8899, 13681, 13408, 12393]) == ""  # one slow step of six: not noise
    assert bench.noise_note([12226, 6000, 8899, 13681, 13408, 12393]).startswith("noisy: its runs spread 1.5x")
    rows = bench.training_rows({"training": {"points": [{
        "micro_batch_size": 8, "grad_checkpointing": False, "torch_compile": False, "padding": "packing",
        "tokens_per_second": 160.0, "timed_step_tokens_per_second": [99.0, 8000.0], "mfu": None, "mfu_note": "n/a",
        "peak_memory_bytes": None, "cost": {"usd_per_million_tokens": None}}]}})
    assert rows[0]["tokens/s"].startswith("160 (noisy: its runs spread 80.8x")


def test_a_points_figure_is_the_median_of_its_runs_and_a_spread_of_exactly_the_limit_is_noisy():
    from workbook.bench import counting
    # One slow run of three must not drag the figure: the median, not the mean.
    assert counting.spread([100.0, 300.0, 110.0]) == {"median": 110.0, "min": 100.0, "max": 300.0,
                                                       "runs": [100.0, 300.0, 110.0]}
    # The limit is "fastest at least 1.5x the slowest".
    assert bench.noise_note([100.0, 150.0]).startswith("noisy: its runs spread 1.5x")


class FakeMemory:
    def __init__(self, available: int):
        self.available = available


def test_offloaded_activations_are_capped_by_the_host_memory_they_are_pinned_in(monkeypatch):
    """An H200's planned 1B micro-batch offloads ~150 GB to a 128 GiB host: the auto micro-batch is the
    largest whose pinned copies (up to 2x their bytes: power-of-two blocks) fit 90% of what is free."""
    import torch
    from workbook import params as params_module
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(training_sweep.runtime, "default_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(run_plan.psutil, "virtual_memory", lambda: FakeMemory(120 * 2**30))
    settings = bench.BenchSettings.from_params({
        **params_module.load_all()["h200"], "bench_train_model": "Llama-3.2-1B", "bench_train_steps": 4,
        "bench_train_settings": "offload_activations", "bench_train_micro_batches": "auto"})
    offloaded = [p for p in training_sweep.training_points(settings, torch.device("cuda")) if p.get("offload_activations")]
    micro = offloaded[0]["micro_batch_size"]
    config = training_sweep.point_config(settings, offloaded[0], Path("unused"))
    per_row = run_plan.memory_plan(config, 1, 2048).settings["offloaded_activation_bytes"]
    assert 2 * micro * per_row <= 0.9 * 120 * 2**30 < 2 * (micro + 1) * per_row
    assert run_plan.memory_plan(config, micro + 1, 2048).fits  # the GPU would hold more: the host decided
    assert "capped at" in offloaded[0]["micro_batch_rule"] and "by host memory" in offloaded[0]["micro_batch_rule"]


def test_a_host_with_almost_no_free_memory_still_gets_a_micro_batch_of_one_row(monkeypatch):
    # Pinned offload copies are capped by the host, but never to 0 rows: a plan of 0 would train nothing.
    import torch
    from workbook import params as params_module
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(training_sweep.runtime, "default_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(run_plan.psutil, "virtual_memory", lambda: FakeMemory(2**20))
    settings = bench.BenchSettings.from_params({
        **params_module.load_all()["h200"], "bench_train_model": "Llama-3.2-1B", "bench_train_steps": 4,
        "bench_train_settings": "offload_activations", "bench_train_micro_batches": "auto"})
    offloaded = [p for p in training_sweep.training_points(settings, torch.device("cuda")) if p.get("offload_activations")]
    config = training_sweep.point_config(settings, offloaded[0], Path("unused"))
    fits, rule = run_plan.largest_micro_batch(config, 2048)
    assert fits == 1 and "capped at 1 by host memory" in rule


def test_an_auto_micro_batch_runs_each_memory_setting_at_the_largest_the_planner_fits_for_it(monkeypatch):
    import importlib
    import torch
    from workbook import params as params_module, training
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(training_sweep.runtime, "default_device", lambda: torch.device("cuda"))  # the h100's bf16
    monkeypatch.setattr(run_plan.psutil, "virtual_memory", lambda: FakeMemory(2**40))  # a host that holds any offload
    settings = bench.BenchSettings.from_params({
        **params_module.load_all()["h100"], "bench_train_model": "Llama-3.2-1B", "bench_train_steps": 4,
        "bench_train_settings": "loss_chunk_tokens,offload_activations"})
    points = training_sweep.training_points(settings.replace(bench_train_micro_batches="auto"), torch.device("cuda"))
    plain, checkpointed, _, chunked, offloaded, compiled = points
    for point in (plain, checkpointed, chunked, offloaded):
        config = training_sweep.point_config(settings, point, Path("unused"))
        micro = point["micro_batch_size"]
        assert training.memory_plan(config, micro, 2048).fits and not training.memory_plan(config, micro + 1, 2048).fits
        assert training_sweep.training_label(point).startswith(f"mb {micro} (planned)")
    # What each setting is for, measured where it matters: a larger micro-batch than the plain point's.
    assert min(checkpointed["micro_batch_size"], chunked["micro_batch_size"], offloaded["micro_batch_size"]) > \
        plain["micro_batch_size"]
    assert compiled["torch_compile"] and compiled["micro_batch_size"] == plain["micro_batch_size"]
    # A number the list names and 'auto' landing on it: one point, not the same run twice.
    both = training_sweep.training_points(
        settings.replace(bench_train_micro_batches=f"{plain['micro_batch_size']},auto"), torch.device("cuda"))
    assert len([p for p in both if training_sweep._is_plain(p)]) == 1
    # Not even one row fits: said, not run.
    too_big = training_sweep.training_points(settings.replace(bench_train_model="Llama-3.1-70B", bench_train_settings="",
                                                              bench_train_micro_batches="auto"), torch.device("cuda"))
    assert too_big[0]["micro_batch_size"] == "auto" and "not even micro-batch 1 fits" in too_big[0]["skipped"]


@pytest.mark.slow
def test_a_training_point_trains_with_the_profiles_optimizer_lora_targets_and_data_loading(monkeypatch):
    """A bench point measures the profile's training job: the optimizer (whose state the planned
    micro-batch follows), the LoRA targets and the DataLoader settings are the profile's, and the
    Trainer/TRL baselines load their batches with the same workers, prefetch and pinning."""
    import types
    import torch
    from workbook import params as params_module
    from workbook.bench import trainer_baseline
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(training_sweep.runtime, "default_device", lambda: torch.device("cuda"))
    h100 = bench.BenchSettings.from_params({
        **params_module.load_all()["h100"], "bench_train_model": "Llama-3.2-1B", "bench_train_steps": 4,
        "bench_train_settings": "", "bench_train_micro_batches": "auto"})
    assert (h100.dataloader_workers, h100.pin_memory) == (4, True)  # what the GPU profiles train with
    eight_bit = h100.replace(optimizer="adamw-8bit", prefetch_factor=3)
    point = training_sweep.training_points(eight_bit, torch.device("cuda"))[0]
    config = training_sweep.point_config(eight_bit, point, Path("unused"))
    assert (config.optimizer, config.dataloader_workers, config.pin_memory, config.prefetch_factor) == \
        ("adamw-8bit", 4, True, 3)
    # 8-bit states (2 B/param instead of 8) leave room for a larger planned micro-batch than AdamW's.
    assert point["micro_batch_size"] > training_sweep.training_points(h100, torch.device("cuda"))[0]["micro_batch_size"]
    lora = training_sweep.point_config(h100.replace(lora_rank=8, lora_targets="q_proj,v_proj"), point, Path("unused"))
    assert (lora.lora_rank, lora.lora_targets) == (8, "q_proj,v_proj")

    run = types.SimpleNamespace(total_steps=4, micro_batch_size=point["micro_batch_size"], learning_rate=1e-4)
    values = trainer_baseline.argument_values(config, run, "unused", torch.device("cuda"))
    assert (values["dataloader_num_workers"], values["dataloader_pin_memory"], values["dataloader_prefetch_factor"],
            values["optim"]) == (4, True, 3, "adamw_bnb_8bit")
    on_cpu = trainer_baseline.argument_values(dataclasses.replace(config, optimizer="adamw", dataloader_workers=0),
                                              run, "unused", torch.device("cpu"))
    assert (on_cpu["dataloader_num_workers"], on_cpu["dataloader_pin_memory"], on_cpu["dataloader_prefetch_factor"]) \
        == (0, False, None) and "optim" not in on_cpu  # the Trainer's default AdamW


class NoNvml:
    @staticmethod
    def nvmlInit():
        raise OSError("NVML Shared Library Not Found")


class FakeNvml:
    NVML_CLOCK_SM = 1

    def nvmlInit(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, index): return index
    def nvmlDeviceGetUtilizationRates(self, handle): return type("U", (), {"gpu": 90})()
    def nvmlDeviceGetMemoryInfo(self, handle): return type("M", (), {"used": 2**30})()
    def nvmlDeviceGetPowerUsage(self, handle): return 300_000  # milliwatts
    def nvmlDeviceGetClockInfo(self, handle, kind): return 1980


def test_sampler_without_nvml_says_it_is_unavailable():
    with bench.NvmlSampler(nvml=NoNvml()) as sampler:
        pass
    summary = sampler.summary()
    assert summary["available"] is False and "NVML unavailable" in summary["reason"] and summary["samples"] == 0


def test_sampler_records_kernel_time_memory_power_and_clock_labelled_for_what_they_are():
    import time
    with bench.NvmlSampler(nvml=FakeNvml(), interval_seconds=0.01) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()
    assert summary["available"] and summary["samples"] >= 1
    assert summary["kernel_time_percent"]["mean"] == 90 and summary["power_watts"]["max"] == 300
    assert summary["sm_clock_mhz"]["mean"] == 1980 and summary["memory_used_bytes"]["max"] == 2**30
    assert "not efficiency" in summary["what"]


class NvmlWithoutPower(FakeNvml):
    def nvmlDeviceGetPowerUsage(self, handle):
        raise RuntimeError("Not Supported")  # pynvml's NVMLError_NotSupported, as under MIG


def test_a_reading_the_gpu_does_not_support_is_left_out_and_the_others_go_on():
    import time
    with bench.NvmlSampler(nvml=NvmlWithoutPower(), interval_seconds=0.01) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()
    assert summary["samples"] >= 2 and summary["kernel_time_percent"]["mean"] == 90
    assert summary["power_watts"] is None and "Not Supported" in summary["unsupported"]["power_watts"]
    from workbook.bench import report
    row = report.nvml_rows({"generation": {"points": [fake_point("static-sorted", 8, 100.0, nvml=summary)]},
                            "training": None})[0]
    assert row["kernel running (% of time)"] == "90" and row["power W"] == report.NA


def fake_point(strategy, batch, tokens_per_second, **extra):
    return {"strategy": strategy, "batch_size": batch, "seconds": {"median": 1.0},
            "output_tokens_per_second": {"median": tokens_per_second, "min": tokens_per_second, "max": tokens_per_second},
            "examples": 10, "failed": 0, "examples_per_minute": 600.0, "peak_memory_bytes": None,
            "predicted_peak_bytes": 10**6, "fraction_of_peak": {"bandwidth": None, "compute": None},
            "roofline": {"seconds": None, "tokens_per_second": None},
            "fraction_of_roofline": {"datasheet": None, "measured_ceilings": None},
            "nvml": {"available": False, "reason": "no NVML", "samples": 0}, "identical_to_one_at_a_time": 10,
            **extra}


def test_claims_table_lists_every_seed_claim_with_a_figure_or_why_not():
    generation = {"model": "tiny", "model_name": "tiny", "examples": 10, "max_new_tokens": 16,
                  "points": [fake_point("seed-before", 1, 50.0), fake_point("seed-after", 32, 500.0)]}
    rows = bench.claims_table(generation, {"points": []}, None, on_gpu=False)
    text = {row["claim"]: row["measured"] for row in rows}
    assert len(rows) == 11 and all(row["measured"] for row in rows)
    assert "20 of 20 outputs" in text["slice each output at its count of non-pad prompt tokens"]
    assert text["~300-400 examples/minute, 8B model, batch 32, 2048 new tokens"].startswith("not measurable")
    assert text["TF32 gives 8x faster matrix ops"].startswith("not measurable")
    assert text["GPU utilization 85-95% (nvidia-smi)"].startswith("not measurable")
    assert "336 MB" in text["KV cache ~500MB per example (8B, 2048 new tokens)"]  # 128 KiB/token x 2560 tokens
    assert text["a failed batch counts all its examples as lost"].startswith("0 examples lost")
    tensor_parallel = text["~20GB per GPU with TP=4 (30B teacher on 4 of 8 H100s)"]
    assert tensor_parallel.startswith("planned, not measured") and "Qwen2.5-32B (32.8B) at T=4 holds 16.4 GB" in \
        tensor_parallel  # 32.8B x 2 B / 4, norms whole
    from workbook import params as params_module
    from workbook.planner import profile
    batches = text["batch 32 on an H200 ('only 28% utilization' of its 141 GB), 16 on an H100 (8B, 2048 new tokens)"]
    for name, seed_batch in (("h200", 32), ("h100", 16)):  # the planner's largest: it fits, one more does not
        plan = lambda batch: profile.plan(params_module.load_all()[name], mode="generate", model="Llama-3.1-8B",
                                          batch_size=batch, prompt_len=512, max_new_tokens=2048, dtype="bf16")
        largest = int(batches.split(f"on {name} (")[0].split()[-1])
        assert plan(largest).fits and not plan(largest + 1).fits and largest > seed_batch


def test_the_claims_count_lost_examples_apart_from_failed_ones_and_show_ranges_from_low_to_high():
    # Two points of 10 examples: one finished 8 and failed 2 alone (none lost), on a machine with NVML.
    nvml = lambda mean, high: {"available": True, "kernel_time_percent": {"mean": mean, "max": high}}
    after = fake_point("seed-after", 32, 500.0, examples=8, failed=2, nvml=nvml(60.0, 95.0),
                       peak_memory_bytes=3 * 10**6, predicted_peak_bytes=2 * 10**6)
    after["fraction_of_roofline"] = {"datasheet": 0.4, "measured_ceilings": None}
    sorted_ = fake_point("static-sorted", 64, 900.0, nvml=nvml(80.0, 99.0))
    sorted_["fraction_of_roofline"] = {"datasheet": 0.5, "measured_ceilings": None}
    generation = {"model": "8b", "model_name": "Llama-3.1-8B", "examples": 10, "max_new_tokens": 16,
                  "points": [after, sorted_]}
    rows = bench.claims_table(generation, {"points": [{"mfu": 0.2}, {"mfu": 0.4}]}, None, on_gpu=False)
    text = {row["claim"]: row["measured"] for row in rows}
    assert text["a failed batch counts all its examples as lost"] == "0 examples lost, 2 failed alone, over 2 points"
    # The kernel-time figure is each point's mean over its samples, not its highest sample.
    assert text["GPU utilization 85-95% (nvidia-smi)"].startswith(
        "NVML kernel time 60-80% of the time while the points reached 40%-50% of their roofline")
    assert text["memory figures per batch size"] == "measured peak / planner: seed-after b32 1.50"
    assert text["bf16 + compile + flash attention make a 1B fine-tune fast"] == "MFU 20.0%-40.0% over the training points"
    # The 8B's examples/minute on a CPU is not the seed's claim measured: it says so.
    assert text["~300-400 examples/minute, 8B model, batch 32, 2048 new tokens"].startswith("not measurable")


def test_auto_batch_is_the_planners_point_and_named_as_such():
    import torch
    assert bench.parse_int_list("8,auto", "bench_batch_sizes", auto=64) == [8, 64]
    with pytest.raises(bench.BenchError, match="bench_train_micro_batches"):
        bench.parse_int_list("auto", "bench_train_micro_batches")  # no planner answer given: an error, not a guess
    planned = {"planned": 1500, "batch_size": 32, "note": "the planner's largest batch on h200: 1500, capped at 32"}
    settings = bench.BenchSettings(bench_batch_sizes="8,32,auto", bench_strategies="static-sorted")
    points = bench.sweep_points(settings, torch.device("cpu"), planned)
    assert [p["batch_size"] for p in points] == [8, 32]  # 'auto' = 32 is run once
    assert points[1]["planner_batch"] == planned["note"] and "planner_batch" not in points[0]
    # A batch above the sweep's prompts is the batch of all of them: run once, not again under another label.
    capped = bench.sweep_points(settings.replace(bench_batch_sizes="8,32,64,auto", bench_examples=32),
                                torch.device("cpu"), planned)
    assert [p["batch_size"] for p in capped] == [8, 32] and capped[1]["planner_batch"] == planned["note"]


def test_goals_are_judged_at_the_planners_batch_and_say_by_how_much_they_miss():
    at_planner = fake_point("static-sorted", 512, 9000.0, planner_batch="the planner's largest batch on h200: 512",
                            speedup_over_seed_after=12.0)
    at_planner["fraction_of_roofline"] = {"datasheet": 0.45, "measured_ceilings": None}
    at_planner["roofline"] = {"seconds": {"prefill": 0.25, "decode": 0.75, "total": 1.0}}
    generation = {"points": [fake_point("seed-after", 32, 750.0, speedup_over_seed_after=1.0),
                             fake_point("static-sorted", 8, 20000.0, speedup_over_seed_after=26.7), at_planner],
                  "device": "cuda:0"}
    rows = {row["goal"]: row for row in bench.goals_table(generation, {"points": [{"mfu": 0.5}, {"mfu": 0.3}]})}
    bandwidth, speedup, mfu = (rows[goal] for goal in bench.GOALS[:3])
    assert bandwidth["measured"].startswith("45.0% of the roofline at the datasheet's peaks; prefill is 25% of that "
                                            "roofline (static-sorted, batch 512")
    assert bandwidth["met"] == "no: 75% of the goal"
    assert speedup["measured"].startswith("12.0x") and speedup["met"] == "yes"  # batch 8's 26.7x is not the planner's
    assert mfu["measured"].startswith("50.0%") and mfu["met"] == "yes"
    # Where the run measured the GPU's copy bandwidth and matmul, the goal is judged against them, the datasheet beside.
    at_planner["fraction_of_roofline"] = {"datasheet": 0.54, "measured_ceilings": 0.62}
    measured = bench.goals_table(generation, None)[0]
    assert measured["measured"].startswith("62.0% of the roofline at this GPU's measured copy bandwidth and matmul; "
                                           "54.0% at the datasheet's")
    assert measured["met"] == "yes"
    # The speedup goal is a GPU's: on a CPU it is shown, not judged.
    on_cpu = {row["goal"]: row for row in bench.goals_table({**generation, "device": "cpu"}, None)}[bench.GOALS[1]]
    assert on_cpu["measured"].startswith("12.0x") and on_cpu["met"] == "n/a: a GPU goal, measured here on a CPU"
    none = {row["goal"]: row for row in bench.goals_table({"points": [fake_point("seed-after", 32, 1.0)]}, None)}
    assert none[bench.GOALS[0]]["measured"].startswith("not measured: bench_batch_sizes has no 'auto'")
    assert none[bench.GOALS[2]]["met"] == "n/a"


def test_a_goal_reached_exactly_is_met_and_is_judged_on_the_fastest_workbook_point_and_best_mfu():
    def planned(strategy, batch, tokens_per_second, fraction, speedup):
        point = fake_point(strategy, batch, tokens_per_second, planner_batch=f"the planner's largest: {batch}",
                           speedup_over_seed_after=speedup)
        point["fraction_of_roofline"] = {"datasheet": fraction, "measured_ceilings": None}
        return point
    # At the planner's batch: the fastest workbook strategy is right at the goals; a slower one and the
    # hf-pipeline (faster, but not the workbook's engine) must not be the one judged.
    generation = {"device": "cuda:0", "points": [
        planned("static-compiled", 256, 3000.0, 0.30, 5.0), planned("continuous", 256, 5000.0, 0.60, 10.0),
        planned("hf-pipeline", 256, 9000.0, 0.90, 20.0)]}
    table = bench.goals_table(generation, {"points": [{"mfu": 0.30}, {"mfu": 0.45}, {"mfu": None}]})
    bandwidth, speedup, mfu = ({row["goal"]: row for row in table}[goal] for goal in bench.GOALS[:3])
    assert bandwidth["measured"].startswith("60.0% of the roofline") and "(continuous, batch 256" in bandwidth["measured"]
    assert speedup["measured"].startswith("10.0x (continuous, batch 256")
    assert mfu["measured"] == "45.0% (best training point)"
    assert [bandwidth["met"], speedup["met"], mfu["met"]] == ["yes", "yes", "yes"]


def train_point(micro, tokens_per_second, **changes):
    return {"micro_batch_size": micro, "grad_checkpointing": False, "torch_compile": False, "padding": "packing",
            "micro_batch_rule": "auto: the planner's largest for these settings", "tokens_per_second": tokens_per_second,
            **changes}


def test_the_memory_setting_goal_compares_each_setting_at_its_planned_batch_with_the_plain_plan():
    goal = lambda points: {row["goal"]: row for row in bench.goals_table(None, {"points": points})}[bench.GOALS[3]]
    plain = train_point(6, 30000.0)
    chunked = train_point(12, 31000.0, loss_chunk_tokens=1024)
    checkpointed = train_point(12, 24000.0, grad_checkpointing=True)
    fixed = {**train_point(4, 50000.0, loss_chunk_tokens=1024), "micro_batch_rule": None}  # a listed batch: not judged
    met = goal([plain, checkpointed, chunked, fixed, train_point(6, 40000.0, padding="length_grouped")])
    assert met["met"] == "yes" and "checkpointing: micro-batch x2.00, tokens/s x0.80" in met["measured"]
    assert "chunked loss: micro-batch x2.00, tokens/s x1.03" in met["measured"]
    slower = goal([plain, checkpointed])
    # "No loss of tokens/s": the same rate at twice the batch meets the goal.
    assert goal([plain, train_point(12, 30000.0, grad_checkpointing=True)])["met"] == "yes"
    assert slower["met"] == "no: the best at twice the batch trains at 0.80x"
    short = goal([plain, train_point(9, 33000.0, precision="bf16")])
    assert short["met"] == "no: no setting fits twice the plain micro-batch"
    assert goal([{**plain, "micro_batch_rule": None}, chunked])["met"] == "n/a"  # no planned plain point
    capped = goal([{**plain, "micro_batch_capped": True, "micro_batch_rule": "auto: ... capped at 6 so that an epoch "
                    "(6 rows) has an optimizer step"}, chunked])
    assert capped["met"] == "n/a" and capped["measured"].startswith("not measured: the data, not memory, chose")


def test_a_point_the_planner_said_fits_running_out_of_memory_fails_the_goal():
    def goal(points, device="cuda:0"):
        table = bench.goals_table(None, {"points": points, "baselines": [train_point(6, 2.0)], "device": device})
        return {row["goal"]: row for row in table}[bench.GOALS[4]]
    refused = {"out_of_memory": "CUDA out of memory", "planner_said": "does not fit"}
    planned = train_point(6, 1.0, predicted_peak_bytes=2**30)
    assert goal([planned, refused])["met"] == "yes"
    wrong = goal([planned, refused, {"out_of_memory": "x", "planner_said": "fits (the planner was wrong)"}])
    assert wrong["met"] == "no: 1 of 3"  # the unplanned baseline is not counted
    assert wrong["measured"] == ("3 planned training points ran; 1 ran out of memory where the planner said they fit, "
                                 "1 where it said they do not")
    # A CPU raises no out-of-memory error (past the RAM the process is killed): the rule was not tested there.
    assert goal([planned], device="cpu")["met"] == "n/a: a GPU rule (a CPU raises no out-of-memory error)"


def test_a_speedup_over_a_noisy_baseline_says_so_in_the_table_and_the_goal():
    point = {"strategy": "static-sorted", "batch_size": 32, "planner_batch": "planner", "seconds": 1.0,
             "speedup_over_seed_after": 12.0, "speedup_noise": "seed-after: noisy: its runs spread 3.0x",
             "output_tokens_per_second": {"median": 10.0}, "fraction_of_roofline": {}, "roofline": {"seconds": None}}
    row = {row["goal"]: row for row in bench.goals_table({"points": [point], "device": "cpu"}, None)}[bench.GOALS[1]]
    assert row["measured"].endswith("(seed-after: noisy: its runs spread 3.0x)")


def write_run(folder, manifest=None, **files):
    folder.mkdir(parents=True)
    if manifest is not None:
        (folder / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    for name, value in files.items():
        (folder / review.METRIC_FILES[name]).write_text(value if isinstance(value, str) else json.dumps(value))


def test_review_loads_complete_partial_broken_and_reference_runs(tmp_path):
    benchmark = {"profile": "h200", "started_at": "2026-12-01T00:00:00+00:00",
                 "git": {"commit": "0123456789abcdef", "dirty": False}, "generation": {"points": [
        fake_point("static-sorted", 8, 100.0, peak_memory_bytes=2 * 10**6),
        fake_point("continuous", 8, 150.0), fake_point("static-sorted", 32, 300.0),
        fake_point("hf-pipeline", 32, 900.0)]}, "training": {"points": [  # the baseline is not the workbook's best
            {"micro_batch_size": 4, "grad_checkpointing": False, "torch_compile": False, "padding": "packing",
             "tokens_per_second": 1000.0, "mfu": 0.4}]}}
    write_run(tmp_path / "reference" / "h200", None, benchmark=benchmark)
    # A GPU session's call leaves its benchmark's run folder inside the GPU's reference folder.
    write_run(tmp_path / "reference" / "h200" / "20261201-000000-bench-h200", None, benchmark=benchmark)
    write_run(tmp_path / "20261121-000000-cpu", {"profile": "cpu", "status": "ok", "started_at": "2026-11-21",
                                                 "git": {"commit": "abcdef1234567", "dirty": True},
                                                 "hardware": {"gpus": []}, "notebooks": []})
    write_run(tmp_path / "20261121-000001-cpu", {"profile": "cpu", "status": "running", "notebooks": []})
    write_run(tmp_path / "20261121-000002-cpu", '{"profile": "cpu", "stat', benchmark="[1, 2]")  # torn writes
    (tmp_path / "models").mkdir()  # not a run: skipped
    runs = review.load_runs(tmp_path)
    labels = [run.label for run in runs]
    assert labels == ["reference/h200", "reference/h200/20261201-000000-bench-h200", "20261121-000002-cpu",
                      "20261121-000001-cpu", "20261121-000000-cpu"]
    rows = {row["run"]: row for row in review.run_rows(runs)}
    assert rows["reference/h200"]["profile"] == "h200" and rows["reference/h200"]["status"] == "no manifest"
    # A reference folder has no manifest: its benchmark says when and from what commit it ran.
    assert rows["reference/h200"]["date"] == "2026-12-01T00:00:00+00:00"
    assert rows["reference/h200"]["commit"] == "0123456789"
    assert rows["20261121-000000-cpu"]["commit"] == "abcdef1234 (dirty)" and rows["20261121-000000-cpu"]["GPU"] == "no GPU"
    assert "status running" in rows["20261121-000001-cpu"]["problems"]
    assert review.load_run(tmp_path / "20261121-000002-cpu").profile == "cpu"  # from the folder name
    assert review.Run(tmp_path / "20261121-000003-bench-a100-80gb-1", False).profile == "a100-80gb"
    assert "manifest.json: unreadable" in rows["20261121-000002-cpu"]["problems"]
    assert "benchmark.json: not a JSON object" in rows["20261121-000002-cpu"]["problems"]
    series = review.throughput_series(runs)
    assert series == [{"label": label, "x": [8, 32], "y": [150.0, 300.0], "notes": ["continuous", "static-sorted"]}
                      for label in ("reference/h200 (h200)", "reference/h200/20261201-000000-bench-h200 (h200)")]
    assert review.memory_accuracy_series(runs)[0]["y"] == [2.0]
    assert review.mfu_rows(runs)[0]["MFU"] == "40.0%"


def test_review_tells_a_run_still_running_from_one_whose_process_is_gone(tmp_path):
    # A manifest says "running" until its command ends; killed (kill -9, a crash), it says so for ever.
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = {"profile": "cpu", "status": "running", "host": socket.gethostname(), "notebooks": []}
    write_run(tmp_path / "20261121-000000-cpu", {**here, "pid": int(ended.stdout), "job": "generate"})
    write_run(tmp_path / "20261121-000001-cpu", {**here, "pid": os.getpid()})
    write_run(tmp_path / "20261121-000002-cpu", {**here, "pid": os.getpid()})  # notebook 05's own run
    write_run(tmp_path / "20261121-000003-cpu", {**here, "status": "failed", "job": "generate", "exit_code": 2,
                                                 "error": "prompts.jsonl:3: not valid JSON"})
    rows = review.run_rows(review.load_runs(tmp_path, this_run=tmp_path / "20261121-000002-cpu"))
    by_run = {row["run"]: row for row in rows}
    killed = by_run["20261121-000000-cpu"]
    assert killed["status"] == "stopped" and "process" in killed["problems"] and "rerun" in killed["problems"]
    assert by_run["20261121-000001-cpu"]["status"] == "running" and by_run["20261121-000001-cpu"]["problems"] == ""
    assert by_run["20261121-000002-cpu (this run)"]["problems"] == ""
    assert by_run["20261121-000002-cpu (this run)"]["status"] == "running (its last notebook, 05, is reviewing it)"
    assert by_run["20261121-000003-cpu"]["problems"] == "status failed: prompts.jsonl:3: not valid JSON"


def test_review_of_an_empty_outputs_folder_is_empty(tmp_path):
    assert review.load_runs(tmp_path) == [] and review.load_runs(tmp_path / "missing") == []
    assert review.throughput_series([]) == [] and review.mfu_rows([]) == []


def test_an_output_continuous_batching_ended_at_eos_is_compared_up_to_its_eos():
    from workbook.generation import Completion
    forced = Completion([5, 6, 7, 8], "length")  # one at a time, EOS masked until 4 tokens
    assert bench.same_greedy_tokens(Completion([5, 6, 7, 8], "length"), forced)
    assert bench.same_greedy_tokens(Completion([5, 6, 2], "eos"), forced)  # EOS where the forced run took 7
    assert not bench.same_greedy_tokens(Completion([5, 9, 2], "eos"), forced)
    assert not bench.same_greedy_tokens(Completion([5, 6, 7, 9], "length"), forced)
    assert not bench.same_greedy_tokens(None, forced)


@pytest.mark.slow
def test_a_points_figures_come_from_its_median_run(tiny_model_path, tmp_path, monkeypatch):
    from workbook import notebook
    from workbook.bench import report
    monkeypatch.setattr(notebook, "new_run_dir", lambda name: (tmp_path / name).mkdir() or tmp_path / name)
    report.cli_main("cpu", ["bench_strategies=static-sorted,continuous", "bench_batch_sizes=4", "bench_examples=6",
                            "bench_repeats=3", "bench_train_micro_batches=2", "bench_train_steps=1",
                            "bench_train_baselines=none"])
    points = [json.loads(line) for line in (tmp_path / "bench-cpu" / report.POINTS_FILE).read_text().splitlines()]
    generation_points = [point for point in points if point["sweep"] == "generation"]
    assert [point["strategy"] for point in generation_points] == ["static-sorted", "continuous"]
    for point in generation_points:
        runs = point["seconds"]["runs"]
        assert len(runs) == 3 and point["seconds"]["median"] == sorted(runs)[1]
        # Examples per minute (and the roofline fraction, from the same run) are the median run's, not the fastest's.
        assert point["examples_per_minute"] == pytest.approx(60 * point["examples"] / sorted(runs)[1])


@pytest.mark.slow
def test_a_benchmark_stopped_part_way_keeps_every_point_it_finished(tiny_model_path, tmp_path, monkeypatch):
    # A lent GPU's call stops a step at its time limit: the points measured before it must be on disk.
    import importlib
    from workbook import notebook
    from workbook.bench import report
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(notebook, "new_run_dir", lambda name: (tmp_path / name).mkdir() or tmp_path / name)
    original, started = training_sweep.training_point, []

    def stopped_after_two(params, point, work_dir, log):
        if len(started) == 2:
            raise KeyboardInterrupt  # as a kill stops it: no report is written
        started.append(point)
        return original(params, point, work_dir, log)
    monkeypatch.setattr(training_sweep, "training_point", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        report.cli_main("cpu", ["bench_strategies=seed-before,static-sorted", "bench_batch_sizes=4", "bench_examples=4",
                                "bench_repeats=1", "bench_train_micro_batches=2", "bench_train_steps=3",
                                "bench_train_baselines=none"])
    run_dir = tmp_path / "bench-cpu"
    assert not (run_dir / "benchmark.json").exists()
    lines = [json.loads(line) for line in (run_dir / report.POINTS_FILE).read_text().splitlines()]
    assert [(line["sweep"], line.get("strategy")) for line in lines] == [
        ("generation", "seed-before"), ("generation", "static-sorted"), ("training", None), ("training", None)]
    assert all(line["output_tokens_per_second"]["median"] > 0 for line in lines[:2])
    assert [line["tokens_per_second"] > 0 for line in lines[2:]] == [True, True]
    assert "completions" not in lines[0]  # the outputs stay out of the record


@pytest.mark.slow
def test_a_benchmark_whose_time_budget_runs_out_writes_its_report_with_what_it_measured(
        tiny_model_path, tmp_path, monkeypatch):
    # A lent GPU's call gives the benchmark its time: the point running when it ends is stopped, the rest
    # marked not run, and benchmark.json (its goals and claims) is still written.
    import importlib
    from workbook import notebook
    from workbook.bench import report
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(notebook, "new_run_dir", lambda name: (tmp_path / name).mkdir() or tmp_path / name)
    original, budgets, made = training_sweep.training_point, [], report.TimeBudget
    monkeypatch.setattr(report, "TimeBudget", lambda seconds, **options: budgets.append(made(seconds, **options))
                        or budgets[-1])

    def the_budget_ends_in_the_second(params, point, work_dir, log):
        if point["grad_checkpointing"]:
            # As the budget's timer does: expired, and its interrupt lands in the middle of the point. Raised here,
            # not through interrupt_main, whose delivery depends on the process's SIGINT handler (one full-suite
            # run never delivered it after the Trainer and TRL baselines had run).
            with budgets[0].lock:
                budgets[0].expired = True
            raise KeyboardInterrupt
        return original(params, point, work_dir, log)
    monkeypatch.setattr(training_sweep, "training_point", the_budget_ends_in_the_second)
    assert report.cli_main("cpu", ["bench_strategies=seed-after", "bench_examples=4", "bench_max_new_tokens=2",
                                   "bench_repeats=1", "bench_train_micro_batches=2", "bench_train_steps=3"],
                           time_budget_seconds=36000) == 0  # counted from the process's start: pytest's
    written = json.loads((tmp_path / "bench-cpu" / "benchmark.json").read_text())
    assert written["time_budget"] == {"seconds": 36000, "ran_out": True} and written["goals"] and written["claims"]
    assert "--time-budget-seconds 36000" in written["command"]
    assert written["generation"]["points"][0]["output_tokens_per_second"]["median"] > 0
    plain, checkpointed, *rest = written["training"]["points"]
    assert plain["tokens_per_second"] > 0 and checkpointed["skipped"].startswith("stopped: the time budget")
    assert rest and all(point["skipped"].startswith("not run: the time budget") for point in rest)
    # The plain point's baselines ran beside it, before the budget ended.
    assert [baseline["micro_batch_size"] for baseline in written["training"]["baselines"]] == [2, 2]


def test_a_budget_that_runs_out_between_points_interrupts_nothing_and_runs_no_more_points():
    # Outside a point (a model's build, a record being written) the deadline must not raise: the
    # report after the sweep would be lost. The next point is not run.
    from workbook.bench.budget import TimeBudget
    budget = TimeBudget(0.05, points_only=True)
    time.sleep(0.3)  # a KeyboardInterrupt here would fail the test
    assert budget.expired
    assert budget.measure({"point": 1}, lambda: pytest.fail("a point ran after the deadline"))["skipped"].startswith(
        "not run: the time budget")


def test_the_sweep_drops_static_compiled_graphs_before_the_next_point(monkeypatch):
    # CUDA graphs keep a memory pool while the compiled step lives on the model: the points after
    # static-compiled would carry it in their measured peak memory.
    import types
    import torch
    sweep = importlib.import_module("workbook.bench.generation_sweep")
    order = []
    points = [{"strategy": "static-compiled", "batch_size": 4}, {"strategy": "static-sorted", "batch_size": 4}]
    monkeypatch.setattr(sweep, "sweep_points", lambda params, device, planned: [dict(p) for p in points])
    monkeypatch.setattr(sweep, "generation_point",
                        lambda setup, params, point, repeats, log: order.append(point["strategy"]) or dict(point))
    monkeypatch.setattr(torch._dynamo, "reset", lambda: order.append("reset"))
    setup = sweep.GenerationSetup(model=None, description="tiny", model_name="tiny", prompts=[types.SimpleNamespace(
        token_ids=[1, 2])], settings=types.SimpleNamespace(max_new_tokens=2), device=torch.device("cpu"), dtype="fp32")
    sweep.generation_sweep(bench.BenchSettings(bench_repeats=1, bench_batch_sizes="4"), log=lambda line: None,
                           setup=setup)
    assert order == ["static-compiled", "reset", "static-sorted"]


def test_the_benchmarks_settings_are_built_once_with_the_schemas_defaults_and_are_the_keys_it_reads():
    import papermill
    from workbook import job_keys, params as params_module
    from workbook.bench.settings import BenchSettings, field_keys
    from workbook.paths import REPO_ROOT
    # No defaults of its own: settings built in code run as a profile that leaves every key out would.
    defaults = params_module.defaults()
    assert BenchSettings().as_params() == {key: defaults[key] for key in field_keys()}
    h100 = params_module.load_all()["h100"]
    built = BenchSettings.from_params(h100)
    assert built.as_params() == {key: h100[key] for key in field_keys()}
    assert built.hardware.memory_bandwidth_gbs == h100["memory_bandwidth_gbs"] > 0
    # A change reaches the machine's facts as well as the sweeps' settings.
    changed = built.replace(usd_per_gpu_hour=0.0, bench_examples=8)
    assert (changed.hardware.usd_per_gpu_hour, changed.bench_examples, built.hardware.usd_per_gpu_hour) == \
        (0.0, 8, h100["usd_per_gpu_hour"])
    # The key list --help and --set read is these fields, written once; notebook 04 declares every one.
    assert job_keys.BENCH == field_keys()
    assert set(field_keys()) <= set(papermill.inspect_notebook(str(REPO_ROOT / f"{job_keys.NOTEBOOKS['bench']}.ipynb")))
    with pytest.raises(params_module.ParamsError, match=r"workbook bench needs the parameter\(s\) gpu_spec, "
                                                        r"bench_repeats; .*notebooks/04_benchmarking"):
        BenchSettings.from_params({k: v for k, v in h100.items() if k not in ("gpu_spec", "bench_repeats")})
    # That nothing past the entry reads the params, and that job_keys imports no torch (so the bench package
    # loads its sweeps lazily): tests/test_settings_built_once.py.


def test_a_gpu_profile_run_on_a_cpu_is_not_judged_against_that_gpus_peaks_or_price():
    import torch
    from workbook import params as params_module
    from workbook.bench import report
    profiles, said = params_module.load_all(), []
    h100, cpu = (bench.BenchSettings.from_params(profiles[name]) for name in ("h100", "cpu"))
    on_cpu = report.without_absent_peaks(h100, torch.device("cpu"), said.append)
    assert all(on_cpu.as_params()[key] == 0 for key in report.GPU_FIGURES) and on_cpu.hardware.gpu_memory_gib == 79.6
    assert "describes a GPU and this run is on cpu" in said[0]
    assert report.without_absent_peaks(h100, torch.device("cuda"), said.append) is h100
    assert report.without_absent_peaks(cpu, torch.device("cpu"), said.append) is cpu
    assert len(said) == 1


def test_the_loss_head_benchmark_records_each_share_of_loss_positions(tmp_path):
    from workbook.bench import loss_head
    assert loss_head.main(["--positions", "64", "--hidden-size", "16", "--vocab", "100", "--chunk", "16",
                           "--shares", "1.0,0.25", "--repeats", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "loss_head.json").read_text())
    assert [(row["loss_share"], row["loss_positions"]) for row in record["rows"]] == [(1.0, 64), (0.25, 16)]
    assert all(row["full_logits_seconds"] > 0 and row["chunked_seconds"] > 0 for row in record["rows"])
    assert "vocab 100" in record["what"] and "| 25% (16) |" in (tmp_path / "loss_head.md").read_text()


def test_the_engine_overhead_benchmark_times_bare_engine_and_sorted_runs_of_both_datasets(tmp_path, tiny_model_path):
    from workbook.bench import engine_overhead
    assert engine_overhead.main(["--examples", "8", "--batch-size", "4", "--max-new-tokens", "4", "--repeats", "1",
                                 "--threads", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "generate_bench.json").read_text())
    assert [row["dataset"] for row in record["results"]] == ["sample", "mixed"]
    for row in record["results"]:
        median = row["median_seconds"]
        assert set(median) == {"bare", "engine", "sorted"} and min(median.values()) > 0
        assert row["engine_overhead_vs_bare"] == pytest.approx(median["engine"] / median["bare"] - 1, abs=0.05)  # medians rounded to ms
        # Length-sorted batches of mixed prompt lengths pad less than the file's order.
        assert row["padding_waste"]["sorted"] <= row["padding_waste"]["engine"]
    assert "| mixed | 8 |" in (tmp_path / "generate_bench.md").read_text()


def test_vllms_published_step_times_become_fractions_of_the_same_roofline():
    from workbook.bench import published
    light_load, v1 = published.vllm_decode_fractions()
    # Llama-3.1-8B's bf16 weights a decode step reads (the untied input embedding only gathers rows), at 3.35 TB/s.
    floor = (8_030_261_248 - 128_256 * 4096) * 2 / 3.35e12
    assert light_load["fraction"] == pytest.approx(floor / 0.013) and v1["fraction"] == pytest.approx(floor / 0.005)
    assert "34%" in published.vllm_line() and "blog.vllm.ai/2024/09/05/perf-update" in published.vllm_line()


def test_the_mfu_figure_draws_a_point_without_an_mfu_beside_those_with_one():
    """A GPU sweep: a baseline with no timed step has no MFU while the workbook's points have one."""
    from workbook import benchmark_plots
    points = [{**train_point(4, 30000.0), "mfu": 0.41, "peak_memory_bytes": 2**34, "predicted_peak_bytes": 2**34},
              {**train_point(4, 0.0), "loop": "HF Trainer (transformers)", "mfu": None, "peak_memory_bytes": None}]
    figure = benchmark_plots.mfu_bars({"profile": "h100", "training": {"model": "Llama-3.2-1B", "points": points}})
    heights = [bar.get_height() for bar in figure.axes[0].patches]
    assert heights == pytest.approx([41.0, 0.0])


def test_the_memory_panel_of_a_cpu_sweep_is_in_mib_and_shows_every_planner_mark():
    from workbook import benchmark_plots
    points = [{**train_point(8, 13000.0), "mfu": None, "peak_memory_bytes": None, "predicted_peak_bytes": 36 * 2**20}]
    figure = benchmark_plots.mfu_bars({"profile": "cpu", "training": {"model": "tiny", "points": points}},
                                      capacity_bytes=24 * 2**30)
    memory_axis = figure.axes[1]
    assert memory_axis.get_ylabel().startswith("peak memory, MiB") and "off this scale" in memory_axis.get_ylabel()
    assert memory_axis.get_ylim()[1] > 36  # the 36 MiB mark sits inside the panel, not on its edge
    assert memory_axis.get_title(loc="left") == benchmark_plots.NO_PEAK_TEXT


def test_a_training_point_that_diverges_is_recorded_and_the_sweep_goes_on(tmp_path):
    import importlib
    from workbook import params as params_module, training
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    settings = bench.BenchSettings.from_params({**params_module.load_all()["cpu"], "bench_train_micro_batches": "2",
                                                "bench_train_steps": 3})
    point = {"micro_batch_size": 2, **training_sweep.PLAIN}

    def diverges(config, output_dir):
        raise training.TrainingDiverged("the loss is nan at step 2 (learning rate 1e+09): training diverged")
    said = []
    measured = training_sweep._measure(settings, point, tmp_path, diverges, said.append)
    assert measured == {"skipped": "stopped: training diverged (the loss is nan at step 2 (learning rate 1e+09))"}
    assert said and "diverged" in said[0]


def test_a_point_that_raises_is_recorded_as_failed_and_every_other_point_is_measured(
        tiny_model_path, tmp_path, monkeypatch):
    # On a lent GPU a path that never ran before (flex attention, a compile) may fail: that point says so,
    # the others are measured, the report is written, and the run exits 1 ('incomplete'), not 0.
    import importlib
    from workbook import notebook
    from workbook.bench import report
    training_sweep = importlib.import_module("workbook.bench.training_sweep")
    monkeypatch.setattr(notebook, "new_run_dir", lambda name: (tmp_path / name).mkdir() or tmp_path / name)
    original = training_sweep.training_point

    def checkpointing_breaks(params, point, work_dir, log):
        if point["grad_checkpointing"]:
            raise RuntimeError("no kernel for this on this GPU")
        return original(params, point, work_dir, log)
    monkeypatch.setattr(training_sweep, "training_point", checkpointing_breaks)
    assert report.cli_main("cpu", ["bench_strategies=seed-after", "bench_examples=4", "bench_max_new_tokens=2",
                                   "bench_repeats=1", "bench_train_micro_batches=2", "bench_train_steps=3",
                                   "bench_train_baselines=none"]) == 1
    run_dir = tmp_path / "bench-cpu"
    written = json.loads((run_dir / "benchmark.json").read_text())
    plain, checkpointed, *_ = written["training"]["points"]
    assert plain["tokens_per_second"] > 0 and "error" not in plain
    assert checkpointed["error"] == "RuntimeError: no kernel for this on this GPU"
    assert checkpointed["skipped"].startswith("failed: RuntimeError: no kernel")
    assert "failed: RuntimeError" in (run_dir / "benchmark.md").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "incomplete" and "no kernel for this" in manifest["error"]


def test_a_warm_up_that_fails_for_a_reason_other_than_memory_is_not_split_and_retried(monkeypatch):
    # A compiled path that fails at every size would otherwise be retried at ~2x the batch sizes, each a new
    # compile, before the point gives up (out of memory is still split, as the engine does).
    from workbook import generation
    generation_sweep = importlib.import_module("workbook.bench.generation_sweep")
    calls = []

    class Broken:
        prompts_per_call = 8

        def generate(self, prompts):
            calls.append(len(prompts))
            raise RuntimeError("no kernel")

    setup = type("Setup", (), {"model": None, "settings": None, "prompts": list(range(20))})()
    monkeypatch.setattr(generation, "make_backend", lambda *args: Broken())
    with pytest.raises(RuntimeError, match="no kernel"):
        generation_sweep._engine_pass(setup, {"backend": "static", "batch_size": 8, "sort": False})
    assert calls == [8]
