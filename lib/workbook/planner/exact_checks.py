"""What CPU can check exactly: the planner's formulas against real tensors of the tiny model.

The same checks tests/test_memory.py makes on stand-in models, as a JSON-ready record
(``cpu_exact_checks.json``) that ``workbook calibrate`` writes on any machine and a notebook can show.
"""

from __future__ import annotations

import torch

from workbook import decoding, gpu, models, presets
from workbook.planner.formulas import kv_cache_bytes, training_activation_bytes_per_layer, weights_bytes
from workbook.tiny_model import TINY_MODEL_NAME, tiny_config
from workbook.tiny_model import ARCHITECTURE

CPU_CHECKS_FILE = "cpu_exact_checks.json"
ATTN_IMPLEMENTATION = models.DEFAULT_ATTENTION  # transformers' default; the planner's default too


def cpu_exact_checks() -> dict:
    """The planner's formulas against real tensors of the tiny model, on CPU: each must be exact.

    - parameter count and weight bytes (fp32 and bf16) against the trained tiny model as loaded;
    - KV cache bytes against the cache a real generate() builds (full length forced: it holds
      prompt + new - 1 tokens, the last token is never fed back);
    - activation bytes one decoder layer saves for backward (pure fp32, sdpa), against autograd's
      saved tensors (the difference between a 2-layer and a 1-layer model).
    The same checks tests/test_memory.py makes on stand-in models, here as a JSON-ready dict
    that a notebook can show.
    """

    loaded = models.load_model(TINY_MODEL_NAME, "fp32", "cpu")
    model, model_dir, config = loaded.model, loaded.path, tiny_config()
    tokenizer = models.load_tokenizer(TINY_MODEL_NAME)
    checks = [
        _check("parameters", "parameters of the tiny model (tied embeddings counted once)",
               presets.count_parameters(config), sum(p.numel() for p in model.parameters()),
               "parameters"),
        _check("weights_fp32", "weight bytes of the tiny model loaded in fp32",
               weights_bytes(config, "fp32"), _parameter_bytes(model), "bytes"),
        _kv_cache_check(model, tokenizer, config),
        _activation_check(config),
        _check("weights_bf16", "weight bytes of the tiny model cast to bf16",
               weights_bytes(config, "bf16"), _parameter_bytes(model.to(torch.bfloat16)),
               "bytes"),
    ]
    return {
        "checks": checks,
        "all_exact": all(check["exact"] for check in checks),
        "model_dir": str(model_dir),
        "versions": gpu.software_versions(),
    }


KV_CHECK_PROMPT = "What is 23 + 45?"
KV_CHECK_BATCH = 3
KV_CHECK_NEW_TOKENS = 8  # more than the tiny model's answer: min_new_tokens must force it
ACTIVATION_CHECK_BATCH, ACTIVATION_CHECK_SEQ_LEN = 3, 50  # 150 tokens: no parameter dimension


def _check(name: str, what: str, predicted: int, measured: int, unit: str) -> dict:
    return {"name": name, "what": what, "unit": unit, "predicted": int(predicted),
            "measured": int(measured), "exact": int(predicted) == int(measured)}


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _kv_cache_check(model, tokenizer, config) -> dict:
    prompt_ids = tokenizer(KV_CHECK_PROMPT, return_tensors="pt")["input_ids"]
    input_ids = prompt_ids.repeat(KV_CHECK_BATCH, 1)
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=KV_CHECK_NEW_TOKENS, min_new_tokens=KV_CHECK_NEW_TOKENS,
            do_sample=False, pad_token_id=decoding.pad_token_id(model, tokenizer), return_dict_in_generate=True,
        )
    generated = output.sequences.shape[1] - input_ids.shape[1]
    # Distinct storages: what the allocator holds, views counted once (DynamicCache, 5.17+).
    tensors = [t for layer in output.past_key_values.layers for t in (layer.keys, layer.values)]
    measured = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors}.values())
    tokens = input_ids.shape[1] + generated - 1
    predicted = kv_cache_bytes(config, "fp32", batch_size=KV_CHECK_BATCH, tokens=tokens)
    check = _check("kv_cache_after_generate",
                   f"KV cache of generate(): {KV_CHECK_BATCH} x ({input_ids.shape[1]} prompt + "
                   f"{generated} new - 1) tokens, fp32", predicted, measured, "bytes")
    check["exact"] = check["exact"] and generated == KV_CHECK_NEW_TOKENS
    check["generated_tokens"] = generated
    return check


def _activation_check(config) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM


    saved = {}
    for layers in (1, 2):
        layer_config = LlamaConfig(**{**ARCHITECTURE, "num_hidden_layers": layers},
                                   attn_implementation=ATTN_IMPLEMENTATION)
        torch.manual_seed(0)
        saved[layers] = _saved_activation_bytes(LlamaForCausalLM(layer_config).train())
    predicted = training_activation_bytes_per_layer(
        config, batch_size=ACTIVATION_CHECK_BATCH, seq_len=ACTIVATION_CHECK_SEQ_LEN,
        dtype="fp32", mixed_precision=False, attn_implementation=ATTN_IMPLEMENTATION,
    )
    return _check("activations_per_layer",
                  f"bytes one decoder layer saves for backward ({ACTIVATION_CHECK_BATCH} x "
                  f"{ACTIVATION_CHECK_SEQ_LEN} tokens, fp32, {ATTN_IMPLEMENTATION}), tiny "
                  "architecture, random weights", predicted, saved[2] - saved[1], "bytes")


def _saved_activation_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd saves in one training forward (not parameters)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, model.config.vocab_size,
                        (ACTIVATION_CHECK_BATCH, ACTIVATION_CHECK_SEQ_LEN))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(saved.values())
