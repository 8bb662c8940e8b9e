"""The memory planner against real tensors: weights, KV caches and saved activations, on CPU."""

import contextlib
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from workbook import planner
from workbook.planner import (
    DoesNotFitError,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    lora_parameter_count,
    plan_generate,
    plan_train,
    training_activation_bytes_per_layer,
    weights_bytes,
)
from workbook.presets import load_config
from workbook.units import GiB

H200_BYTES = int(140.4 * GiB)  # params/h200.yaml: gpu_memory_gib as the driver reports it
A100_80GB_BYTES = 80 * GiB
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def small_llama(layers=2, **overrides) -> LlamaConfig:
    """A random Llama with grouped-query attention (4 query heads share 2 key/value heads)."""
    values = dict(vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaConfig(**{**values, **overrides})


def cache_tensors(cache) -> list[torch.Tensor]:
    """Key and value tensors of a transformers 5.x DynamicCache (5.17 and later: ``.layers``)."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``: what the allocator really holds."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# ---------------------------------------------------------------------------------------------
# Weights.


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_bytes_equal_the_real_model(dtype, tied):
    config = small_llama(tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(TORCH_DTYPES[dtype])
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes(config, dtype) == real


def test_weights_bytes_of_the_tiny_model():
    tiny_model = pytest.importorskip("workbook.tiny_model")
    model = LlamaForCausalLM(tiny_model.tiny_config()).to(torch.bfloat16)
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes("tiny", "bf16") == real


def test_quantized_weights_keep_embeddings_in_bf16():
    config = load_config("Llama-3.1-8B")
    params = 8_030_261_248
    embeddings = 2 * 128256 * 4096  # input embedding and untied lm_head stay bf16
    assert weights_bytes(config, "bf16") == 2 * params
    int8, int4 = weights_bytes(config, "int8"), weights_bytes(config, "int4")
    int8_without_scales = (params - embeddings) * 1 + embeddings * 2
    assert int8_without_scales < int8 < 1.01 * int8_without_scales  # one fp32 scale per row
    assert (params - embeddings) * 0.5 + embeddings * 2 < int4 < int8
    assert 5.0 * GiB < int4 < 6.0 * GiB  # bitsandbytes NF4 Llama-3-8B: about 5.6 GiB


# ---------------------------------------------------------------------------------------------
# KV cache: against the cache a real forward pass or generate() builds.


def test_kv_cache_bytes_per_token_of_llama_3_1_8b():
    # 2 (K, V) x 32 layers x 8 kv heads x 128 head_dim x 2 bytes
    assert kv_cache_bytes_per_token(load_config("Llama-3.1-8B"), "bf16") == 131_072
    assert kv_cache_bytes_per_token(load_config("Llama-3.1-8B"), "int4") == 131_072  # bf16 cache


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kv_cache_matches_a_real_forward_pass(dtype):
    config = small_llama()
    model = LlamaForCausalLM(config).to(TORCH_DTYPES[dtype]).eval()
    batch, tokens = 3, 11
    with torch.no_grad():
        cache = model(torch.randint(0, 128, (batch, tokens)), use_cache=True).past_key_values
    real = sum(t.numel() * t.element_size() for t in cache_tensors(cache))
    assert real == batch * tokens * kv_cache_bytes_per_token(config, dtype)
    assert real == kv_cache_bytes(config, dtype, batch_size=batch, tokens=tokens)
    assert real == storage_bytes(cache_tensors(cache))


def generate_cache(model, batch, prompt_len, new_tokens):
    with torch.no_grad():
        output = model.generate(
            torch.randint(4, 100, (batch, prompt_len)),
            attention_mask=torch.ones(batch, prompt_len),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            return_dict_in_generate=True, pad_token_id=0,
        )
    assert output.sequences.shape[1] == prompt_len + new_tokens
    return output.past_key_values


def test_generate_caches_all_but_the_last_new_token():
    config = small_llama()
    model = LlamaForCausalLM(config).eval()
    cache = generate_cache(model, batch=2, prompt_len=6, new_tokens=5)
    assert storage_bytes(cache_tensors(cache)) == kv_cache_bytes(
        config, "fp32", batch_size=2, tokens=6 + 5 - 1)


@pytest.mark.slow
def test_the_planned_cache_holds_the_last_steps_append_with_its_old_copy(monkeypatch):
    """DynamicLayer.update appends a token with torch.cat: the old keys (then the old values) live
    beside the longer copy. The largest cache bytes alive at once during generate() must be within
    the plan's kv_cache term, which counts one whole layer's old keys and values (the caching
    allocator on a GPU keeps the freed keys' block, too small for the longer values, reserved)."""
    from transformers.cache_utils import DynamicLayer
    config = small_llama(3)
    model = LlamaForCausalLM(config).eval()
    held, peak, update = {}, [0], DynamicLayer.update

    def measured(layer, keys, values, *args, **kwargs):
        old_keys = layer.keys.nbytes if layer.is_initialized else 0
        old_values = layer.values.nbytes if layer.is_initialized else 0
        result = update(layer, keys, values, *args, **kwargs)
        others = sum(size for key, size in held.items() if key != id(layer))
        new_keys, new_values = layer.keys.nbytes, layer.values.nbytes
        peak[0] = max(peak[0], others + max(old_keys + new_keys + old_values, new_keys + old_values + new_values))
        held[id(layer)] = new_keys + new_values
        return result

    monkeypatch.setattr(DynamicLayer, "update", measured)
    batch, prompt_len, new_tokens = 2, 6, 40  # long enough that the last decode step is the plan's peak
    generate_cache(model, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    plan = plan_generate(config, batch_size=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                         gpu_memory_bytes=GiB, dtype="fp32")
    [term] = [term for term in plan.terms if term.name == "kv_cache"]
    planned = term.bytes
    assert term.explanation.startswith("last decode step")
    one_layer = kv_cache_bytes(config, "fp32", batch_size=batch, tokens=prompt_len + new_tokens - 1) // 3
    assert peak[0] <= planned <= peak[0] + one_layer


def sliding_mistral(window=5) -> MistralConfig:
    return MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=window)


def test_sliding_window_cache_after_prefill_holds_the_whole_prompt():
    # DynamicSlidingWindowLayer keeps a view of the last window - 1 tokens, but the view keeps
    # the prompt's full key/value tensors alive until the next step replaces them.
    config, window, batch, prompt_len = sliding_mistral(), 5, 2, 9
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 128, (batch, prompt_len)), use_cache=True).past_key_values
    tensors = cache_tensors(cache)
    per_token_per_layer = kv_cache_bytes_per_token(config, "fp32") // config.num_hidden_layers
    visible = sum(t.numel() * t.element_size() for t in tensors)
    assert visible == batch * (window - 1) * per_token_per_layer * config.num_hidden_layers
    assert storage_bytes(tensors) == kv_cache_bytes(
        config, "fp32", batch_size=batch, tokens=prompt_len, last_step_tokens=prompt_len)


