"""Figures the notebooks show and save. Only this module (and `widgets`) imports matplotlib.

Every figure says what it shows, in what unit, and where the numbers came from (title/caption),
so a PNG found later in `outputs/` still reads on its own.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from workbook.units import GiB, format_bytes


def memory_overview(devices: list[dict], weights_bytes: int | None, caption: str):
    """Horizontal bars: used and free memory per device, and the model's weights as a line.

    `devices`: [{"label", "total_bytes", "free_bytes"}]. Returns the figure.
    """
    figure, axis = plt.subplots(figsize=(8, 0.6 * len(devices) + 1.6))
    labels = [d["label"] for d in devices]
    used = [(d["total_bytes"] - d["free_bytes"]) / GiB for d in devices]
    free = [d["free_bytes"] / GiB for d in devices]
    axis.barh(labels, used, color="#c44e52", label="in use (read now)")
    axis.barh(labels, free, left=used, color="#8fbc8f", label="free (read now)")
    if weights_bytes:
        axis.axvline(weights_bytes / GiB, color="black", linestyle="--",
                     label=f"model weights alone: {format_bytes(weights_bytes)}")
    axis.set_xlabel("GiB")
    axis.invert_yaxis()
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("Memory per device", fontsize=11)
    figure.text(0.01, -0.02, caption, fontsize=7, ha="left", va="top", wrap=True)
    figure.tight_layout()
    return figure


TERM_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
               "#ccb974", "#64b5cd")


def plan_breakdown(plan, axis=None):
    """One stacked bar of the plan's terms (GiB) against the GPU's memory and the planner's budget."""
    figure = None
    if axis is None:
        figure, axis = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for index, term in enumerate(plan.terms):
        width = term.bytes / GiB
        axis.barh([0], [width], left=left, color=TERM_COLORS[index % len(TERM_COLORS)],
                  label=f"{term.name}: {format_bytes(term.bytes)}")
        left += width
    axis.axvline(plan.capacity_bytes / GiB, color="black", linewidth=2,
                 label=f"GPU memory: {format_bytes(plan.capacity_bytes)}")
    axis.axvline(plan.budget_bytes / GiB, color="black", linestyle="--",
                 label=f"budget ({plan.safety_margin:.0%} kept free)")
    axis.set_yticks([])
    axis.set_xlim(0, max(left, plan.capacity_bytes / GiB) * 1.05)
    axis.set_xlabel("GiB per GPU (predicted by the planner from the model config)")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    axis.set_title(f"{plan.model}, {plan.mode}, {plan.dtype}, batch {plan.batch_size}: "
                   f"{format_bytes(plan.total_bytes)} predicted, {verdict} (max batch {plan.max_batch_size})",
                   fontsize=10)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if figure is not None:
        figure.tight_layout()
    return figure or axis.figure


def memory_vs_batch(curves: dict, capacity_bytes: int, budget_bytes: int, title: str, axis=None):
    """Predicted peak memory against batch size, one line per setting, with the GPU's capacity.

    `curves`: {label: (batch sizes, total bytes)}.
    """
    figure = None
    if axis is None:
        figure, axis = plt.subplots(figsize=(7, 4))
    for label, (batches, totals) in curves.items():
        axis.plot(batches, [t / GiB for t in totals], marker=".", label=label)
    axis.axhline(capacity_bytes / GiB, color="black", linewidth=2, label=f"GPU memory {format_bytes(capacity_bytes)}")
    axis.axhline(budget_bytes / GiB, color="black", linestyle="--", label="budget (safety margin kept free)")
    axis.set_xlabel("batch size (sequences per GPU)")
    axis.set_ylabel("predicted peak, GiB per GPU")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    if figure is not None:
        figure.tight_layout()
    return figure or axis.figure


def memory_accuracy(result: dict):
    """Planner prediction against measured peak per calibration case, with the y = x line.

    `result` is what `calibration.run_calibration` writes (memory_accuracy.json).
    """
    figure, (scatter_axis, error_axis) = plt.subplots(1, 2, figsize=(12, 4.8))
    measured = [r for r in result["cases"] if r["status"] == "measured"]
    for mode in sorted({r["case"]["mode"] for r in measured}):
        points = [r for r in measured if r["case"]["mode"] == mode]
        scatter_axis.scatter([r["measured_bytes"] / GiB for r in points], [r["predicted_bytes"] / GiB for r in points],
                             label=mode, s=25)
    top = max([r["measured_bytes"] / GiB for r in measured] + [1.0]) * 1.05
    scatter_axis.plot([0, top], [0, top], color="black", linewidth=1, label="prediction = measurement")
    scatter_axis.set_xlabel("measured peak, GiB (max_memory_reserved + non-PyTorch)")
    scatter_axis.set_ylabel("predicted peak, GiB (planner)")
    scatter_axis.legend(fontsize=8)
    scatter_axis.grid(alpha=0.3)
    names = [r["case"]["name"] for r in measured]
    errors = [100 * r["relative_error"] for r in measured]
    error_axis.barh(names, errors, color=["#c44e52" if abs(e) > 4 else "#4c72b0" for e in errors])
    error_axis.axvline(0, color="black", linewidth=1)
    error_axis.set_xlabel("(predicted - measured) / measured, %  (positive: safe side)")
    error_axis.tick_params(axis="y", labelsize=7)
    summary = result["summary"]
    hardware = result["hardware"]["gpus"][0]["name"] if result["hardware"]["gpus"] else "no GPU"
    median, worst = summary.get("median_abs_relative_error"), summary.get("max_abs_relative_error")
    figure.suptitle(f"Memory planner accuracy on {hardware} ({result['profile']}): median |error| "
                    f"{median:.2%}, max {worst:.2%} over {len(measured)} measured cases" if measured else
                    f"Memory planner accuracy on {hardware}: no case measured", fontsize=10)
    figure.tight_layout()
    return figure
