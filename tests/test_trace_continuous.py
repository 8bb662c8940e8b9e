"""The continuous backend traced (planner.trace.trace_continuous): transformers' manager made as the backend makes
it, its batch processor's steps run in this thread on fake tensors, hold what the same steps hold on real tensors,
and its paged cache is the one the plan counts."""

from workbook import params
from workbook.planner import profile, trace
from workbook.planner.paged import plan_generate_paged
from workbook.units import GiB


def test_the_paged_steps_on_fake_tensors_hold_what_they_hold_on_real_ones_and_the_cache_the_plan_counts():
    fake, real = (trace.trace_generation("tiny", batch_size=3, prompt_len=20, new_tokens=8, dtype="fp32",
                                         backend="continuous", fake=fake) for fake in (True, False))
    assert (fake.peak_bytes, fake.phase, fake.by_kind) == (real.peak_bytes, real.phase, real.by_kind)
    assert fake.phase_peaks == real.phase_peaks
    assert set(fake.phase_peaks) == set(trace.GENERATION_PHASES)
    assert fake.settings["cache"] == "PagedAttentionCache"
    plan = plan_generate_paged("tiny", batch_size=3, prompt_len=20, new_tokens=8, dtype="fp32",
                               gpu_memory_bytes=16 * GiB)
    planned = {term.name: term.bytes for term in plan.terms}
    # transformers allocates the cache the plan counts, in full at the start.
    assert fake.by_kind["kv_cache"] == planned["kv_cache"]


def test_a_continuous_plan_is_traced_beside_its_paged_terms():
    settings = {**params.load_all()["cpu"], "model": "tiny", "backend": "continuous", "prompt_len": 20,
                "max_new_tokens": 8}
    plan = profile.plan(settings, mode="generate", batch_size=3)
    block = trace.traced_plan(settings, plan)
    assert "error" not in block and block["settings"]["backend"] == "continuous"
    groups = {group["group"]: group for group in block["beside_plan"]["groups"]}
    assert groups["KV cache"]["plan_bytes"] == groups["KV cache"]["trace_bytes"]
    assert {"kv_read", "attention_mask"} <= set(groups["activations, logits and temporaries"]["plan_terms"])
