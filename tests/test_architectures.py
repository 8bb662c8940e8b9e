"""The planner beyond Llama: each family a user brings, shrunken from a released model's config and built on
CPU: parameters exact, the KV cache of a real generate() exact, one layer's saved activations within 2%;
and the architectures it does not model refused with what is missing."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from workbook import presets
from workbook.planner import kv_cache_bytes, model_shape, training_activation_bytes_per_layer
from workbook.planner.architectures import training_attention
from workbook.planner.exact_checks import ACTIVATION_CHECK_BATCH, ACTIVATION_CHECK_SEQ_LEN, _saved_activation_bytes

# Each family's released config with its sizes shrunk (ratios and switches kept), so a CPU builds it in a blink.
SMALL = {"hidden_size": 64, "vocab_size": 256, "max_position_embeddings": 256}
SHRUNKEN = {
    "DeepSeek-V2-Lite": {**SMALL, "intermediate_size": 160, "moe_intermediate_size": 32, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "n_routed_experts": 8, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                         "qk_nope_head_dim": 16, "v_head_dim": 16, "bos_token_id": 1, "eos_token_id": 2},
    "Mixtral-8x7B-v0.1": {**SMALL, "intermediate_size": 224, "num_attention_heads": 4, "num_key_value_heads": 1},
    "Qwen1.5-MoE-A2.7B": {**SMALL, "intermediate_size": 176, "moe_intermediate_size": 48,
                          "shared_expert_intermediate_size": 176, "num_experts": 15, "num_attention_heads": 4,
                          "num_key_value_heads": 4, "bos_token_id": 1, "eos_token_id": 2},
    "Qwen3-30B-A3B": {**SMALL, "intermediate_size": 192, "moe_intermediate_size": 24, "num_experts": 16,
                      "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16, "bos_token_id": 1,
                      "eos_token_id": 2},
    "Qwen3-8B": {**SMALL, "intermediate_size": 192, "num_attention_heads": 8, "num_key_value_heads": 2,
                 "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2},
    "Qwen2.5-0.5B": {**SMALL, "intermediate_size": 348, "num_attention_heads": 7, "num_key_value_heads": 1,
                     "hidden_size": 70, "bos_token_id": 1, "eos_token_id": 2},
    "gemma-2-9b": {**SMALL, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8},
    "gemma-3-1b-pt": {**SMALL, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 1,
                      "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8},
    "Phi-3-mini-4k-instruct": {**SMALL, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "sliding_window": 255, "original_max_position_embeddings": 256, "bos_token_id": 1,
                               "eos_token_id": 2, "pad_token_id": 0},
}


def shrunken(name: str, layers: int = 2):
    values = copy.deepcopy(presets.PRESETS[name])
    values.update(SHRUNKEN[name], num_hidden_layers=layers)
    if "first_k_dense_replace" in values:
        values["first_k_dense_replace"] = 0  # every layer routed: one layer's activations are the MoE layer's
    values.pop("_name_or_path")
    return AutoConfig.for_model(values.pop("model_type"), **values)


def built(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def cache_storage_bytes(cache) -> int:
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", SHRUNKEN)
def test_parameters_are_exact(name):
    config = shrunken(name)
    assert model_shape(config).parameters == sum(p.numel() for p in built(config).parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", SHRUNKEN)
def test_kv_cache_of_a_real_generate_is_exact(name):
    config = shrunken(name, layers=3)  # Gemma: sliding and full layers, windows shorter than the sequence
    model = built(config).eval()
    batch, prompt_len, new_tokens = 2, 9, 6
    with torch.no_grad():
        output = model.generate(torch.randint(4, 100, (batch, prompt_len)),
                                attention_mask=torch.ones(batch, prompt_len, dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                return_dict_in_generate=True, pad_token_id=0)
    assert output.sequences.shape[1] == prompt_len + new_tokens
    assert cache_storage_bytes(output.past_key_values) == kv_cache_bytes(
        config, "fp32", batch_size=batch, tokens=prompt_len + new_tokens - 1)


def test_deepseek_caches_the_compressed_latent_not_the_keys_and_values():
    shape = model_shape("DeepSeek-V2-Lite")
    # kv_lora_rank 512 + qk_rope_head_dim 64 per layer, not 16 heads x (192 key + 128 value) expanded
    assert shape.architecture.kv_cache_values_per_token_per_layer == 512 + 64
    assert kv_cache_bytes(shape, "bf16", batch_size=1, tokens=1) == 27 * 576 * 2


ACTIVATION_CHECKED = ["Mixtral-8x7B-v0.1", "Qwen1.5-MoE-A2.7B", "Qwen3-30B-A3B", "Qwen3-8B", "Qwen2.5-0.5B",
                      "Phi-3-mini-4k-instruct", "gemma-2-9b", "gemma-3-1b-pt", "DeepSeek-V2-Lite"]
MLA_PROJECTIONS = "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"


def cpu_attention(config) -> str:
    """The attention the model runs by default on CPU: sdpa, eager for Gemma-2 (sdpa refused, soft-capping),
    sdpa's math kernel for DeepSeek (values narrower than queries and keys)."""
    return training_attention(model_shape(config), "sdpa", "length_grouped", ACTIVATION_CHECK_SEQ_LEN, on_gpu=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ACTIVATION_CHECKED)
