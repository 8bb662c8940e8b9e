"""Figures a reader reads on their own: on the cpu profile the memory is system RAM, not "GPU
memory", and a plan of a few MiB against 23 GiB of RAM is shown where it can be seen."""

import pytest

from workbook import params, plots
from workbook.paths import PARAMS_DIR
from workbook.planner import profile as planner_profile
from workbook.units import GiB, MiB


def legend_texts(axis) -> list[str]:
    """The axis's legend, or its figure's (drawn below the panel)."""
    legend = axis.get_legend() or axis.figure.legends[0]
    return [text.get_text() for text in legend.get_texts()]


@pytest.mark.parametrize("mode", ["generate", "train"])
def test_the_cpu_plan_says_system_ram_and_zooms_on_a_bar_too_small_to_see(mode):
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    plan = planner_profile.plan(cpu, mode=mode)
    assert plan.total_bytes < 0.01 * plan.capacity_bytes  # the tiny model: MiB against GiB of RAM
    figure = plots.plan_breakdown(plan, on_gpu=cpu.gpu_count > 0)
    axis = figure.axes[0]
    texts = legend_texts(axis)
    assert any(text.startswith("system RAM: ") for text in texts) and not any("GPU" in text for text in texts)
    assert "per GPU" not in axis.get_xlabel()
    [zoom] = axis.child_axes
    assert zoom.get_xlabel() == "MiB" and zoom.get_xlim()[1] == pytest.approx(1.05 * plan.total_bytes / MiB)
    assert "system RAM" in zoom.get_title()


def test_a_gpu_plan_that_fills_its_gpu_is_drawn_at_full_scale_only():
    h200 = params.load(PARAMS_DIR / "h200.yaml")
    plan = planner_profile.plan(h200, mode="generate", model="llama-3.1-8b", batch_size=32)
    axis = plots.plan_breakdown(plan).axes[0]
    assert axis.child_axes == [] and any(text.startswith("GPU memory: ") for text in legend_texts(axis))
    assert "per GPU" in axis.get_xlabel()


def test_memory_vs_batch_on_cpu_names_system_ram_and_no_gpu():
    figure = plots.memory_vs_batch({"fp32": ([1, 2], [GiB, 2 * GiB])}, 24 * GiB, 22 * GiB, "t", on_gpu=False)
    axis = figure.axes[0]
    assert "system RAM 24.0 GiB" in legend_texts(axis)
    assert "GPU" not in axis.get_ylabel() + axis.get_xlabel()


def test_memory_vs_batch_marks_the_runs_batch_on_a_scale_that_shows_it():
    # A tiny model fits hundreds of thousands of rows: on a linear axis batch 32 would sit at 0.
    batches = [1, 32, 1024, 400_000]
    figure = plots.memory_vs_batch({"fp32": (batches, [b * 2**20 for b in batches])}, 24 * GiB, 22 * GiB, "t",
                                   on_gpu=False, mark_batch=32)
    axis = figure.axes[0]
    assert "this run's batch (32)" in legend_texts(axis) and axis.get_xscale() == "log"


def test_the_overview_says_when_the_weights_are_too_small_to_see():
    devices = [{"label": "CPU RAM", "total_bytes": 24 * GiB, "free_bytes": 20 * GiB}]
    figure = plots.memory_overview(devices, 3 * MiB, caption="psutil")
    [legend] = figure.legends  # below the panel, where it covers no bar
    [weights] = [text.get_text() for text in legend.get_texts() if text.get_text().startswith("model weights")]
    assert legend.get_title().get_text() == "psutil"
    assert "of CPU RAM: at 0 on this scale" in weights
    figure = plots.memory_overview(devices, 8 * GiB, caption="psutil")
    assert "model weights alone: 8.00 GiB" in legend_texts(figure.axes[0])