@pytest.mark.parametrize("prompt_len, new_tokens", [(9, 6), (2, 8), (2, 3)])
def test_sliding_window_cache_after_generate_is_capped_at_the_window(prompt_len, new_tokens):
    config, window, batch = sliding_mistral(), 5, 2
    cache = generate_cache(MistralForCausalLM(config).eval(), batch, prompt_len, new_tokens)
    tokens = prompt_len + new_tokens - 1
    expected = kv_cache_bytes(config, "fp32", batch_size=batch, tokens=tokens)
    assert storage_bytes(cache_tensors(cache)) == expected
    per_layer_token = kv_cache_bytes_per_token(config, "fp32") // config.num_hidden_layers
    assert expected == batch * min(tokens, window) * per_layer_token * config.num_hidden_layers


def test_mistral_7b_kv_cache_stops_growing_at_4096_tokens():
    config = load_config("Mistral-7B-v0.1")
    at_window = kv_cache_bytes(config, "bf16", batch_size=1, tokens=4096)
    assert at_window == 4096 * kv_cache_bytes_per_token(config, "bf16")
    assert kv_cache_bytes(config, "bf16", batch_size=1, tokens=20_000) == at_window


# ---------------------------------------------------------------------------------------------
# Training activations: against what autograd saves for backward.


def saved_tensor_bytes(config, dtype, autocast, batch, seq_len, checkpointing=False, lora_rank=0):
    """Bytes autograd saves in one training forward pass, and the bytes of autocast weight copies.

    Called as the trainer calls the model: position ids per row, labels apart from the input ids.
    Parameters themselves are not counted; bf16 copies of them (same shape as a parameter) are
    returned separately. batch x seq_len must differ from every parameter dimension.
    """
    record = saved_tensor_record(config, dtype, autocast, batch, seq_len, checkpointing, lora_rank)
    return record["activations"], record["weight_copies"]