def test_one_layers_saved_activations_are_within_2_percent_of_the_plan(name):
    # The method of planner/exact_checks.py: autograd's saved tensors of a 2-layer model minus a 1-layer one,
    # pure fp32, the attention the model runs by default.
    measured = (_saved_activation_bytes(built(shrunken(name, layers=2)).train())
                - _saved_activation_bytes(built(shrunken(name, layers=1)).train()))
    planned = training_activation_bytes_per_layer(
        shrunken(name), batch_size=ACTIVATION_CHECK_BATCH, seq_len=ACTIVATION_CHECK_SEQ_LEN, dtype="fp32",
        mixed_precision=False, attn_implementation=cpu_attention(shrunken(name)))
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("name, target_modules", [(name, "") for name in ACTIVATION_CHECKED]
                         + [("DeepSeek-V2-Lite", MLA_PROJECTIONS)])
def test_one_lora_layers_saved_activations_are_within_2_percent_of_the_plan(name, target_modules):
    # As above, with PEFT's rank-4 adapters on every linear projection (or the named ones) of a frozen fp32 base:
    # frozen norms (Gemma's four, Qwen3's q/k norms, DeepSeek's latent norms), the attention core, frozen experts,
    # each adapter's input and output.
    pytest.importorskip("peft")
    from workbook import models
    from workbook.planner.formulas import training_precision
    from workbook.planner.lora_activations import lora_layer_bytes_per_token
    measured = (_saved_activation_bytes(models.with_lora(built(shrunken(name, layers=2)).train(), 4, target_modules))
                - _saved_activation_bytes(models.with_lora(built(shrunken(name, layers=1)).train(), 4, target_modules)))
    planned = ACTIVATION_CHECK_BATCH * ACTIVATION_CHECK_SEQ_LEN * lora_layer_bytes_per_token(
        model_shape(shrunken(name)), training_precision("fp32", False, lora=True), cpu_attention(shrunken(name)),
        ACTIVATION_CHECK_SEQ_LEN, rank=4, target_modules=target_modules, autocast=False)
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


def test_deepseeks_sdpa_is_planned_with_the_kernel_it_runs():
    shape = model_shape(shrunken("DeepSeek-V2-Lite"))
    assert training_attention(shape, "sdpa", "length_grouped", 64, on_gpu=False) == "sdpa_math"  # CPU: math kernel
    assert training_attention(shape, "sdpa", "length_grouped", 64, on_gpu=True) == "sdpa"  # GPU: memory-efficient
    sdpa, math = (training_activation_bytes_per_layer(shape, batch_size=1, seq_len=64, attn_implementation=name)
                  for name in ("sdpa", "sdpa_math"))
    assert math > sdpa  # the math kernel keeps the probabilities


def test_mixed_dense_and_routed_layers_are_each_planned_at_their_size():
    from workbook.planner.formulas import decoder_activation_bytes_per_token, layer_activation_bytes_per_token
    from workbook.planner.formulas import training_precision
    shape = model_shape("DeepSeek-V2-Lite")  # layer 0 dense (intermediate 10944), 26 routed layers
    precision = training_precision("bf16", True, lora=False)
    dense, routed = (layer_activation_bytes_per_token(shape, precision, "sdpa", 1024, routed=kind)
                     for kind in (False, True))
    assert dense != routed
    assert decoder_activation_bytes_per_token(shape, precision, "sdpa", 1024) == dense + 26 * routed


