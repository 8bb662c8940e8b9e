"""Figures the notebooks show and save. Only this module, `benchmark_plots` (notebook 04's figures) and
`widgets` import matplotlib.

Every figure says what it shows, in what unit, and where the numbers came from (title/caption),
so a PNG found later in `outputs/` still reads on its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt

from workbook.paths import REPO_ROOT
from workbook.units import GiB, binary_unit, format_bytes

# Below this fraction of the axis a bar is a few pixels or none: the figure adds a zoomed view.
VISIBLE_FRACTION = 0.02

# An absolute path inside a title (a model folder, a data file): at the start or after a space, bracket,
# quote or '='. "tokens/s", "n/a" and "1/T" are words with a slash, not paths.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/[\w.+@-]+(?:/[\w.+@-]+)*/?")


def without_machine_paths(text: str) -> str:
    """``text`` with each absolute path shown as a reader on another machine can follow it: relative to
    the checkout when inside it (``outputs/models/tiny-32d8f802``), else its last name
    (``/models/Llama-3.1-8B-Instruct`` -> ``Llama-3.1-8B-Instruct``). A PNG is shared; this machine's
    folders mean nothing where it is read. Every title and caption below goes through it."""
    def shown(match: re.Match) -> str:
        found = match.group(0)
        trailing = found[len(found.rstrip(".")):]  # a sentence's full stop is not part of the path
        path = Path(found.rstrip(".").rstrip("/") or "/")
        if path.is_relative_to(REPO_ROOT) and path != REPO_ROOT:
            return f"{path.relative_to(REPO_ROOT)}{trailing}"
        return f"{path.name or found}{trailing}"
    return ABSOLUTE_PATH.sub(shown, text)


def memory_name(on_gpu: bool) -> str:
    """What a plan's capacity is: one GPU's memory, or on the cpu profile (no GPU) this machine's RAM.
    A plan cannot tell (the planner plans the cpu profile as one device): the caller says, from the
    profile's gpu_count."""
    return "GPU memory" if on_gpu else "system RAM"


def memory_overview(devices: list[dict], weights_bytes: int | None, caption: str):
    """Horizontal bars: used and free memory per device, and the model's weights as a line.

    `devices`: [{"label", "total_bytes", "free_bytes"}]. Returns the figure.
    """
    figure, axis = plt.subplots(figsize=(8, 0.6 * len(devices) + 1.8), layout="constrained")
    labels = [d["label"] for d in devices]
    used = [(d["total_bytes"] - d["free_bytes"]) / GiB for d in devices]
    free = [d["free_bytes"] / GiB for d in devices]
    axis.barh(labels, used, color="#c44e52", label="in use (read now)")
    axis.barh(labels, free, left=used, color="#8fbc8f", label="free (read now)")
    if weights_bytes:
        smallest = min(devices, key=lambda d: d["total_bytes"])
        share = weights_bytes / smallest["total_bytes"] if smallest["total_bytes"] else 1.0
        unseen = f" ({share:.2%} of {smallest['label']}: at 0 on this scale)" if share < VISIBLE_FRACTION else ""
        axis.axvline(weights_bytes / GiB, color="black", linestyle="--",
                     label=f"model weights alone: {format_bytes(weights_bytes)}{unseen}")
    axis.set_xlabel("GiB")
    axis.invert_yaxis()
    # Below the panel, not over the bars: one device's bar fills the panel's width.
    figure.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False, title=without_machine_paths(caption),
                  title_fontsize=7)
    axis.set_title("Memory per device", fontsize=11)
    return figure


TERM_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
               "#ccb974", "#64b5cd")


def _stacked_terms(axis, plan, unit_bytes: int, labelled: bool) -> float:
    """The plan's terms as one stacked bar in `unit_bytes`; returns its length. A term not alive at the
    peak (0 bytes: the plan's notes say when it is) has no bar and no legend entry."""
    left = 0.0
    for index, term in enumerate(plan.terms):
        width = term.bytes / unit_bytes
        axis.barh([0], [width], left=left, color=TERM_COLORS[index % len(TERM_COLORS)],
                  label=f"{term.name}: {format_bytes(term.bytes)}" if labelled and term.bytes else None)
        left += width
    return left


