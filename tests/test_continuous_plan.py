"""The continuous backend's memory: a paged cache sized by the planner, planned by the planner."""

import math
import threading
import time

import pytest

from workbook import generation, models, params
from workbook.generation import continuous
from workbook.paths import PARAMS_DIR
from workbook.planner import profile
from workbook.planner.paged import paged_layout, plan_generate_paged


def test_the_paged_cache_holds_every_request_in_flight_at_its_full_length():
    layout = paged_layout(requests=32, prompt_tokens=40, new_tokens=2048, page_size=256)
    assert layout.blocks_per_request == math.ceil(2088 / 256) == 9 and layout.num_blocks == 32 * 9
    assert layout.max_batch_tokens == 32 * 40  # all prompts prefilled in one step
    assert paged_layout(4096, 512, 16).max_batch_tokens == 4096  # a step holds every request's next token


def test_batch_size_auto_for_continuous_is_the_largest_in_flight_limit_the_paged_plan_fits():
    values = params.load(PARAMS_DIR / "h100.yaml")
    values.update(model="llama-3.1-8b", prompt_len=512, max_new_tokens=2048, batch_size="auto")
    limit = profile.resolve_batch_size({**values, "backend": "continuous"}, "generate")
    assert limit > 1

    def paged(batch):
        return profile.plan(values, mode="generate", batch_size=batch, backend="continuous")

    assert paged(limit).fits and not paged(limit + 1).fits
    terms = {term.name: term.bytes for term in paged(limit).terms}
    layout = paged_layout(limit, 512, 2048)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B: 2 x layers x kv heads x head_dim x bf16
    assert terms["kv_cache"] == (layout.num_blocks + 2) * 256 * kv_per_token
    assert profile.plan(values, mode="generate", batch_size=limit).settings.get("backend") is None  # static: dense


def test_the_continuous_plan_plans_the_attention_transformers_will_switch_to(monkeypatch):
    """transformers runs continuous batching on flash attention wherever flash-attn is installed,
    even when the model loaded with sdpa; the plan then counts no dense mask and no K/V repeated to
    every head, so `batch_size: auto` may take more requests in flight."""
    import transformers.utils

    values = params.load(PARAMS_DIR / "h100.yaml")
    values.update(model="llama-3.1-8b", prompt_len=512, max_new_tokens=2048, attn_implementation="sdpa")

    def terms(batch):
        made = profile.plan(values, mode="generate", batch_size=batch, backend="continuous")
        return made, {term.name: term.bytes for term in made.terms}

    without, sdpa_terms = terms(64)
    assert sdpa_terms["attention_mask"] > 0 and without.settings["attn_implementation"] == "sdpa"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a, **k: True)
    flash, flash_terms = terms(64)
    assert flash.settings["attn_implementation"] == "flash_attention_2" and flash_terms["attention_mask"] == 0
    assert flash_terms["kv_read"] < sdpa_terms["kv_read"] / 3  # 2 x 8 kv heads read, not 2 x 32 + 8
    assert profile.resolve_batch_size({**values, "batch_size": "auto", "backend": "continuous"}, "generate") > \
        without.max_batch_size


def allocated_cache_bytes(cache) -> int:
    """Bytes of the paged cache transformers allocated: one uint8 tensor (5.2x), or a key and a value
    tensor per layer (5.17, the GPU image's release)."""
    if hasattr(cache, "cache_tensor"):
        return cache.cache_tensor.numel()
    return sum(tensor.numel() * tensor.element_size() for tensor in [*cache.key_cache, *cache.value_cache])


def test_the_backend_passes_the_planned_cache_to_transformers_and_it_allocates_that(tiny_model_path):
    model = generation.load_model(str(tiny_model_path), "fp32", "cpu")[0]
    settings = generation.DecodingSettings(16, models.eos_token_ids(model, None), 0)
    backend = generation.make_backend("continuous", model, settings, 4)
    manager = backend._start(4, 20, 16)
    try:
        config = manager.continuous_batching_config
        assert (config.num_blocks, config.max_requests_per_batch) == (backend.layout.num_blocks, 4)
        allocated = allocated_cache_bytes(manager.batch_processor.cache)
    finally:
        continuous.stop_manager(manager)
    plan = plan_generate_paged(model.config, batch_size=4, prompt_len=20, new_tokens=16, dtype="fp32",
                               gpu_memory_bytes=2**34)
    planned = next(term.bytes for term in plan.terms if term.name == "kv_cache")
    assert planned == pytest.approx(allocated, rel=0.01)
    assert model.config._attn_implementation == "sdpa"  # given back after the manager


def test_ctrl_c_in_a_stream_stops_transformers_at_once_not_after_its_requests_in_flight(tiny_model_path):
    """A KeyboardInterrupt (Ctrl-C, a benchmark's time budget) while requests are in flight: the
    manager is stopped hard, as after a kill, instead of flushing (generating every request it holds
    to its end, which for an 8B model's long outputs is minutes, with no time limit in its destroy)."""
    model = generation.load_model(str(tiny_model_path), "fp32", "cpu")[0]
    settings = generation.DecodingSettings(300, (-1,), 0)  # -1: no end of sequence, every output runs to its length
    backend = generation.make_backend("continuous", model, settings, 4)
    prompts = [generation.Prompt(0, [5, 6, 7], 2)] + [generation.Prompt(i, [5, 6, 7, 8], 300) for i in range(1, 8)]
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(time.perf_counter()))

    def interrupt(outcome):  # the first request done, three of 300 tokens in flight
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            backend.stream(prompts, write=interrupt, log=lambda line: None, sort_by_length=False)
        interrupted = len(forwards)
        time.sleep(0.2)
    finally:
        hook.remove()
    assert interrupted < 20  # a flush would have run ~300 more steps
    assert len(forwards) == interrupted  # and nothing runs on after it
    assert not [thread for thread in threading.enumerate() if "generation" in repr(thread.__dict__.get("_target"))]
