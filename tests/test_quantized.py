"""The QLoRA plan (int4 base with LoRA): bitsandbytes' 4-bit weights, their quantization state, what a
4-bit layer keeps for backward and the weight it dequantizes, counted by hand on a small Llama."""

import json

import pytest
from transformers import LlamaConfig

from workbook import cli
from workbook.planner import plan_train
from workbook.planner.quantized import four_bit_base_terms, legacy_saved_input_bytes_per_token
from workbook.planner.shape import model_shape
from workbook.units import GiB

# hidden 128, kv width 2 x 32 = 64, intermediate 256, 2 layers, untied 1,000-token vocabulary
CONFIG = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
# Weights per decoder layer: q 128x128, k 128x64, v 128x64, o 128x128, gate/up 128x256, down 256x128.
LAYER_WEIGHTS = (16384, 8192, 8192, 16384, 32768, 32768, 32768)
BF16_PARAMS = 1000 * 128 * 2 + 2 * 2 * 128 + 128  # embeddings, lm_head, 2 norms per layer and the final one
COMMON = dict(micro_batch_size=2, seq_len=64, gpu_memory_bytes=80 * GiB, lora_rank=4)


def terms(plan) -> dict[str, int]:
    return {term.name: term.bytes for term in plan.terms}


def test_int4_weights_and_quant_state_are_counted_as_bitsandbytes_stores_them():
    plan = plan_train(CONFIG, dtype="int4", **COMMON)
    by_name = terms(plan)
    # Two 4-bit values per byte; everything that is no quantized Linear stays bf16.
    assert by_name["weights"] == 2 * sum(n // 2 for n in LAYER_WEIGHTS) + BF16_PARAMS * 2
    # An fp32 absmax per 64 weights and the 16-value fp32 NF4 code, per 4-bit layer.
    assert by_name["quant_state"] == 2 * sum(n // 64 * 4 + 16 * 4 for n in LAYER_WEIGHTS)
    # The plan's weights on the GPU include the state (the batch finder and the verdict see them).
    assert plan.weights_bytes == by_name["weights"] + by_name["quant_state"] + by_name["lora_adapters"]


def test_double_quantization_keeps_uint8_absmax_and_a_second_level_per_256_blocks():
    by_name = terms(plan_train(CONFIG, dtype="int4", double_quant=True, **COMMON))
    # uint8 absmax per block + fp32 absmax per 256 blocks + the fp32 offset + the 256-value code + the NF4 code.
    per_layer = [n // 64 + -(-(n // 64) // 256) * 4 + 4 + 256 * 4 + 16 * 4 for n in LAYER_WEIGHTS]
    assert by_name["quant_state"] == 2 * sum(per_layer)
    # The dequantized weight's temporary also dequantizes the absmax to fp32 (the fallback: two copies).
    assert by_name["dequantized_weight"] == 32768 * 2 + 2 * (32768 // 64) * 4


def test_on_a_large_model_the_state_costs_the_qlora_papers_bits_per_parameter():
    shape = model_shape("Llama-3.1-8B")
    for double_quant, bits in ((False, 0.5), (True, 0.127)):
        weights, state = four_bit_base_terms(shape, double_quant)
        quantized = sum(layer.in_features * layer.out_features for layer in shape.linear_layers
                        if not layer.is_output_embedding)
        assert 8 * state.bytes / quantized == pytest.approx(bits, abs=0.001)


def test_a_4bit_layer_keeps_no_input_for_backward_and_dequantizes_its_weight_once_at_a_time():
    int4, bf16 = (plan_train(CONFIG, dtype=dtype, **COMMON) for dtype in ("int4", "bf16"))
    # bitsandbytes >= 0.44 MatMul4Bit saves (None, B): the saved activations are a bf16 frozen base's.
    assert terms(int4)["activations"] == terms(bf16)["activations"]
    # One temporary: the largest 4-bit weight (gate/up/down, 128 x 256) in bf16.
    assert terms(int4)["dequantized_weight"] == 32768 * 2
    assert "dequantized_weight" not in terms(bf16) and "quant_state" not in terms(bf16)


def test_the_inputs_older_bitsandbytes_kept_per_4bit_layer_are_named_in_the_notes():
    # Per decoder layer the 4-bit layers read four tensors: the attention norm's output (q, k, v share it),
    # the attention output (o), the MLP norm's output (gate, up) and the SwiGLU product (down), in bf16.
    per_token = 2 * (128 + 128 + 128 + 256) * 2
    assert legacy_saved_input_bytes_per_token(model_shape(CONFIG), 2) == per_token
    plan = plan_train(CONFIG, dtype="int4", **COMMON)
    tokens = COMMON["micro_batch_size"] * COMMON["seq_len"]
    assert any("0.43 and older" in note and f"{per_token * tokens:,} B more" in note for note in plan.notes)
    checkpointed = plan_train(CONFIG, dtype="int4", grad_checkpointing=True, **COMMON)
    assert any(f"{per_token * tokens // 2:,} B more" in note for note in checkpointed.notes)  # one layer's


def test_the_int4_plan_says_the_workbook_cannot_make_the_run_in_its_lines_and_json(capsys):
    plan = plan_train(CONFIG, dtype="int4", **COMMON)
    assert any("planning a run the workbook cannot make (QLoRA needs bitsandbytes on CUDA" in note
               for note in plan.notes)
    assert plan.settings["workbook_can_run"] is False
    code = cli.main(["plan", "--profile", "cpu", "--model", "tiny", "--mode", "train", "--seq-len", "64",
                     "--batch-size", "2", "--dtype", "int4", "--lora-rank", "4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert any("cannot make" in note and "bitsandbytes on CUDA" in note for note in planned["notes"])
    assert planned["settings"]["workbook_can_run"] is False
    assert {"quant_state", "dequantized_weight"} <= {term["name"] for term in planned["breakdown"]}
    cli.main(["plan", "--profile", "cpu", "--model", "tiny", "--mode", "train", "--seq-len", "64",
              "--batch-size", "2", "--dtype", "int4", "--lora-rank", "4"])
    out = capsys.readouterr().out
    assert "note: dtype int4 with LoRA (QLoRA): planning a run the workbook cannot make" in out
    assert "quant_state" in out


def test_plan_double_quant_flag_plans_the_smaller_quant_state_and_is_refused_without_int4(capsys):
    args = ["plan", "--profile", "cpu", "--model", "tiny", "--mode", "train", "--seq-len", "64", "--batch-size", "2",
            "--lora-rank", "4", "--json"]

    def planned(*extra) -> dict:
        cli.main(args + list(extra))
        return json.loads(capsys.readouterr().out)

    plain, double = planned("--dtype", "int4"), planned("--dtype", "int4", "--double-quant")
    state = {name: {term["name"]: term["bytes"] for term in plan["breakdown"]}["quant_state"]
             for name, plan in (("plain", plain), ("double", double))}
    assert double["settings"]["double_quant"] is True and plain["settings"]["double_quant"] is False
    assert state["double"] < state["plain"]
    assert cli.main(args + ["--dtype", "bf16", "--double-quant"]) == 2
    assert "double_quant quantizes 4-bit weights' absmax and needs dtype int4 (not bf16)" in capsys.readouterr().err