def saved_tensor_record(config, dtype, autocast, batch, seq_len, checkpointing=False, lora_rank=0) -> dict:
    """saved_tensor_bytes' two figures, plus what a checkpointed run holds beside them: the rotary
    cos/sin (inputs of every checkpointed layer) and whether a layer saves its own input storage
    (then the recomputed layer shares it with the checkpoint's boundary)."""
    from workbook import models

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(TORCH_DTYPES[dtype]).train()
    if checkpointing:
        models.enable_gradient_checkpointing(model)
    base = model
    if lora_rank:
        model = models.with_lora(model, lora_rank)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parameter_shapes = {tuple(p.shape) for p in model.parameters()}
    activations, weight_copies, seen = {}, {}, {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            shape = tuple(tensor.shape)  # Linear saves the weight transposed
            is_copy = tensor.dtype == torch.bfloat16 and (
                shape in parameter_shapes or shape[::-1] in parameter_shapes)
            found = weight_copies if is_copy and autocast else activations
            found[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep(name):
        return lambda module, args, kwargs, output=None: seen.setdefault(name, (args, kwargs, output))

    base.model.rotary_emb.register_forward_hook(lambda module, args, output: seen.setdefault("rotary", output))
    last = base.model.layers[-1]
    last.register_forward_pre_hook(lambda module, args: seen.setdefault("layer_input", args[0]))
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    labels = torch.randint(0, config.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, position_ids=torch.arange(seq_len).repeat(batch, 1), use_cache=False).logits
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    layer_input = seen["layer_input"].untyped_storage()
    return {"activations": sum(activations.values()), "weight_copies": sum(weight_copies.values()),
            "rotary": storage_bytes(seen["rotary"]),
            "layer_input_saved": layer_input.nbytes() if layer_input.data_ptr() in activations else 0}


PRECISIONS = [  # (stored dtype, autocast): pure fp32, pure bf16, bf16 autocast on fp32 weights
    ("fp32", False), ("bf16", False), ("fp32", True),
]


@pytest.mark.slow
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("stored, autocast", PRECISIONS)
def test_activations_per_layer_equal_what_autograd_saves(stored, autocast, attn_implementation):
    batch, seq_len = 3, 50  # 150 tokens: no parameter has a 150-long dimension
    measured = {}
    for layers in (1, 3):
        config = small_llama(layers, attn_implementation=attn_implementation)
        measured[layers], _ = saved_tensor_bytes(config, stored, autocast, batch, seq_len)
    per_layer = (measured[3] - measured[1]) // 2
    plan_dtype = "bf16" if autocast else stored
    assert per_layer == training_activation_bytes_per_layer(
        small_llama(1), batch_size=batch, seq_len=seq_len, dtype=plan_dtype,
        mixed_precision=autocast, attn_implementation=attn_implementation)


def activations_term(plan):
    """Every tensor the plan's step saves for backward: what the forward keeps (alive at the start of backward)
    and, under checkpointing, the one layer backward makes again; the plan's terms hold them only at the
    moment they are alive (planner.step_moments)."""
    return plan.settings["saved_activation_bytes"] + plan.settings["recomputed_layer_bytes"]


LORA_PRECISIONS = [  # (base dtype, autocast): fp32, the trainer's bf16 (autocast), pure bf16; fp32 adapters
    ("fp32", False), ("bf16", True), ("bf16", False),
]
LOSS_BYTES = dict(log_softmax_per_token=128 * 4, scalar=4)  # fp32 log-softmax (logits_and_loss) and the loss


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("lora_rank, stored, autocast", [(0, *case) for case in PRECISIONS]
                         + [(8, *case) for case in LORA_PRECISIONS])
def test_plan_activations_equal_what_autograd_holds(lora_rank, stored, autocast, checkpointing):
    """The whole model's activations term against autograd, full fine-tune and LoRA (PEFT).

    Without checkpointing: every byte autograd saves is the plan's activations plus the loss's fp32
    log-softmax (its logits_and_loss term) and the loss scalar. With checkpointing: what the forward
    saves (the layer inputs and outside the layers), plus the rotary cos/sin the checkpoints keep as
    inputs, plus one layer recomputed in backward (what a layer saves without checkpointing, less
    its own input when that is the same storage as the checkpoint's).
    """
    batch, seq_len = 3, 50
    plan_dtype = "bf16" if autocast or stored == "bf16" else "fp32"
    measured = {layers: saved_tensor_record(small_llama(layers), stored, autocast, batch, seq_len,
                                            checkpointing, lora_rank) for layers in (1, 3)}
    planned = {layers: activations_term(plan_train(
        small_llama(layers), micro_batch_size=batch, seq_len=seq_len, dtype=plan_dtype, mixed_precision=autocast,
        grad_checkpointing=checkpointing, lora_rank=lora_rank, gpu_memory_bytes=GiB)) for layers in (1, 3)}
    loss = batch * seq_len * LOSS_BYTES["log_softmax_per_token"] + LOSS_BYTES["scalar"]
    held = measured[3]["activations"]
    if checkpointing:
        saved = {layers: saved_tensor_record(small_llama(layers), stored, autocast, batch, seq_len, False, lora_rank)
                 for layers in (1, 3)}
        recomputed = (saved[3]["activations"] - saved[1]["activations"]) // 2 - saved[3]["layer_input_saved"]
        held += measured[3]["rotary"] + recomputed
    assert held == planned[3] + loss


def loss_saved_tensor_bytes(config, stored, autocast, batch, seq_len, loss_chunk_tokens):
    """(activations, autocast weight copies) autograd saves in one forward through the trainer's
    loss (``batches.loss_sum``), autocast around the model's forward only, as accelerate runs it."""
    from workbook.training.batches import loss_sum

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(TORCH_DTYPES[stored]).train()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)(model.forward)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parameter_shapes = {tuple(p.shape) for p in model.parameters()}
    activations, weight_copies = {}, {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            shape = tuple(tensor.shape)
            is_copy = tensor.dtype == torch.bfloat16 and autocast and (
                shape in parameter_shapes or shape[::-1] in parameter_shapes)
            (weight_copies if is_copy else activations)[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    batch_tensors = {"input_ids": ids, "position_ids": torch.arange(seq_len).repeat(batch, 1), "targets": ids}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_sum(model, batch_tensors, torch.device("cpu"), loss_chunk_tokens)
    return sum(activations.values()), sum(weight_copies.values())


@pytest.mark.slow
@pytest.mark.parametrize("stored, autocast", PRECISIONS)
def test_the_chunked_loss_saves_no_logits_and_the_plan_holds_one_chunk(stored, autocast):
    config, batch, seq_len, chunk = small_llama(2), 3, 50, 32
    full = loss_saved_tensor_bytes(config, stored, autocast, batch, seq_len, loss_chunk_tokens=0)
    chunked = loss_saved_tensor_bytes(config, stored, autocast, batch, seq_len, loss_chunk_tokens=chunk)
    log_softmax_output = batch * seq_len * config.vocab_size * 4  # what the full loss saves, fp32
    reduction_scalar = 4  # the full loss's sum reduction saves a float32 scalar
    loss_positions = batch * seq_len * 8  # the chunked loss keeps the loss positions' int64 index (here all of them)
    # The same weight copies, no logits.
    assert chunked == (full[0] - log_softmax_output - reduction_scalar + loss_positions, full[1])
    plan_dtype = "bf16" if autocast else stored
    common = dict(micro_batch_size=batch, seq_len=seq_len, dtype=plan_dtype, mixed_precision=autocast,
                  gpu_memory_bytes=GiB)
    full_plan = plan_train(config, **common)
    chunked_plan = plan_train(config, loss_chunk_tokens=chunk, **common)
    assert activations_term(chunked_plan) == activations_term(full_plan)
    # One chunk's logits at a time: more positions add only their int64 index and their hidden state's gradient.
    longer = plan_train(config, loss_chunk_tokens=chunk, **{**common, "seq_len": 2 * seq_len})
    residual = 4 if autocast or stored == "fp32" else 2
    assert bytes_when_alive(longer, "logits_and_loss") - bytes_when_alive(chunked_plan, "logits_and_loss") == \
        batch * seq_len * (8 + config.hidden_size * residual)
    # All the chunked forward saves is the plan's activations (less the labels it counts apart:
    # here the input ids themselves) and the loss positions' index.
    assert chunked[0] == activations_term(chunked_plan) - batch * seq_len * 8 + loss_positions


def test_the_chunked_loss_plan_is_far_smaller_for_a_large_vocabulary():
    common = dict(micro_batch_size=8, seq_len=2048, gpu_memory_bytes=A100_80GB_BYTES)
    full = plan_train(load_config("Llama-3.1-8B"), **common)
    chunked = plan_train(load_config("Llama-3.1-8B"), loss_chunk_tokens=1024, **common)
    # The loss's backward: the fp32 log-softmax output and its gradient in and out (the bf16 logits and their fp32
    # copy are freed when the forward returns): 25.2 GB.
    assert term_bytes(full, "logits_and_loss") == 8 * 2048 * 128256 * 12
    # The chunked loss's backward: the head weight's fp32 gradient and the hidden state's, one chunk's fp32
    # logits and bf16 gradient with the chunk's bf16 share of the weight gradient and its gathered input, and the
    # int64 index of every loss position.
    whole = 128256 * 4096 * 4 + 8 * 2048 * 4096 * 4
    one_chunk = 1024 * 128256 * (4 + 2) + 128256 * 4096 * 2 + 1024 * 4096 * 2
    assert term_bytes(chunked, "logits_and_loss") == whole + one_chunk + 8 * 2048 * 8
    one_b = load_config("Llama-3.2-1B")
    assert plan_train(one_b, loss_chunk_tokens=1024, **common).max_batch_size > \
        plan_train(one_b, **common).max_batch_size


def test_autocast_weight_copies_equal_the_linear_weights_in_bf16():
    config = small_llama(2)
    _, weight_copies = saved_tensor_bytes(config, "fp32", True, batch=3, seq_len=50)
    plan = plan_train(config, micro_batch_size=3, seq_len=50, dtype="bf16", mixed_precision=True,
                      gpu_memory_bytes=GiB)
    assert bytes_when_alive(plan, "autocast_weight_copies") == weight_copies


# ---------------------------------------------------------------------------------------------
# Training states: bytes per parameter by convention.


def term_bytes(plan, name):
    return next(term.bytes for term in plan.terms if term.name == name)


def bytes_when_alive(plan, name):
    """A term's bytes at the moment of the step it is largest, whether or not that is the plan's peak."""
    return plan.settings["bytes_when_alive"][name]


def test_bytes_per_parameter_of_each_training_convention():
    config, params = load_config("Llama-3.2-1B"), 1_235_814_400
    common = dict(micro_batch_size=1, seq_len=16, gpu_memory_bytes=H200_BYTES)
    mixed = plan_train(config, dtype="bf16", mixed_precision=True, **common)
    assert [term_bytes(mixed, n) for n in ("weights", "gradients", "optimizer_states")] == [
        4 * params, 4 * params, 8 * params]
    pure = plan_train(config, dtype="bf16", mixed_precision=False, **common)
    assert [term_bytes(pure, n) for n in ("weights", "gradients", "optimizer_states")] == [
        2 * params, 2 * params, 4 * params]
    assert "autocast_weight_copies" not in [term.name for term in pure.terms]
    fp32 = plan_train(config, dtype="fp32", **common)  # fp32 is full precision: no autocast
    assert term_bytes(fp32, "optimizer_states") == 8 * params
    eight_bit = plan_train(config, optimizer="adamw-8bit", **common)
    assert term_bytes(eight_bit, "optimizer_states") == pytest.approx(2.03125 * params, abs=1)


def test_fsdp_divides_states_by_gpu_count():
    config = load_config("Llama-3.1-8B")
    common = dict(micro_batch_size=1, seq_len=512, gpu_memory_bytes=A100_80GB_BYTES)
    single = plan_train(config, **common)
    sharded = plan_train(config, sharding="fsdp", gpu_count=8, **common)
    for name in ("weights", "gradients", "optimizer_states"):
        assert bytes_when_alive(sharded, name) == -(-bytes_when_alive(single, name) // 8)
    assert activations_term(sharded) == activations_term(single)
    # Counted by hand: the root unit (untied embedding and lm_head, final norm), two decoder layers
    # (attention, MLP, two norms) gathered at once, and the root unit's full gradient, in bf16.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    root = 2 * 128_256 * 4096 + 4096
    assert bytes_when_alive(sharded, "fsdp_gathered_parameters") == (root + 2 * layer + root) * 2


# ---------------------------------------------------------------------------------------------
# LoRA.


def test_lora_rank_16_on_llama_3_1_8b_has_41_943_040_parameters():
    config = load_config("Llama-3.1-8B")
    hidden, kv, intermediate, layers, rank = 4096, 1024, 14336, 32, 16
    per_layer = rank * ((hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + intermediate) * 3)
    assert lora_parameter_count(config, 16) == per_layer * layers == 41_943_040
    assert lora_parameter_count(config, 16, ["q_proj", "v_proj"]) == rank * (
        (hidden + hidden) + (hidden + kv)) * layers


def test_lora_counts_the_adapters_peft_puts_on_every_llama_projection():
    peft = pytest.importorskip("peft")
    config = small_llama(2)
    rank = 8
    # Llama's seven projections, named here rather than taken from the planner's rule.
    every_projection = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=rank, target_modules=every_projection))
    expected = sum(p.numel() for name, p in adapted.named_parameters() if "lora_" in name)
    assert lora_parameter_count(config, rank) == expected


def test_lora_unknown_target_names_the_argument_and_the_layers():
    with pytest.raises(ValueError, match="lora_targets.*q_proj"):
        lora_parameter_count(small_llama(), 8, ["query"])


# ---------------------------------------------------------------------------------------------
# Plans and the largest batch.


def generate_8b(**overrides):
    values = dict(batch_size=1, prompt_len=512, new_tokens=2048, gpu_memory_bytes=H200_BYTES)
    return plan_generate(load_config("Llama-3.1-8B"), **{**values, **overrides})


def test_largest_generate_batch_of_llama_8b_on_an_h200():
    plan = generate_8b()
    # Per sequence the cache holds 2559 tokens x 131,072 B = 335 MB; weights take 16.1 GB.
    assert plan.weights_bytes == 2 * 8_030_261_248
    assert 300 < plan.max_batch_size < 400
    kv_only = (plan.budget_bytes - plan.weights_bytes) // (2559 * 131_072)
    assert plan.max_batch_size < kv_only  # logits, activations and overhead cost something


@pytest.mark.parametrize("make_plan", [
    lambda batch: generate_8b(batch_size=batch),
    lambda batch: generate_8b(batch_size=batch, dtype="int4", attn_implementation="eager"),
    lambda batch: plan_generate(load_config("Mistral-7B-v0.1"), batch_size=batch, prompt_len=8000,
                                new_tokens=100, gpu_memory_bytes=A100_80GB_BYTES),
    lambda batch: plan_train(load_config("Llama-3.1-8B"), micro_batch_size=batch, seq_len=2048,
                             gpu_memory_bytes=H200_BYTES, grad_checkpointing=True,
                             optimizer="adamw-8bit"),
    lambda batch: plan_train(load_config("Qwen2.5-0.5B"), micro_batch_size=batch, seq_len=1024,
                             gpu_memory_bytes=A100_80GB_BYTES, lora_rank=16),
])
def test_plan_at_max_batch_fits_and_one_more_does_not(make_plan):
    largest = make_plan(1).max_batch_size
    assert largest > 0
    assert make_plan(largest).fits
    assert not make_plan(largest + 1).fits
    assert make_plan(largest + 1).max_batch_size == largest


def test_total_grows_with_the_batch_and_is_the_sum_of_the_terms():
    totals = [generate_8b(batch_size=batch).total_bytes for batch in (1, 2, 8, 64)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    plan = generate_8b(batch_size=8)
    assert plan.total_bytes == sum(term.bytes for term in plan.terms)
    assert all(term.explanation for term in plan.terms)


def test_full_fine_tune_of_llama_8b_on_an_h200():
    config = load_config("Llama-3.1-8B")
    common = dict(seq_len=2048, gpu_memory_bytes=H200_BYTES, micro_batch_size=1)
    # The peak is a moment: at the end of backward 16 B/param of weights, gradients and AdamW states (128 GB,
    # 119.7 GiB); at the start of backward no gradient yet, but 2 B/param of autocast copies and one row's
    # activations beside the 12 B/param: 121.5 GiB, so one row fits in the 133 GiB budget, two do not.
    assert plan_train(config, **common).max_batch_size == 1
    eight_bit = plan_train(config, optimizer="adamw-8bit", **common).max_batch_size
    checkpointed = plan_train(config, optimizer="adamw-8bit", grad_checkpointing=True,
                              **common).max_batch_size
    assert 0 < eight_bit < checkpointed
    pure_bf16 = plan_train(config, mixed_precision=False, **common).max_batch_size
    assert pure_bf16 > eight_bit  # 8 B/param instead of 12


def test_70b_training_needs_sharding_or_lora():
    config = load_config("Llama-3.1-70B")
    common = dict(micro_batch_size=1, seq_len=2048, gpu_memory_bytes=A100_80GB_BYTES,
                  grad_checkpointing=True)
    alone = plan_train(config, **common)
    assert not alone.fits and alone.max_batch_size == 0
    assert "does not fit even at batch 1" in alone.advice() and "LoRA" in alone.advice()
    with pytest.raises(DoesNotFitError):
        alone.require_fit()
    # 16 B/param of AdamW mixed-precision state over 8 GPUs is still 141 GB each ...
    assert plan_train(config, sharding="fsdp", gpu_count=8, **common).max_batch_size == 0
    # ... over 32 GPUs it is 35 GB each, and LoRA over 8 GPUs shards just the frozen bf16 base.
    assert plan_train(config, sharding="fsdp", gpu_count=32, **common).fits
    assert plan_train(config, sharding="fsdp", gpu_count=8, lora_rank=16, **common).fits
    assert plan_train(config, dtype="int4", lora_rank=16, **common).fits  # QLoRA, one GPU


def test_ddp_replicas_hold_everything_plus_gradient_buckets():
    config = load_config("Llama-3.2-1B")
    common = dict(micro_batch_size=1, seq_len=512, gpu_memory_bytes=A100_80GB_BYTES)
    one, two = plan_train(config, **common), plan_train(config, gpu_count=2, **common)
    assert two.total_bytes > one.total_bytes
    assert term_bytes(two, "ddp_gradient_buckets") == term_bytes(one, "gradients")


def test_generate_sharded_over_gpus_holds_a_share_of_the_weights_and_kv_cache():
    one = generate_8b(batch_size=16)
    four = generate_8b(batch_size=16, tensor_parallel_size=4)
    assert term_bytes(four, "weights") == pytest.approx(term_bytes(one, "weights") / 4, rel=1e-4)
    assert four.kv_cache_bytes_per_token * 4 == one.kv_cache_bytes_per_token
    assert four.max_batch_size > 3 * one.max_batch_size


def test_all_logits_cost_more_than_the_last_position():
    last = generate_8b(batch_size=64, new_tokens=1)
    every = generate_8b(batch_size=64, new_tokens=1, logits_last_position_only=False)
    assert term_bytes(every, "logits") - term_bytes(last, "logits") == 64 * 511 * 128256 * 2


def test_to_dict_is_json_ready_with_the_documented_keys():
    record = json.loads(json.dumps(generate_8b(batch_size=4).to_dict()))
    assert record["params"] == 8_030_261_248
    assert record["kv_cache_bytes_per_token"] == 131_072
    assert record["total_bytes"] == sum(item["bytes"] for item in record["breakdown"])
    for key in ("weights_bytes", "max_batch_size", "fits", "capacity_bytes", "budget_bytes"):
        assert key in record
    assert set(record["breakdown"][0]) == {"name", "bytes", "explanation"}


def test_plans_accept_preset_names():
    plan = plan_generate("llama-3.2-1b", batch_size=1, prompt_len=8, new_tokens=8,
                         gpu_memory_bytes=A100_80GB_BYTES)
    assert plan.model == "llama-3.2-1b" and plan.params == 1_235_814_400


# ---------------------------------------------------------------------------------------------
# Validation: errors name the argument.


@pytest.mark.parametrize("overrides, named", [
    (dict(dtype="fp8"), "dtype"),
    (dict(batch_size=0), "batch_size"),
    (dict(prompt_len=-1), "prompt_len"),
    (dict(new_tokens=0), "new_tokens"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(gpu_memory_bytes=0), "gpu_memory_bytes"),
    (dict(attn_implementation="flash"), "attn_implementation"),
    (dict(safety_margin=1.5), "safety_margin"),
    (dict(safety_margin=1.0), "safety_margin"),  # a margin of the whole GPU would fit nothing
])
def test_generate_validation_names_the_argument(overrides, named):
    values = dict(batch_size=1, prompt_len=8, new_tokens=8, gpu_memory_bytes=GiB)
    with pytest.raises(ValueError, match=named):
        plan_generate(small_llama(), **{**values, **overrides})


@pytest.mark.parametrize("overrides, named", [
    (dict(micro_batch_size=-2), "micro_batch_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(lora_rank=-1), "lora_rank"),
    (dict(optimizer="sgd"), "optimizer.*adamw, adamw-8bit"),
    (dict(sharding="zero2"), "sharding.*none, fsdp"),
    (dict(dtype="int4"), "lora_rank"),
    (dict(dtype="double"), "dtype.*fp32, bf16"),
])
def test_train_validation_names_the_argument(overrides, named):
    values = dict(micro_batch_size=1, seq_len=8, gpu_memory_bytes=GiB)
    with pytest.raises(ValueError, match=named):
        plan_train(small_llama(), **{**values, **overrides})


def test_dtype_aliases():
    assert weights_bytes(small_llama(), "bfloat16") == weights_bytes(small_llama(), "bf16")
    assert planner.canonical_dtype("Float32") == "fp32"


@pytest.mark.parametrize("model", ["Llama-3.2-1B", "Llama-3.1-8B"])
def test_lora_with_checkpointing_plans_fewer_activations_than_a_full_fine_tune_with_it(model):
    # Frozen norms save no normalized copy and frozen Linears no input (measured above): the
    # notebook's curves must show LoRA + checkpointing below full fine-tune + checkpointing.
    common = dict(micro_batch_size=8, seq_len=2048, gpu_memory_bytes=A100_80GB_BYTES, grad_checkpointing=True)
    full = plan_train(load_config(model), **common)
    lora = plan_train(load_config(model), lora_rank=16, **common)
    assert activations_term(lora) < activations_term(full) and lora.total_bytes < full.total_bytes


def test_the_profile_plans_pure_bf16_as_the_trainer_runs_it():
    from workbook import params
    from workbook.planner import profile
    settings = {**params.load_all()["h100"], "model": "llama-3.2-1b", "dtype": "bf16"}
    pure = profile.plan(settings, mode="train", batch_size=1, seq_len=512, precision="bf16")
    assert pure.settings["mixed_precision"] is False
    assert term_bytes(pure, "optimizer_states") == 4 * 1_235_814_400  # two bf16 moments
    mixed = profile.plan(settings, mode="train", batch_size=1, seq_len=512)
    assert pure.max_batch_size > mixed.max_batch_size
    with pytest.raises(ValueError, match="precision bf16 .* needs dtype bf16"):
        profile.plan({**settings, "dtype": "fp32"}, mode="train", precision="bf16")


def test_a_training_setting_that_does_not_fit_lists_planned_changes_cheapest_first():
    from workbook import params
    from workbook.planner import fit, profile
    settings = {**params.load_all()["h100"], "model": "llama-3.2-1b", "dtype": "bf16", "seq_len": 2048}
    assert not profile.plan(settings, mode="train", batch_size=16).fits
    options = fit.ways_to_fit(settings, batch_size=16)
    assert [option["change"] for option in options] == [
        "precision bf16", "optimizer adamw-8bit", "loss_chunk_tokens 1024", "micro_batch_size 8",
        "grad_checkpointing true", "offload_activations true", "lora_rank 16", "FSDP over 2 GPUs"]
    chunked = profile.plan(settings, mode="train", batch_size=16, loss_chunk_tokens=1024)
    assert options[2]["peak_bytes"] == chunked.total_bytes and options[2]["max_batch_size"] == chunked.max_batch_size
    assert options[3]["fits"] and options[3]["peak_bytes"] == profile.plan(settings, mode="train", batch_size=8).total_bytes
    # FSDP is planned on the GPUs it names: each holds half the states, and less than one GPU alone does.
    fsdp = profile.plan(settings, mode="train", batch_size=16, sharding="fsdp", gpu_count=2)
    assert options[-1]["peak_bytes"] == fsdp.total_bytes < profile.plan(settings, mode="train", batch_size=16).total_bytes
    lines = fit.ways_to_fit_lines(options)
    assert lines[0].startswith("changes that would make it fit") and "loss_chunk_tokens 1024" in lines[3]
    # A change already in effect is not offered again.
    checkpointed = fit.ways_to_fit(settings, batch_size=16, grad_checkpointing=True, loss_chunk_tokens=512)
    assert not {"grad_checkpointing true", "loss_chunk_tokens 1024"} & {o["change"] for o in checkpointed}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank, stored, autocast", [(0, "fp32", False), (0, "bf16", False), (0, "fp32", True),
                                                         (8, "fp32", False), (8, "bf16", False)])
def test_offloaded_activations_are_the_planned_bytes_and_change_no_gradient(lora_rank, stored, autocast):
    from workbook import models
    from workbook.training.batches import loss_sum
    from workbook.training.offload import OffloadActivations

    config, batch, seq_len = small_llama(3), 3, 50
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(TORCH_DTYPES[stored]).train()
    if lora_rank:
        model = models.with_lora(model, lora_rank)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)(model.forward)  # as accelerate
    ids, labels = torch.randint(0, 128, (batch, seq_len)), torch.randint(0, 128, (batch, seq_len))
    tensors = {"input_ids": ids, "position_ids": torch.arange(seq_len).repeat(batch, 1), "targets": labels}
    gradients, host_bytes = [], 0
    for offload in (False, True):
        model.zero_grad()
        hooks = OffloadActivations(model, offload_device_type="cpu")  # the copies a GPU run makes, here on CPU
        with hooks if offload else contextlib.nullcontext():
            loss = loss_sum(model, tensors, torch.device("cpu"))
        loss.backward()
        gradients.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        host_bytes = hooks.host_bytes
    for plain, offloaded in zip(*gradients):
        torch.testing.assert_close(offloaded, plain, atol=0, rtol=0)
    plan = plan_train(config, micro_batch_size=batch, seq_len=seq_len, dtype="bf16" if autocast or stored == "bf16"
                      else "fp32", mixed_precision=autocast, lora_rank=lora_rank, offload_activations=True,
                      gpu_memory_bytes=GiB)
    loss_scalar = 4
    assert host_bytes == plan.settings["offloaded_activation_bytes"] + loss_scalar
    assert activations_term(plan) < activations_term(plan_train(
        config, micro_batch_size=batch, seq_len=seq_len, dtype=plan.dtype, mixed_precision=autocast,
        lora_rank=lora_rank, gpu_memory_bytes=GiB))


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("attention", ["document_sdpa", "sdpa_block_mask"])
def test_packed_rows_saved_bytes_match_the_plan_of_the_attention_path_they_run(attention, lora_rank):
    """Packed rows (restarting position ids) through the mask-free path and through the 4D-mask fallback
    (its (batch, 1, seq, seq) additive mask and keys/values repeated per layer): one layer within 2%."""
    from workbook import models
    from workbook.training import packed_attention
    packed_attention.register()
    batch, seq_len = 3, 50
    ids = torch.randint(0, 128, (batch, seq_len))
    position_ids = torch.cat([torch.arange(20), torch.arange(30)]).repeat(batch, 1)

    def measured(layers):
        torch.manual_seed(0)
        model = LlamaForCausalLM(small_llama(layers)).train()
        model.config._attn_implementation = "sdpa" if attention == "sdpa_block_mask" else attention
        model = models.with_lora(model, lora_rank) if lora_rank else model
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in parameters:
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids, position_ids=position_ids, labels=ids, use_cache=False)
        return sum(saved.values())

    def planned(layers):
        return activations_term(plan_train(small_llama(layers), micro_batch_size=batch, seq_len=seq_len, dtype="fp32",
                                           mixed_precision=False, lora_rank=lora_rank, attn_implementation=attention,
                                           gpu_memory_bytes=GiB))
    layer_measured, layer_planned = (measured(3) - measured(1)) // 2, (planned(3) - planned(1)) // 2
    assert abs(layer_planned - layer_measured) <= 0.02 * layer_measured, (layer_planned, layer_measured)
    if attention == "sdpa_block_mask":  # the mask alone: one additive fp32 (batch, 1, seq, seq) per layer
        plain = (plan_train(small_llama(3), micro_batch_size=batch, seq_len=seq_len, dtype="fp32", mixed_precision=False,
                            lora_rank=lora_rank, gpu_memory_bytes=GiB))
        assert activations_term(plan_train(small_llama(3), micro_batch_size=batch, seq_len=seq_len, dtype="fp32",
                                           mixed_precision=False, lora_rank=lora_rank, attn_implementation=attention,
                                           gpu_memory_bytes=GiB)) - activations_term(plain) >= 3 * batch * seq_len * seq_len * 4


