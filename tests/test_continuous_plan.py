"""The continuous backend's memory: a paged cache sized by the planner, planned by the planner."""

import functools
import math
import threading
import time

import pytest

from workbook import decoding, generation, params
from workbook.generation import continuous
from workbook.paths import PARAMS_DIR
from workbook.planner import profile
from workbook.planner.paged import continuous_attention, paged_layout, plan_generate_paged


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
    settings = generation.DecodingSettings(16, decoding.eos_token_ids(model, None), 0)
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


def test_a_streams_paged_cache_is_sized_for_its_longest_prompt_and_its_largest_output(tiny_model_path):
    model = generation.load_model(str(tiny_model_path), "fp32", "cpu")[0]
    settings = generation.DecodingSettings(16, decoding.eos_token_ids(model, None), 0)
    backend = generation.make_backend("continuous", model, settings, 2)
    # The longest prompt is not the one with the most new tokens: the cache must hold both maxima.
    prompts = [generation.Prompt(0, [5, 6, 7], 16), generation.Prompt(1, [5] * 40, 4), generation.Prompt(2, [5, 6], 2)]
    start, given = model.init_continuous_batching, []

    @functools.wraps(start)  # the backend reads its signature
    def recording(*args, **kwargs):
        given.append(kwargs)
        return start(*args, **kwargs)

    model.init_continuous_batching = recording
    written = []
    backend.stream(prompts, write=written.append, log=lambda line: None)
    assert len(written) == 3
    assert backend.layout == paged_layout(2, 40, 16)  # 2 in flight of 40 + 16 tokens; a step prefills 2 x 40
    [arguments] = given
    config = arguments["continuous_batching_config"]
    assert (config.num_blocks, config.max_batch_tokens) == (backend.layout.num_blocks, 80)
    assert config.safety_margin == 0.0  # every block is planned for a request in flight: none held back
    hints = arguments["workload_hints"]  # flash attention's decode path sizes its block table by them
    assert (hints.max_prompt_length, hints.max_generated_length, hints.num_requests) == (40, 16, 2)


def test_a_request_one_token_longer_than_its_pages_gets_one_more_page():
    # Exactly two pages hold 512 tokens; the 513th needs a third, or the request would not fit in flight.
    assert paged_layout(requests=3, prompt_tokens=500, new_tokens=12, page_size=256).num_blocks == 3 * 2
    assert paged_layout(requests=3, prompt_tokens=500, new_tokens=13, page_size=256).num_blocks == 3 * 3
    with pytest.raises(ValueError, match="prompt_tokens must be a positive integer"):
        paged_layout(requests=3, prompt_tokens=0, new_tokens=13)  # a clear error, not an empty cache


def test_the_continuous_plan_counts_a_layers_cache_read_the_sdpa_mask_and_every_requests_logits():
    """Llama-3.1-8B (32 heads, 8 kv heads of 128, vocab 128,256) in bf16, 8 requests of 512 + 2048
    tokens: 8 x 10 pages of 256 = 20,480 cache tokens, steps of at most 2,048 tokens."""
    def terms(attention):
        made = plan_generate_paged("llama-3.1-8b", batch_size=8, prompt_len=512, new_tokens=2048,
                                   gpu_memory_bytes=80 * 2**30, attn_implementation=attention)
        return {term.name: term.bytes for term in made.terms}

    sdpa, flash = terms("sdpa"), terms("flash_attention_2")
    # sdpa reads keys and values repeated to all 32 heads, plus the 8 stored kv heads; flash reads
    # the 2 x 8 stored ones. Each cache token also has an int64 read index.
    assert sdpa["kv_read"] == 20480 * ((2 * 32 + 8) * 128 * 2 + 8)
    assert flash["kv_read"] == 20480 * (2 * 8 * 128 * 2 + 8)
    # sdpa's mask: every step token against the cache and the step itself; flash needs none.
    assert sdpa["attention_mask"] == 2048 * (20480 + 2048) * 2 and flash["attention_mask"] == 0
    # flash double-buffers a step's inputs (async batching): twice the step's largest transient.
    assert flash["activations"] == 2 * sdpa["activations"] > 0
    # Every request in flight picks its next token: 8 rows of bf16 logits, and their fp32 copy.
    assert sdpa["logits"] == flash["logits"] == 8 * 128256 * (2 + 4)


def test_on_eight_gpus_the_continuous_plan_is_eight_whole_copies():
    values = {**params.load(params.profile_path("h100x8")), "model": "Llama-3.1-8B", "tensor_parallel_size": "auto"}
    plan = profile.plan(values, mode="generate", batch_size=1, backend="continuous")
    assert (plan.tensor_parallel_size, plan.data_parallel_size) == (1, 8)


def test_a_flash_attention_the_model_asked_for_is_planned_as_asked(monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda *a, **k: True)
    assert continuous_attention("flash_attention_3") == "flash_attention_3"  # not switched to 2
    assert continuous_attention("sdpa") == "flash_attention_2"  # transformers switches sdpa where flash is installed