def test_quantized_mixture_of_experts_keeps_its_experts_in_bf16():
    from workbook.planner import weights_bytes
    shape = model_shape("Mixtral-8x7B-v0.1")
    experts = shape.architecture.moe.expert_parameters
    assert experts == 32 * 8 * 3 * 4096 * 14336
    # Experts are 3-D tensors (no nn.Linear): bitsandbytes leaves them bf16, so int4 saves only on attention.
    assert weights_bytes(shape, "int4") > experts * 2
    assert weights_bytes(shape, "bf16") - weights_bytes(shape, "int4") < (shape.parameters - experts) * 2


def test_gemma_2_is_planned_with_the_eager_attention_it_runs():
    from workbook.planner import plan_train
    config = shrunken("gemma-2-9b")
    assert built(config).config._attn_implementation == "eager"  # transformers' own choice
    sdpa, eager = (training_activation_bytes_per_layer(config, batch_size=2, seq_len=64, attn_implementation=name)
                   for name in ("sdpa", "eager"))
    assert sdpa == eager
    plan = plan_train(config, micro_batch_size=1, seq_len=64, gpu_memory_bytes=2**34)
    assert any("planned with the eager attention it runs" in note for note in plan.notes)


def test_final_logit_softcapping_adds_its_saved_tanh_per_logit():
    from workbook.planner import plan_train
    capped = shrunken("gemma-2-9b", layers=1)
    plain = shrunken("gemma-2-9b", layers=1)
    plain.final_logit_softcapping = None
    measured = _saved_activation_bytes(built(capped).train()) - _saved_activation_bytes(built(plain).train())
    logits = ACTIVATION_CHECK_BATCH * ACTIVATION_CHECK_SEQ_LEN * capped.vocab_size

    def loss_path_bytes(config):
        plan = plan_train(config, micro_batch_size=ACTIVATION_CHECK_BATCH, seq_len=ACTIVATION_CHECK_SEQ_LEN,
                          gpu_memory_bytes=2**34, dtype="fp32")
        return next(term.bytes for term in plan.terms if term.name == "logits_and_loss")

    assert measured == logits * 4  # fp32: one tanh output per logit
    assert loss_path_bytes(capped) - loss_path_bytes(plain) == measured


# ---------------------------------------------------------------------------------------------
# LoRA targets: one rule (planner.shape.choose_lora_targets) for the planner and the trainer.


def test_lora_adapts_every_linear_projection_of_phi_3_and_the_planner_counts_what_peft_builds():
    pytest.importorskip("peft")
    from workbook import models
    from workbook.planner import lora_parameter_count
    config = shrunken("Phi-3-mini-4k-instruct")
    model = built(config)
    assert set(models.lora_targets(model).names) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    adapted = models.with_lora(model, 4)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert trainable == lora_parameter_count(config, 4)


@pytest.mark.parametrize("name, target_modules", [("DeepSeek-V2-Lite", ""), ("DeepSeek-V2-Lite", "gate_proj,up_proj"),
                                                  ("Qwen1.5-MoE-A2.7B", ""), ("Mixtral-8x7B-v0.1", "")])
def test_lora_leaves_routed_experts_alone_and_the_planner_counts_what_peft_builds(name, target_modules):
    # PEFT 0.21 would move DeepSeek's gate_proj/up_proj/down_proj onto the routed experts (models.with_lora).
    pytest.importorskip("peft")
    from workbook import models
    from workbook.planner import lora_parameter_count
    config = shrunken(name)
    adapted = models.with_lora(built(config), 4, target_modules)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert trainable == lora_parameter_count(config, 4, target_modules)
    adapted_names = [n for n, module in adapted.named_modules() if hasattr(module, "lora_A")]
    assert adapted_names and not [n for n in adapted_names if ".experts" in n]  # the routed ones, not shared_experts
    assert not adapted.peft_config["default"].target_parameters


def test_llama_keeps_its_seven_projections_and_deepseek_gets_its_latent_ones():
    from workbook.planner.shape import lora_target_choice
    assert lora_target_choice(model_shape("llama-3.2-1b")).names == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = lora_target_choice(model_shape("DeepSeek-V2-Lite")).names
    assert {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "down_proj"} <= set(names) and "lm_head" not in names


