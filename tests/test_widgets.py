"""The widget tuner, driven by setting control values as a person's clicks would."""

import matplotlib
import pytest

matplotlib.use("Agg")

from workbook import params, presets, widgets  # noqa: E402
from workbook.planner import profile  # noqa: E402


@pytest.fixture
def tuner():
    profiles = params.load_all()
    return widgets.PlannerTuner(profiles, presets.preset_names(), {**profiles["h200"], "model": "llama-3.1-8b"})


def title(tuner):
    return tuner.figure.axes[0].get_title()


def test_auto_batch_starts_at_the_planners_answer(tuner):
    assert tuner.batch_size.value == tuner.plan.max_batch_size > 32
    assert "FITS" in tuner.verdict.value and f"<b>{tuner.plan.max_batch_size}</b>" in tuner.max_batch.value


def test_batch_beyond_the_maximum_flips_the_verdict_and_redraws(tuner):
    before = title(tuner)
    tuner.batch_size.value = tuner.plan.max_batch_size + 1
    assert "DOES NOT FIT" in tuner.verdict.value and title(tuner) != before
    assert f"batch {tuner.plan.max_batch_size + 1}" in title(tuner)


def test_model_profile_and_mode_changes_update_the_max_batch(tuner):
    on_h200 = tuner.plan.max_batch_size
    tuner.profile.value = "h100"
    assert 0 < tuner.plan.max_batch_size < on_h200
    tuner.model.value = "Llama-3.1-70B"
    assert tuner.plan.max_batch_size == 0 and "<b>0</b>" in tuner.max_batch.value
    tuner.model.value = "Llama-3.2-1B"
    tuner.mode.value = "train"
    assert tuner.plan.mode == "train" and tuner.prompt_len.disabled and not tuner.seq_len.disabled
    without = tuner.plan.max_batch_size
    tuner.grad_checkpointing.value = True
    assert tuner.plan.max_batch_size > without
    tuner.lora_rank.value = 16
    assert tuner.plan.trainable_params < tuner.plan.params


def test_a_callback_error_is_shown_not_swallowed(tuner, monkeypatch):
    assert tuner.error.layout.display == "none"
    working = profile.plan

    def broken(*args, **kwargs):
        raise ValueError("planner exploded")
    monkeypatch.setattr(profile, "plan", broken)
    tuner.batch_size.value = 3
    assert "ValueError: planner exploded" in tuner.error.value and tuner.error.layout.display != "none"
    # The verdict no longer claims the previous settings' answer.
    assert "NOT UPDATED" in tuner.verdict.value and "FITS" not in tuner.verdict.value
    monkeypatch.setattr(profile, "plan", working)
    tuner.batch_size.value = 4
    assert tuner.error.value == "" and tuner.error.layout.display == "none" and "FITS" in tuner.verdict.value


def test_each_mode_keeps_its_own_batch(tuner):
    generate_batch = tuner.batch_size.value
    tuner.mode.value = "train"
    # llama-3.1-8b does not train on one H200 even at batch 1: 'auto' gives 1, not the generate batch.
    assert tuner.batch_size.value == 1 and tuner.plan.batch_size == 1 and tuner.plan.mode == "train"
    tuner.batch_size.value = 2
    tuner.mode.value = "generate"
    assert tuner.batch_size.value == generate_batch == tuner.plan.batch_size
    tuner.mode.value = "train"
    assert tuner.batch_size.value == 2


def test_the_slider_spans_twice_the_largest_batch(tuner):
    assert tuner.batch_size.max == 2 * tuner.plan.max_batch_size
    tuner.model.value = "Llama-3.2-1B"
    assert tuner.batch_size.max == 2 * tuner.plan.max_batch_size > 2 * 345


def test_the_line_under_the_verdict_says_what_to_change_or_what_is_left(tuner):
    assert "of the budget left per GPU" in tuner.advice.value
    tuner.batch_size.value = tuner.plan.max_batch_size + 1
    assert f"the largest batch that fits is {tuner.plan.max_batch_size}" in tuner.advice.value
    tuner.profile.value = "cpu"  # plans this machine's RAM: no "per GPU" anywhere
    assert "budget" in tuner.verdict.value and "per GPU" not in tuner.verdict.value