def plan_breakdown(plan, axis=None, on_gpu: bool = True):
    """One stacked bar of the plan's terms (GiB) against the memory (one GPU's; with `on_gpu` False,
    the cpu profile, this machine's RAM) and the planner's budget. A plan too small to see at that
    scale (the tiny model in RAM) gets a zoomed view of its bar inside the axis, in its own unit."""
    figure = None
    if axis is None:
        figure, axis = plt.subplots(figsize=(9, 2.8))
    memory = memory_name(on_gpu)
    left = _stacked_terms(axis, plan, GiB, labelled=True)
    axis.axvline(plan.capacity_bytes / GiB, color="black", linewidth=2,
                 label=f"{memory}: {format_bytes(plan.capacity_bytes)}")
    axis.axvline(plan.budget_bytes / GiB, color="black", linestyle="--",
                 label=f"budget ({plan.safety_margin:.0%} kept free)")
    axis.set_yticks([])
    axis.set_xlim(0, max(left, plan.capacity_bytes / GiB) * 1.05)
    axis.set_xlabel(f"GiB{' per GPU' if on_gpu else ''} (predicted by the planner from the model config)")
    if plan.capacity_bytes and plan.total_bytes < VISIBLE_FRACTION * plan.capacity_bytes:
        _zoomed_bar(axis, plan, memory)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    axis.set_title(without_machine_paths(
        f"{plan.model}, {plan.mode}, {plan.dtype}, batch {plan.batch_size}: "
        f"{format_bytes(plan.total_bytes)} predicted, {verdict} (max batch {plan.max_batch_size})"), fontsize=10)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if figure is not None:
        figure.tight_layout()
    return figure or axis.figure


def _zoomed_bar(axis, plan, memory: str) -> None:
    """The plan's bar again, inside `axis` and in the unit that shows it (the colours of the legend)."""
    unit_name, unit_bytes = binary_unit(plan.total_bytes)
    inset = axis.inset_axes([0.06, 0.18, 0.55, 0.38])
    length = _stacked_terms(inset, plan, unit_bytes, labelled=False)
    inset.set_xlim(0, length * 1.05 or 1)
    inset.set_yticks([])
    inset.tick_params(labelsize=7)
    inset.set_xlabel(unit_name, fontsize=7, labelpad=1)
    inset.set_title(f"zoom: {format_bytes(plan.total_bytes)} predicted, {plan.total_bytes / plan.capacity_bytes:.2%}"
                    f" of {memory}\n(too small to see at full scale)", fontsize=7)


def memory_vs_batch(curves: dict, capacity_bytes: int, budget_bytes: int, title: str, axis=None,
                    on_gpu: bool = True, mark_batch: int | None = None):
    """Predicted peak memory against batch size, one line per setting, with the memory's capacity
    (one GPU's; with `on_gpu` False, the cpu profile, this machine's RAM) and, at ``mark_batch``,
    the batch the run uses.

    `curves`: {label: (batch sizes, total bytes)}.
    """
    figure = None
    if axis is None:
        figure, axis = plt.subplots(figsize=(7, 4))
    # Each line its own dash and marker: where weights are small beside the KV cache, lines lie on one another.
    for (label, (batches, totals)), style, marker in zip(curves.items(), ("-", "--", "-.", ":") * 4, ".ox^sv" * 3):
        axis.plot(batches, [t / GiB for t in totals], linestyle=style, marker=marker, markersize=4, label=label)
    axis.axhline(capacity_bytes / GiB, color="black", linewidth=2,
                 label=f"{memory_name(on_gpu)} {format_bytes(capacity_bytes)}")
    axis.axhline(budget_bytes / GiB, color="black", linestyle="--", label="budget (safety margin kept free)")
    if mark_batch:
        axis.axvline(mark_batch, color="#c44e52", linewidth=1, label=f"this run's batch ({mark_batch})")
    largest = max((max(batches) for batches, _ in curves.values() if batches), default=1)
    if largest >= 64 * min((min(batches) for batches, _ in curves.values() if batches), default=1):
        axis.set_xscale("log", base=2)  # the largest batches a small model fits would crowd the run's own into 0
    axis.set_xlabel("batch size (sequences per GPU)" if on_gpu else "batch size (sequences)")
    axis.set_ylabel("predicted peak, GiB per GPU" if on_gpu else "predicted peak, GiB")
    axis.set_title(without_machine_paths(title), fontsize=10)
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
    beside = [r for r in measured if r.get("accelerate_estimate_bytes")]
    if beside:  # the command users know, on the same cases
        scatter_axis.scatter([r["measured_bytes"] / GiB for r in beside],
                             [r["accelerate_estimate_bytes"] / GiB for r in beside],
                             label="accelerate estimate-memory", s=25, marker="x", color="gray")
    top = max([r["measured_bytes"] / GiB for r in measured] + [1.0]) * 1.05
    scatter_axis.plot([0, top], [0, top], color="black", linewidth=1, label="prediction = measurement")
    scatter_axis.set_xlabel("measured peak, GiB (max_memory_reserved + non-PyTorch)")
    scatter_axis.set_ylabel("predicted peak, GiB (planner; x: accelerate estimate-memory)")
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
    figure.suptitle(without_machine_paths(
        f"Memory planner accuracy on {hardware} ({result['profile']}): median |error| "
        f"{median:.2%}, max {worst:.2%} over {len(measured)} measured cases" if measured else
        f"Memory planner accuracy on {hardware}: no case measured"), fontsize=10)
    figure.tight_layout()
    return figure


