"""The preset table: real architectures by name, counted exactly, and local directories by path."""

import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workbook.presets import build_on_meta_device, count_parameters, load_config, preset_names

# Published parameter counts (model cards / safetensors metadata of each Hugging Face repository).
PUBLISHED_PARAMETER_COUNTS = {
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Llama-3.2-1B": 1_235_814_400,
    "Llama-3.2-3B": 3_212_749_824,
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-32B": 32_763_876_352,
    "Mistral-7B-v0.1": 7_241_732_096,
    # Beyond Llama, one per family (the Hub's safetensors parameter count of each repository, which
    # these match when counted by hand from the published config.json):
    "Mixtral-8x7B-v0.1": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1, "46.7B params"
    "Qwen1.5-MoE-A2.7B": 14_315_784_192,  # Qwen/Qwen1.5-MoE-A2.7B, "14.3B params"
    "Qwen3-30B-A3B": 30_532_122_624,  # Qwen/Qwen3-30B-A3B, "30.5B params"
    "Qwen3-8B": 8_190_735_360,  # Qwen/Qwen3-8B, "8.19B params"
    "gemma-2-9b": 9_241_705_984,  # google/gemma-2-9b, "9.24B params"
    "gemma-3-1b-pt": 999_885_952,  # google/gemma-3-1b-pt, "1000M params"
    "Phi-3-mini-4k-instruct": 3_821_079_552,  # microsoft/Phi-3-mini-4k-instruct, "3.82B params"
    "DeepSeek-V2-Lite": 15_706_484_224,  # deepseek-ai/DeepSeek-V2-Lite, "15.7B params"
}


@pytest.mark.parametrize("name, published", PUBLISHED_PARAMETER_COUNTS.items())
def test_parameter_count_equals_the_published_count(name, published):
    assert count_parameters(load_config(name)) == published


def test_counting_70b_on_the_meta_device_is_fast():
    config = load_config("Llama-3.1-70B")
    config.num_hidden_layers = 81  # a config not built before in this session, so not cached
    started = time.perf_counter()
    count_parameters(config)
    assert time.perf_counter() - started < 5


def test_tied_embeddings_are_counted_once():
    tied = load_config("Llama-3.2-1B")
    untied = load_config("Llama-3.2-1B")
    untied.tie_word_embeddings = False
    assert tied.tie_word_embeddings
    assert count_parameters(untied) - count_parameters(tied) == tied.vocab_size * tied.hidden_size


def test_count_equals_a_real_model_built_on_cpu():
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_names_are_case_insensitive_and_accept_the_hub_id():
    reference = load_config("Llama-3.1-8B").to_dict()
    assert load_config("llama-3.1-8b").to_dict() == reference
    assert load_config("META-LLAMA/Llama-3.1-8B").to_dict() == reference


def test_preset_values_match_the_published_configs():
    llama = load_config("Llama-3.1-8B")
    assert (llama.num_key_value_heads, llama.max_position_embeddings) == (8, 131072)
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.rope_parameters["factor"] == 8.0
    assert load_config("Llama-3.2-1B").rope_parameters["factor"] == 32.0
    assert load_config("Mistral-7B-v0.1").sliding_window == 4096
    assert load_config("Qwen2.5-7B").sliding_window is None  # use_sliding_window is false
    assert load_config("Qwen2.5-0.5B").tie_word_embeddings
    assert not load_config("Qwen2.5-7B").tie_word_embeddings


def test_qwen2_layers_have_query_key_value_biases():
    attention = build_on_meta_device(load_config("Qwen2.5-0.5B")).model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None


def test_tiny_preset_is_the_workbook_tiny_model():
    tiny_model = pytest.importorskip("workbook.tiny_model")
    assert "tiny" in preset_names()
    assert load_config("tiny").to_dict() == tiny_model.tiny_config().to_dict()
    assert load_config("TINY").num_key_value_heads < load_config("tiny").num_attention_heads


def test_preset_names_lists_every_preset():
    assert set(PUBLISHED_PARAMETER_COUNTS) | {"tiny"} == set(preset_names())


def test_unknown_name_lists_the_presets():
    with pytest.raises(ValueError) as error:
        load_config("llama-9")
    message = str(error.value)
    assert "'llama-9'" in message
    for name in preset_names():
        assert name in message


def test_local_directory_reads_config_json_only(tmp_path):
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)  # config.json, no weights
    loaded = load_config(str(tmp_path))
    assert loaded.hidden_size == 64 and loaded.num_key_value_heads == 2
    assert count_parameters(loaded) == count_parameters(config)


def test_directory_without_config_json_says_so(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_config(tmp_path)


def test_meta_models_hold_no_storage():
    model = build_on_meta_device(load_config("Llama-3.1-8B"))
    assert all(p.device == torch.device("meta") for p in model.parameters())


@pytest.mark.parametrize("text, message", [
    ("", "config.json: empty"),
    ('{"model_type": "llama", "hidden_size": 64,', "config.json: not valid JSON"),
    ('["llama"]', "expected a JSON object with a 'model_type'"),
])
def test_a_broken_config_json_is_named_not_a_traceback(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "4096"}, "config.json: 'hidden_size' is \"4096\" \\(str\\); expected a positive integer"),
    ({"num_key_value_heads": 2.0}, "config.json: 'num_key_value_heads' is 2.0 \\(float\\)"),
    ({"vocab_size": True}, "config.json: 'vocab_size' is true \\(bool\\)"),
    ({"num_hidden_layers": 0}, "config.json: 'num_hidden_layers' is 0; expected a positive integer"),
    ({"intermediate_size": -8}, "config.json: 'intermediate_size' is -8; expected a positive integer"),
    ({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4},
     "config.json: 'num_attention_heads' 6 is not a multiple of 'num_key_value_heads' 4"),
])
def test_impossible_sizes_are_refused_with_the_key(tmp_path, change, message):
    from workbook.planner import model_shape
    values = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **change}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=message):
        model_shape(str(tmp_path))


def test_impossible_sizes_of_a_config_object_are_refused_with_the_key():
    from workbook.planner import model_shape
    config = load_config("llama-3.2-1b")
    config.num_key_value_heads = 5
    with pytest.raises(ValueError, match="num_attention_heads 32 is not a multiple of num_key_value_heads 5"):
        model_shape(config)