def test_a_preset_given_in_another_case_is_listed_once(tuner):
    assert tuner.model.value == "Llama-3.1-8B"
    names = [name.lower() for name in tuner.model.options]
    assert len(names) == len(set(names))


@pytest.mark.slow
def test_the_tuner_shows_the_layout_it_plans_a_teacher_bigger_than_one_gpu_with():
    profiles = params.load_all()
    tuner = widgets.PlannerTuner(profiles, presets.preset_names(),
                                 {**profiles["h100x8"], "model": "llama-3.1-70b", "batch_size": 8})
    assert tuner.tensor_parallel.value == "auto" and tuner.plan.tensor_parallel_size >= 2
    layout = f"T={tuner.plan.tensor_parallel_size} x D={8 // tuner.plan.tensor_parallel_size}"
    assert layout in tuner.max_batch.value and f"layout {layout}" in tuner.notes.value  # and why
    tuner.tensor_parallel.value = 1  # the whole 70B on each GPU: not even batch 1
    assert tuner.plan.max_batch_size == 0 and "T=1 x D=8" in tuner.max_batch.value


@pytest.mark.slow
def test_the_training_memory_switches_replan_and_an_overfull_setting_lists_what_would_fit(tuner):
    tuner.mode.value = "train"
    tuner.model.value = "Llama-3.2-1B"
    tuner.seq_len.value = 2048
    tuner.batch_size.value = 32
    assert "DOES NOT FIT" in tuner.verdict.value and "changes that would make it fit" in tuner.advice.value
    full_logits = tuner.plan.total_bytes
    tuner.loss_chunk_tokens.value = 1024
    assert tuner.plan.settings["loss_chunk_tokens"] == 1024 and tuner.plan.total_bytes < full_logits
    tuner.precision.value = "bf16"  # the h200 profile's dtype is bf16
    assert tuner.plan.settings["mixed_precision"] is False
    tuner.mode.value = "generate"
    assert tuner.loss_chunk_tokens.disabled and tuner.precision.disabled


def test_the_trace_button_traces_the_setting_shown_and_a_slider_move_traces_nothing():
    import html

    from workbook.units import format_bytes
    profiles = params.load_all()
    tuner = widgets.PlannerTuner(profiles, presets.preset_names(), {
        **profiles["cpu"], "model": "tiny", "plan_mode": "train", "micro_batch_size": 2, "seq_len": 64})
    assert tuner.traced is None and tuner.trace_output.value == ""
    assert tuner.trace_button.description.startswith("Trace this setting (fake tensors, ~")
    tuner.trace_button.click()
    traced, shown = tuner.traced, html.unescape(tuner.trace_output.value)
    assert traced["mode"] == "train" and traced["settings"]["micro_batch_size"] == 2 and traced["settings"]["seq_len"] == 64
    # The peak, its phase and its bytes by kind, beside the plan's terms.
    assert f"peak {format_bytes(traced['peak_bytes'])} ({traced['peak_bytes']:,} B) in {traced['phase']}" in shown
    assert all(f"{kind} {format_bytes(value)}" in shown for kind, value in traced["by_kind"].items())
    assert "trace beside the plan" in shown and traced["beside_plan"]["plan_tensor_bytes"] < tuner.plan.total_bytes
    # A slider move re-plans and traces nothing: the trace shown is marked as another setting's.
    tuner.batch_size.value = 3
    assert tuner.plan.batch_size == 3 and tuner.traced is traced
    assert "earlier setting" in tuner.trace_output.value
    # What cannot be traced is said, and the plan stands.
    tuner.dtype.value = "int4"
    tuner.lora_rank.value = 4
    tuner.trace_button.click()
    assert "dtype int4" in html.unescape(tuner.trace_output.value) and "FIT" in tuner.verdict.value