def test_flex_attention_is_planned_with_keys_and_values_repeated_where_transformers_repeats_them():
    """transformers' flex attention runs grouped queries only for a power-of-two count of heads: Qwen2.5's
    14 query heads get their 2 key/value heads repeated to 14 before the call, which the kernel keeps."""
    from workbook.planner.formulas import attention_core_bytes_per_token
    from workbook.planner.shape import model_shape
    qwen, llama = model_shape("Qwen2.5-0.5B"), model_shape("Llama-3.2-1B")
    assert qwen.num_attention_heads == 14 and llama.num_attention_heads == 32
    for shape, repeated in ((qwen, True), (llama, False)):
        flex = attention_core_bytes_per_token(shape, 2, "flex_attention", 2048)
        document = attention_core_bytes_per_token(shape, 2, "document_sdpa", 2048) - 2 * shape.query_width
        extra = 2 * 2 * (shape.query_width - shape.key_value_width) if repeated else 0
        assert flex - document == extra


@pytest.mark.parametrize("budget, largest", [(9, 0), (10, 1), (19, 1), (20, 2), (60, 6), (79, 7), (80, 8), (129, 12)])
def test_the_largest_batch_is_the_last_whose_bytes_are_at_most_the_budget(budget, largest):
    # 10 bytes a sequence: a budget met to the byte still fits, as a plan fits at total <= budget.
    assert planner.max_batch_size(lambda batch: 10 * batch, budget) == largest


