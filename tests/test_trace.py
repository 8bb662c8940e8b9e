"""The peak of the real step, measured without a GPU (planner.trace): on fake tensors the workbook's own
training step and generation hold, op by op, the bytes the same code holds on real tensors; what cannot
be traced is named, and a model the workbook cannot train or generate with is refused."""

import json

import pytest
import torch

from workbook import cli
from workbook.planner import trace
from workbook.training.config import TrainConfig


def tiny_run(**settings) -> TrainConfig:
    settings = {"dtype": "fp32", "precision": "mixed", "padding": "packing", "optimizer": "adamw", **settings}
    return TrainConfig(model="tiny", data_path="", data_description="", output_dir="", max_seq_length=64,
                       micro_batch_size=2, **settings)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    {},  # fp32 full fine-tune, packed rows (document_sdpa), foreach AdamW
    {"dtype": "bf16"},  # mixed precision: fp32 master weights, autocast's bf16 weight copies
    {"dtype": "bf16", "lora_rank": 4, "grad_checkpointing": True},  # PEFT's adapters, recomputed layers
    {"loss_chunk_tokens": 16, "padding": "length_grouped", "gradient_accumulation_steps": 2},
], ids=["full-fp32", "mixed-bf16", "lora-checkpointed", "chunked-loss-accumulated"])
def test_the_traced_training_peak_equals_the_same_step_on_real_tensors_to_the_byte(settings):
    config = tiny_run(**settings)
    fake = trace.trace_training(config, fake=True, on_gpu=False)
    real = trace.trace_training(config, fake=False, on_gpu=False)
    assert (fake.peak_bytes, fake.phase, fake.by_kind) == (real.peak_bytes, real.phase, real.by_kind)
    assert fake.phase_peaks == real.phase_peaks
    assert sum(fake.by_kind.values()) == fake.peak_bytes
    # The peak is a moment: optimizer states exist (the second step), and with gradients set to None
    # between steps no gradient is alive while the saved activations peak in backward.
    assert fake.by_kind["optimizer_states"] > 0
    assert fake.phase == "backward" and fake.by_kind["activations"] > 0


@pytest.mark.parametrize("backend", ["static", "static-compiled"])
def test_traced_generation_holds_what_real_generation_holds_in_each_phase(backend):
    runs = [trace.trace_generation("tiny", batch_size=3, prompt_len=20, new_tokens=8, dtype="fp32", backend=backend,
                                   fake=fake) for fake in (True, False)]
    fake, real = runs
    assert (fake.peak_bytes, fake.phase, fake.by_kind) == (real.peak_bytes, real.phase, real.by_kind)
    assert fake.phase_peaks == real.phase_peaks
    assert set(fake.phase_peaks) == set(trace.GENERATION_PHASES)
    assert fake.by_kind["kv_cache"] > 0


def test_an_op_that_cannot_run_on_fake_tensors_is_named_with_the_module_that_ran_it(monkeypatch):
    from transformers.models.llama import modeling_llama
    forward = modeling_llama.LlamaMLP.forward

    def reads_a_value(self, x):
        if float(x.sum()) > 1e30:  # a value no fake tensor has
            return x
        return forward(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", reads_a_value)
    with pytest.raises(trace.TraceError, match=r"in model\.layers\.0\.mlp \(LlamaMLP\)"):
        trace.trace_training(tiny_run(), on_gpu=False)


def test_plan_trace_json_holds_the_peak_its_phase_and_bytes_by_kind_beside_the_plan(capsys):
    code = cli.main(["plan", "--profile", "cpu", "--model", "tiny", "--mode", "train", "--seq-len", "64",
                     "--batch-size", "2", "--trace", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    traced = planned["trace"]
    assert traced["peak_bytes"] == sum(traced["by_kind"].values()) > 0
    assert traced["phase"] in trace.TRAINING_PHASES and traced["seconds"] > 0
    beside = traced["beside_plan"]
    assert beside["trace_peak_bytes"] == traced["peak_bytes"]
    terms = {term["name"]: term["bytes"] for term in planned["breakdown"]}
    assert beside["plan_tensor_bytes"] == sum(value for name, value in terms.items() if name not in trace.OVERHEAD_TERMS)


def test_a_plan_whose_step_cannot_be_traced_says_why_and_still_shows_the_plan(capsys):
    code = cli.main(["plan", "--profile", "cpu", "--model", "tiny", "--mode", "train", "--seq-len", "64",
                     "--batch-size", "2", "--dtype", "int4", "--lora-rank", "4", "--trace"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert "total (predicted peak)" in out
    assert "trace: dtype int4" in out and "workbook train does not run it" in out


@pytest.mark.parametrize("config_name, kind", [("BertConfig", "encoder-only"), ("T5Config", "encoder-decoder")])
def test_an_encoder_only_or_encoder_decoder_config_is_refused_with_exit_2_and_what_is_planned_instead(
        tmp_path, capsys, config_name, kind):
    import transformers
    getattr(transformers, config_name)().save_pretrained(tmp_path)
    for mode in ("train", "generate"):
        assert cli.main(["plan", "--profile", "h100", "--mode", mode, "--model", str(tmp_path)]) == 2
        error = capsys.readouterr().err
        assert f"is an {kind} model" in error and "decoder-only" in error and "preset" in error


def test_the_tracker_counts_a_storage_once_and_frees_it_when_its_last_view_dies():
    from workbook.planner.live_tensors import LiveTensors
    with LiveTensors() as tracker:
        whole = torch.ones(256)
        view = whole[:10]
        assert tracker.total == 1024
        del whole
        assert tracker.total == 1024  # the view keeps the storage alive
        del view
        assert tracker.total == 0
    assert tracker.peak.bytes == 1024


@pytest.mark.slow
def test_an_auto_batch_by_trace_is_the_largest_whose_traced_peak_fits_and_is_confirmed_by_a_trace():
    config = tiny_run(dtype="bf16")
    traced: dict[int, int] = {}

    def trace_at(batch):
        import dataclasses
        result = trace.trace_training(dataclasses.replace(config, micro_batch_size=batch), on_gpu=False)
        traced[batch] = result.peak_bytes
        return result

    overhead, fragmentation = 1_000_000, 0.05
    # a budget between batch 5's traced peak and batch 6's, with the profile's constants on top
    line = [trace_at(1).peak_bytes, trace_at(2).peak_bytes]
    per_row = line[1] - line[0]
    budget = int((line[0] + 4.5 * per_row) * (1 + fragmentation)) + overhead
    traced.clear()
    chosen = trace.largest_batch_by_trace(trace_at, budget, overhead, fragmentation)
    assert chosen["batch"] == 5 and chosen["bytes_per_row"] == per_row
    assert chosen["confirmed_peak_bytes"] == traced[5]  # confirmed by a trace at the chosen batch
    assert traced[5] * (1 + fragmentation) + overhead <= budget


def test_a_qlora_plan_says_it_plans_a_run_the_workbook_cannot_make():
    from workbook.planner.training import plan_train
    plan = plan_train("Llama-3.2-1B", micro_batch_size=1, seq_len=512, gpu_memory_bytes=80 << 30, dtype="int4",
                      lora_rank=16)
    assert any("QLoRA" in note and "cannot make" in note for note in plan.notes)
    assert not any("QLoRA" in note for note in plan_train("Llama-3.2-1B", micro_batch_size=1, seq_len=512,
                                                          gpu_memory_bytes=80 << 30, dtype="bf16", lora_rank=16).notes)