def test_a_named_target_that_matches_nothing_is_a_warning_and_all_unmatched_an_error():
    from workbook.planner import plan_train
    config = shrunken("Phi-3-mini-4k-instruct")
    plan = plan_train(config, micro_batch_size=1, seq_len=32, gpu_memory_bytes=2**34, lora_rank=8,
                      lora_target_modules="q_proj,qkv_proj")
    assert plan.settings["lora_target_modules"] == ["qkv_proj"]
    assert any("lora target 'q_proj' matches no Linear layer" in note for note in plan.notes)
    # The trainer reads the same rule off the real model: it adapts qkv_proj and warns about q_proj.
    from workbook import models
    targets = models.lora_targets(built(config), "q_proj,qkv_proj")
    assert (targets.names, targets.unmatched) == (("qkv_proj",), ("q_proj",))
    with pytest.raises(ValueError, match="match no Linear layer.*qkv_proj"):
        plan_train(config, micro_batch_size=1, seq_len=32, gpu_memory_bytes=2**34, lora_rank=8,
                   lora_target_modules="q_proj,v_proj")


def test_plan_lora_targets_and_attention_from_the_command_line(capsys):
    import json

    from workbook import cli
    assert cli.main(["plan", "--profile", "h100", "--mode", "train", "--model", "phi-3-mini-4k-instruct",
                     "--lora-rank", "8", "--lora-targets", "qkv_proj", "--attn-implementation", "eager",
                     "--batch-size", "1", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["lora_target_modules"] == ["qkv_proj"]
    assert plan["settings"]["attn_implementation"] == "eager"


def test_the_profiles_attention_reaches_the_plan():
    from workbook import params
    from workbook.planner import profile
    settings = {**params.load(params.profile_path("cpu")), "model": "llama-3.2-1b"}
    sdpa = profile.plan(settings, mode="train", batch_size=1)
    eager = profile.plan({**settings, "attn_implementation": "eager"}, mode="train", batch_size=1)
    # The cpu profile packs rows: sdpa runs as document_sdpa there (no mask), eager stays eager.
    assert (sdpa.settings["attn_implementation"], eager.settings["attn_implementation"]) == ("document_sdpa", "eager")
    # eager keeps the attention probabilities (at batch 1 both peak at the end of backward: the same total)
    assert eager.settings["saved_activation_bytes"] > sdpa.settings["saved_activation_bytes"]
    assert eager.total_bytes >= sdpa.total_bytes
    unpacked = profile.plan({**settings, "padding": "length_grouped"}, mode="train", batch_size=1)
    assert unpacked.settings["attn_implementation"] == "sdpa"


def test_a_model_that_refuses_sdpa_is_loaded_with_the_eager_attention_it_is_planned_with():
    from workbook import models
    config = shrunken("gemma-2-9b")
    assert models.runnable_attention(config, "sdpa") == "eager"
    assert models.runnable_attention(shrunken("Qwen3-8B"), "sdpa") == "sdpa"


# ---------------------------------------------------------------------------------------------
# What the planner does not model: a refusal that says what is missing.


@pytest.mark.parametrize("model_type, values, missing", [
    ("mamba", {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}, "state-space"),
    ("t5", {"d_model": 64, "num_layers": 2, "vocab_size": 256}, "encoder-decoder"),
    ("llava", {}, "vision/audio-language"),
    ("gemma3", {}, "vision/audio-language"),
])
def test_architectures_the_planner_does_not_model_are_refused_naming_what_is_missing(model_type, values, missing):
    config = AutoConfig.for_model(model_type, **values)
    with pytest.raises(ValueError, match=missing):
        model_shape(config)


@pytest.mark.slow
def test_the_chunked_loss_soft_caps_gemma_2s_logits_as_the_model_does():
    from workbook.training.batches import loss_sum
    model = built(shrunken("gemma-2-9b")).train()
    torch.manual_seed(1)
    ids = torch.randint(4, 200, (2, 24))
    batch = {"input_ids": ids, "position_ids": torch.arange(24).repeat(2, 1), "targets": ids.roll(-1, 1)}
    losses, gradients = {}, {}
    for chunk in (0, 7):
        model.zero_grad()
        loss = loss_sum(model, batch, torch.device("cpu"), loss_chunk_tokens=chunk)
        loss.backward()
        losses[chunk], gradients[chunk] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses[7] == pytest.approx(losses[0], rel=1e-5)
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[7][name], gradient, atol=1e-5, rtol=1e-4, msg=name)