def test_the_largest_batch_never_passes_the_search_limit():
    assert planner.max_batch_size(lambda batch: batch, 14, limit=12) == 12


def test_a_plan_whose_total_meets_the_budget_to_the_byte_fits():
    total = generate_8b(batch_size=1).total_bytes
    exact = generate_8b(batch_size=1, gpu_memory_bytes=total, safety_margin=0)
    assert exact.fits and exact.max_batch_size == 1
    assert not generate_8b(batch_size=1, gpu_memory_bytes=total - 1, safety_margin=0).fits


def test_advice_compares_the_need_with_the_budget_after_the_margin_not_the_whole_gpu():
    plan = generate_8b(batch_size=generate_8b(batch_size=1).max_batch_size + 1)
    # 140.4 GiB less the 5% margin: the figure the plan was judged against.
    assert f"but {plan.budget_bytes / GiB:.1f} GiB is available" in plan.advice()
    assert f"{H200_BYTES / GiB:.1f} GiB is available" not in plan.advice()


def test_ways_to_fit_leave_out_lora_pure_bf16_offloading_and_8_bit_adam_already_in_use():
    from workbook import params
    from workbook.planner import fit
    settings = {**params.load_all()["h100"], "model": "llama-3.1-8b", "dtype": "bf16", "seq_len": 2048,
                "lora_rank": 16, "offload_activations": True, "optimizer": "adamw-8bit"}
    # Pure bf16 is not offered with LoRA: the adapters train in mixed precision. (Batch 16 fits as it is: the
    # loss's backward holds 12 B per logit, the bf16 logits freed by then, so no smaller micro-batch is offered.)
    assert [option["change"] for option in fit.ways_to_fit(settings, batch_size=16)] == [
        "loss_chunk_tokens 1024", "grad_checkpointing true", "FSDP over 2 GPUs"]