def training_lengths(lengths: list[int], max_seq_length: int, percentile_lengths: dict, truncated: int, source: str):
    """Histogram of the training examples' token lengths, with max_seq_length and the percentiles.

    `percentile_lengths`: {"median": n, "p95": n, ...} in tokens; `truncated`: examples longer than
    max_seq_length (cut, never hidden).
    """
    figure, axis = plt.subplots(figsize=(8, 3.6))
    axis.hist(lengths, bins=min(60, max(10, len(set(lengths)))), color="#4c72b0")
    for (name, value), style in zip(percentile_lengths.items(), (":", "-.", "--", (0, (1, 3)))):
        axis.axvline(value, color="#555555", linestyle=style, linewidth=1, label=f"{name} {value}")
    axis.axvline(max_seq_length, color="#c44e52", linewidth=2,
                 label=f"max_seq_length {max_seq_length} ({truncated} truncated)")
    axis.set_xlabel("tokens per example (prompt + response, as formatted for training)")
    axis.set_ylabel("examples")
    axis.legend(fontsize=8)
    axis.set_title(without_machine_paths(f"Training data lengths: {len(lengths)} examples from {source}"), fontsize=9)
    figure.tight_layout()
    return figure


def training_curves(history: list[dict], eval_history: list[dict], title: str):
    """Loss per optimizer step (with a moving mean and the validation loss) and tokens/s per step.

    `history`: [{"step", "loss", "tokens_per_second"}]; `eval_history`: [{"step", "eval_loss"}].
    """
    figure, (loss_axis, speed_axis) = plt.subplots(1, 2, figsize=(12, 3.8))
    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    window = max(1, min(len(losses) // 3, max(3, len(losses) // 10)))  # a few steps: one step's loss is noisy
    mean = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
    loss_axis.plot(steps, losses, color="#4c72b0", alpha=0.35, marker=".", linewidth=1, label="training loss per step")
    loss_axis.plot(steps, mean, color="#4c72b0", linewidth=2, label=f"moving mean ({window} steps)")
    if eval_history:
        loss_axis.plot([e["step"] for e in eval_history], [e["eval_loss"] for e in eval_history], color="#dd8452",
                       marker="o", linewidth=2, label="validation loss")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("cross-entropy per response token (nats)")
    loss_axis.legend(fontsize=8)
    loss_axis.grid(alpha=0.3)
    speeds = [r["tokens_per_second"] or 0 for r in history]
    speed_axis.plot(steps, speeds, color="#55a868", marker=".", linewidth=1)
    speed_axis.set_xlabel("optimizer step")
    speed_axis.set_ylabel("non-padding tokens / s (all processes)")
    speed_axis.set_ylim(bottom=0)
    speed_axis.grid(alpha=0.3)
    speed_axis.set_title("throughput per step (the first steps include warm-up)", fontsize=9)
    figure.suptitle(without_machine_paths(title), fontsize=10)
    figure.tight_layout()
    return figure


def generation_timeline(batches: list[dict], title: str):
    """Generation throughput over the run and the longest output of each batch.

    `batches`: the `batch_list` of `generate.run_job`'s summary ({"finished_at_seconds", "seconds",
    "output_tokens", "examples", "failed", "longest_output_tokens", "rank"}).
    """
    figure, (speed_axis, length_axis) = plt.subplots(1, 2, figsize=(12, 3.8))
    for rank in sorted({b["rank"] for b in batches}):
        own = [b for b in batches if b["rank"] == rank]
        label = f"process {rank}" if len(batches) != len(own) else "per batch"
        speed_axis.plot([b["finished_at_seconds"] for b in own],
                        [b["output_tokens"] / b["seconds"] if b["seconds"] else 0 for b in own],
                        marker=".", linewidth=1, label=label)
    speed_axis.set_xlabel("seconds since generation started (batch end)")
    speed_axis.set_ylabel("output tokens / s within the batch")
    speed_axis.set_ylim(bottom=0)
    speed_axis.grid(alpha=0.3)
    speed_axis.legend(fontsize=8)
    speed_axis.set_title("throughput over time (the first batch includes warm-up)", fontsize=9)
    index = range(1, len(batches) + 1)
    means = [b["output_tokens"] / max(b["examples"] - b["failed"], 1) for b in batches]
    length_axis.bar(index, [b["longest_output_tokens"] for b in batches], color="#c8d6e8",
                    label="longest output in the batch (every row waits for it)")
    length_axis.plot(index, means, color="#4c72b0", marker=".", linewidth=1, label="mean output in the batch")
    length_axis.set_xlabel("batch, in the order run (longest prompts first)")
    length_axis.set_ylabel("output tokens")
    length_axis.grid(alpha=0.3, axis="y")
    length_axis.legend(fontsize=8, loc="lower right")
    figure.suptitle(without_machine_paths(title), fontsize=10)
    figure.tight_layout()
    return figure


# ----------------------------------------------------------------------------------------------
# Reviewing runs (notebook 05) and forecasts; the benchmark's own figures are in `benchmark_plots`.


def runs_side_by_side(series: list[dict], x_label: str, y_label: str, title: str):
    """One line per run: ``series`` = [{"label", "x": [...], "y": [...], optional "notes": a word per
    point, e.g. its strategy}] (notebook 05)."""
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for item in series:
        axis.plot(item["x"], item["y"], marker="o", label=item["label"])
        for x, y, note in zip(item["x"], item["y"], item.get("notes", [])):
            axis.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if not series:  # no axes to read: an empty plot's default limits would read as figures
        axis.set_axis_off()
        axis.text(0.5, 0.5, "no run has this metric yet", transform=axis.transAxes, ha="center")
    else:
        axis.legend(fontsize=8)
        if all(x > 0 for item in series for x in item["x"]):
            axis.set_xscale("log", base=2)
    axis.set_xlabel(x_label)
    axis.set_ylabel(y_label)
    axis.set_title(without_machine_paths(title), fontsize=10)
    figure.tight_layout()
    return figure


def pass_rates(rates: list[float], title: str):
    """How many prompts had each share of their samples accepted by the verifier (0: none right)."""
    figure, axis = plt.subplots(figsize=(7, 3.5))
    bins = [i / 10 for i in range(11)]
    axis.hist(rates, bins=bins, color="#4c72b0", edgecolor="white")
    axis.set_xlabel("share of a prompt's samples the verifier accepted")
    axis.set_ylabel("prompts")
    axis.set_title(without_machine_paths(title), fontsize=10)
    axis.set_xlim(0, 1)
    return figure


def forecast_costs(rows: list[dict], title: str):
    """Hours and dollars per profile of one forecast (``workbook forecast``'s ``profiles``); the
    bars of projected rows are lighter than the one measured here."""
    rows = [row for row in rows if row["wall_seconds"] is not None]
    figure, (hours, dollars) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.8), sharey=True)
    names = [row["profile"] for row in rows]
    colors = ["#4c72b0" if row["basis"].startswith("measured") else "#a6bddb" for row in rows]
    hours.barh(names, [row["wall_seconds"] / 3600 for row in rows], color=colors)
    hours.set_xlabel("wall hours (dark: measured here by the pilot; light: projected)")
    dollars.barh(names, [row["usd"] for row in rows], color=colors)
    dollars.set_xlabel("US dollars at each profile's usd_per_gpu_hour")
    figure.suptitle(without_machine_paths(title), fontsize=10)
    figure.tight_layout()
    return figure


def forecast_against_measured(points: list[dict]):
    """Each run's forecast wall time against its measured one, with the +-10% band (notebook 05)."""
    figure, axis = plt.subplots(figsize=(6, 5))
    for kind, marker in (("generation", "o"), ("training", "s")):
        chosen = [p for p in points if p["kind"] == kind]
        axis.scatter([p["measured_seconds"] for p in chosen], [p["predicted_seconds"] for p in chosen],
                     marker=marker, label=kind)
    if points:
        top = max(max(p["measured_seconds"], p["predicted_seconds"]) for p in points) * 1.1
        axis.plot([0, top], [0, top], color="black", linewidth=1, label="forecast = measured")
        axis.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="grey", alpha=0.2, label="within 10%")
        axis.legend(fontsize=8)
    else:
        axis.text(0.5, 0.5, "no run recorded a forecast yet\n(workbook forecast, then the job)",
                  transform=axis.transAxes, ha="center")
    axis.set_xlabel("measured wall seconds (process start to end)")
    axis.set_ylabel("forecast wall seconds")
    axis.set_title("Forecast against measured, every run with a forecast", fontsize=10)
    figure.tight_layout()
    return figure
