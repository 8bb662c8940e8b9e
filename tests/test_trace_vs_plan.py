"""The fast analytical plan against the fake-tensor trace of the same step (planner.trace): the plan models
the peak as a moment (what is alive when), so on every training setting and in generation it lands within 2%
of the bytes the workbook's own code holds. Presets are shrunk to two layers and a small width, so each trace
takes seconds; the layers keep their preset's kind (attention, tied embedding, mixture of experts)."""

import pytest

from workbook import presets
from workbook.planner import trace
from workbook.planner.generation import plan_generate
from workbook.planner.training import plan_train
from workbook.training.config import TrainConfig

TOLERANCE = 0.02
SEQ_LEN, MICRO_BATCH = 512, 2
# Llama-3.2-1B: dense, tied embedding; Mistral-7B: dense, untied; Qwen3-30B-A3B: mixture of experts (its
# experts multiply in fp32 under mixed precision), per-head q/k norms.
PRESETS = ["Llama-3.2-1B", "Mistral-7B-v0.1", "Qwen3-30B-A3B"]
TRAINING = {
    "mixed bf16": {},
    "pure bf16": {"precision": "bf16"},
    "checkpointing": {"grad_checkpointing": True},
    "chunked loss": {"loss_chunk_tokens": 256},
    "LoRA": {"lora_rank": 8},
    "LoRA, checkpointing": {"lora_rank": 8, "grad_checkpointing": True},
    "gradient accumulation": {"gradient_accumulation_steps": 2},
}


def shrunk(preset: str, directory) -> str:
    """``preset``'s config at two layers, hidden 256, a 4096-token vocabulary, saved in ``directory``."""
    config = presets.load_config(preset)
    sizes = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, moe_intermediate_size=128, num_experts=8,
                 num_experts_per_tok=2)
    for key, value in sizes.items():
        if key in ("num_hidden_layers", "hidden_size", "vocab_size") or getattr(config, key, None) is not None:
            setattr(config, key, value)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = []
    config.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {preset: shrunk(preset, tmp_path_factory.mktemp(preset)) for preset in PRESETS}


@pytest.mark.parametrize("setting", TRAINING)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_training_plan_is_within_2_percent_of_the_traced_peak(models, preset, setting):
    fields = {"dtype": "bf16", "precision": "mixed", **TRAINING[setting]}
    config = TrainConfig(model=models[preset], data_path="", data_description="", output_dir="",
                         max_seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH, padding="packing", optimizer="adamw",
                         **fields)
    traced = trace.trace_training(config, on_gpu=True)
    plan = plan_train(presets.load_config(models[preset]), micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN,
                      gpu_memory_bytes=1 << 50, dtype="bf16", mixed_precision=config.precision == "mixed",
                      grad_checkpointing=config.grad_checkpointing, lora_rank=config.lora_rank,
                      attn_implementation=traced.settings["attention"], loss_chunk_tokens=config.loss_chunk_tokens,
                      gradient_accumulation_steps=config.gradient_accumulation_steps, overhead_bytes=0,
                      fragmentation_fraction=0.0)
    assert plan.total_bytes == pytest.approx(traced.peak_bytes, rel=TOLERANCE), (
        f"plan {plan.settings['peak_moment']}: {plan.settings['moments']}; trace {traced.phase}: {traced.by_kind}")
    # A term not alive at the peak stays in the plan at 0 bytes and says so.
    for term in plan.terms:
        if term.bytes == 0 and plan.settings["bytes_when_alive"].get(term.name):
            assert term.explanation.startswith("0 at the peak")


@pytest.mark.parametrize("backend", ["static", "static-compiled"])
def test_the_generation_plan_is_within_2_percent_of_the_traced_peak(models, backend):
    model = models["Llama-3.2-1B"]
    traced = trace.trace_generation(model, batch_size=2, prompt_len=512, new_tokens=64, backend=backend)
    plan = plan_generate(presets.load_config(model), batch_size=2, prompt_len=512, new_tokens=64,
                         gpu_memory_bytes=1 << 50, attn_implementation=traced.settings["attention"],
                         static_cache=backend == "static-compiled", overhead_bytes=0, fragmentation_fraction=0.0)
    assert plan.total_bytes == pytest.approx(traced.peak_bytes, rel=TOLERANCE)


def test_gradients_are_not_alive_at_the_start_of_backward_unless_they_are_accumulated():
    common = dict(micro_batch_size=8, seq_len=2048, gpu_memory_bytes=1 << 50, overhead_bytes=0, fragmentation_fraction=0.0)
    plan = plan_train("Llama-3.2-1B", **common)
    terms = {term.name: term for term in plan.terms}
    assert plan.settings["peak_moment"] == "start of backward"
    assert terms["gradients"].bytes == 0 and "set to None" in terms["gradients"].explanation
    accumulated = plan_train("Llama-3.2-1B", gradient_accumulation_steps=4, **common)
    assert {term.name: term.bytes for term in accumulated.terms}["gradients"] == 4 * 1_235_814_400
    assert accumulated.total_bytes == plan.total_bytes + 4 * 1_235_814_400