def test_each_way_to_fit_is_planned_with_its_change_even_over_a_setting_given_explicitly():
    # `workbook plan --optimizer adamw --precision mixed` passes the current settings as overrides:
    # the 8-bit Adam and pure bf16 options must still be planned with 8-bit Adam and pure bf16.
    from workbook import params
    from workbook.planner import fit, profile
    settings = {**params.load_all()["h100"], "model": "llama-3.2-1b", "dtype": "bf16", "seq_len": 2048}
    options = {option["change"]: option for option in
               fit.ways_to_fit(settings, batch_size=16, optimizer="adamw", precision="mixed")}
    eight_bit = profile.plan(settings, mode="train", batch_size=16, optimizer="adamw-8bit")
    pure_bf16 = profile.plan(settings, mode="train", batch_size=16, precision="bf16")
    assert options["optimizer adamw-8bit"]["peak_bytes"] == eight_bit.total_bytes
    assert options["precision bf16"]["peak_bytes"] == pure_bf16.total_bytes


def test_an_auto_micro_batch_that_fits_nothing_is_offered_the_changes_at_batch_1():
    from workbook import params
    from workbook.planner import fit, profile
    settings = {**params.load_all()["h100"], "model": "llama-3.1-8b"}
    assert settings["micro_batch_size"] == "auto" and profile.plan(settings, mode="train", batch_size=1).max_batch_size == 0
    lora = next(option for option in fit.ways_to_fit(settings) if option["change"] == "lora_rank 16")
    assert lora["peak_bytes"] == profile.plan(settings, mode="train", batch_size=1, lora_rank=16).total_bytes


