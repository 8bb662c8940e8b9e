"""`accelerate estimate-memory` beside the planner: the figures are the command's own, and the plan,
the calibration record and `workbook plan` put them next to the planner's answer."""

import json
import types
from argparse import Namespace

import pytest
from accelerate.commands import estimate as accelerate_command

from workbook import cli, params, presets
from workbook.planner import accelerate_estimate, calibration
from workbook.planner import profile as planner_profile
from workbook.units import MiB
from test_calibration import H200_BYTES, gpu_like_measurement

ROWS = {"fp32": "float32", "bf16": "float16", "int8": "int8", "int4": "int4"}


@pytest.fixture
def command_without_the_hub(monkeypatch):
    """The command's own gather_data, its Hub lookup answered locally (the one step that needs a network)."""
    monkeypatch.setattr(accelerate_command, "verify_on_hub",
                        lambda repo, token=None: types.SimpleNamespace(config={}, library_name="transformers"))

    def gather(model_dir, row):
        args = Namespace(model_name=str(model_dir), library_name="transformers", trust_remote_code=False,
                         dtypes=[row])
        return accelerate_command.gather_data(args)[0]  # [dtype, largest layer, total size, training dict]
    return gather


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "Llama-3.1-8B", "Qwen2.5-0.5B"])
def test_the_figures_are_the_ones_the_command_prints(model, tmp_path, command_without_the_hub):
    directory = tmp_path / model
    presets.load_config(model).save_pretrained(directory)
    for dtype, row in ROWS.items():
        ours = accelerate_estimate.estimate(str(directory), dtype)
        _, largest, total, training = command_without_the_hub(directory, row)
        assert ours["dtype_row"] == row
        assert ours["load_bytes"] == total and ours["largest_layer_bytes"] == largest
        command_training = max(training.values())
        assert ours["training_bytes"] == (None if command_training == -1 else command_training)


def test_it_leaves_out_an_untied_output_projection_and_the_plan_says_how_much_more_it_holds():
    # Llama-3.1-8B's lm_head is its own matrix (128,256 x 4,096): the command's AutoModel has no head;
    # Llama-3.2-1B ties it to the embedding, so there the weights agree.
    for model, head_params in (("Llama-3.1-8B", 128_256 * 4_096), ("Llama-3.2-1B", 0)):
        plan = planner_profile.plan(params.load(params.profile_path("h100")), mode="generate", model=model, batch_size=1)
        compared = accelerate_estimate.beside_plan(plan, model)
        # Within its buffers: it also counts the rotary inv_freq tables (a few hundred bytes).
        assert plan.weights_bytes - compared["load_bytes"] == pytest.approx(2 * head_params, abs=1024)
        assert compared["planner_over_accelerate"] == pytest.approx(plan.total_bytes / compared["load_bytes"])
        assert compared["planner_over_accelerate"] > 1  # the plan adds the KV cache, activations, context


def test_training_figure_is_a_max_of_the_terms_not_their_sum():
    # bf16 mixed precision (its float16 row): fp32 weights 4 B, gradients 4 + 2 B, Adam states 8 B per
    # parameter; the command answers with the largest, 8 B, where the process holds them all at once.
    config = presets.load_config("Llama-3.2-1B")
    figures = accelerate_estimate.estimate(config, "bf16")
    assert figures["training_bytes"] == 4 * figures["load_bytes"]  # 8 B over the 2 B of the load row
    plan = planner_profile.plan(params.load(params.profile_path("h100")), mode="train", model="Llama-3.2-1B", batch_size=1)
    assert accelerate_estimate.beside_plan(plan, config)["planner_over_accelerate"] > 2


def test_the_calibration_record_sets_the_command_against_the_same_measured_peak():
    case = next(case for case in calibration.calibration_grid("h200") if case.name.startswith("llama-3.1-8b/generate"))
    plan = calibration.plan_for_case(case, gpu_memory_bytes=H200_BYTES, overhead_bytes=500 * MiB)
    measured = gpu_like_measurement(reserved=plan.total_bytes - 500 * MiB, allocated=plan.total_bytes - 600 * MiB,
                                    non_pytorch=500 * MiB)
    beside = accelerate_estimate.against_measured(plan, case.model, measured.peak_bytes)
    load = accelerate_estimate.estimate(case.model, "bf16")["load_bytes"]
    assert beside["accelerate_estimate_bytes"] == load
    assert beside["accelerate_relative_error"] == pytest.approx((load - plan.total_bytes) / plan.total_bytes)
    records = [{"case": {"name": case.name, "counts_toward_goal": True}, "status": "measured",
                "relative_error": 0.0, **beside}]
    summary = calibration.summarize(records)["accelerate_estimate_memory"]
    assert summary["cases"] == 1 and summary["cases_below_measured"] == 1
    assert summary["median_abs_relative_error"] == pytest.approx(abs(beside["accelerate_relative_error"]))


def test_workbook_plan_prints_the_command_beside_the_plan(capsys):
    assert cli.main(["plan", "--profile", "h100", "--model", "llama-3.1-8b", "--mode", "generate"]) == 0
    printed = capsys.readouterr().out
    assert "accelerate estimate-memory (float16 row): 14.0 GiB" in printed and "this plan is" in printed
    assert cli.main(["plan", "--profile", "h100", "--model", "llama-3.2-1b", "--mode", "train", "--json"]) == 0
    beside = json.loads(capsys.readouterr().out)["accelerate_estimate_memory"]
    assert beside["mode"] == "train" and beside["dtype_row"] == "float16"
    assert beside["bytes"] == beside["training_bytes"] and beside["planner_over_accelerate"] > 2