def test_the_ways_to_fit_an_unfit_run_are_planned_at_the_runs_own_sequence_length():
    # The training job plans at its max_seq_length, not the profile's seq_len (notebook 01's key).
    from workbook import params
    from workbook.planner import fit, profile
    from workbook.units import format_bytes
    settings = {**params.load_all()["h100"], "model": "llama-3.1-8b", "seq_len": 64}
    run = profile.plan(settings, mode="train", batch_size=1, seq_len=8192)
    lines = fit.lines_for_unfit_run(settings, DoesNotFitError(run.advice(), run))
    lora = profile.plan(settings, mode="train", batch_size=1, seq_len=8192, lora_rank=16)
    lora_line = next(line for line in lines if line.strip().startswith("lora_rank 16"))
    assert f"{format_bytes(lora.total_bytes)}, largest micro-batch" in lora_line


def test_the_chunked_loss_option_states_the_output_projections_share_of_the_flops():
    # Llama 3.2 1B: 2 x 128256 x 2048 head FLOPs per token against 6 x 1.24B: +7%, why it ranks third.
    from workbook import params
    from workbook.planner import fit
    settings = {**params.load_all()["h100"], "model": "llama-3.2-1b", "dtype": "bf16", "seq_len": 2048}
    chunked = next(option for option in fit.ways_to_fit(settings, batch_size=16)
                   if option["change"] == "loss_chunk_tokens 1024")
    assert chunked["throughput_cost"].startswith("+7% FLOPs where every token carries loss")


def test_advice_for_a_plan_that_fits_nothing_leaves_out_what_is_already_in_use():
    # QLoRA with 8-bit Adam already: the advice must not send the user back to int4, LoRA or adamw-8bit.
    qlora = plan_train(load_config("Llama-3.1-70B"), micro_batch_size=1, seq_len=2048, gpu_memory_bytes=16 * GiB,
                       dtype="int4", lora_rank=16, optimizer="adamw-8bit")
    assert qlora.max_batch_size == 0
    assert "QLoRA" not in qlora.advice() and "LoRA" not in qlora.advice() and "adamw-8bit" not in qlora.advice()
    assert "grad_checkpointing=True" in qlora.advice()


def test_advice_for_generation_in_ram_offers_no_quantized_weights():
    # On the cpu profile int8/int4 weights would need bitsandbytes on CUDA: only shorter lengths help bf16.
    in_ram = generate_8b(gpu_memory_bytes=GiB, dtype="bf16")
    in_ram.in_ram = True  # as the cpu profile marks its plans
    assert in_ram.max_batch_size == 0
    assert "quantized" not in in_ram.advice() and "shorter prompt_len or new_tokens" in in_ram.advice()
