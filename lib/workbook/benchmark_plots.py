"""The benchmark's figures (notebook 04, `workbook bench`): throughput and memory against batch size, the
training sweep's MFU and peak memory beside the plan, and the speedup over the seeds' baseline. Each says
what it shows, in what unit and from what run, as in `plots`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from workbook.bench.training_sweep import training_label
from workbook.plots import without_machine_paths
from workbook.units import GiB, format_bytes

STRATEGY_COLORS = {"seed-before": "#8c8c8c", "seed-after": "#c44e52", "static-sorted": "#4c72b0",
                   "static-compiled": "#55a868", "continuous": "#8172b3", "hf-pipeline": "#937860"}
NO_PEAK_TEXT = "peak memory not measured (CPU: torch keeps no peak of tensor memory)"


def _timed_points(report: dict) -> list[dict]:
    return [p for p in report["generation"]["points"] if "seconds" in p]


def throughput_vs_batch(report: dict):
    """Output tokens/s (median, with min-max bars) per strategy vs batch size, log-log, with the
    roofline of the same pass (datasheet peaks) where the profile has peaks."""
    figure, axis = plt.subplots(figsize=(8, 4.8))
    points = _timed_points(report)
    for strategy in dict.fromkeys(p["strategy"] for p in points):
        mine = sorted((p for p in points if p["strategy"] == strategy), key=lambda p: p["batch_size"])
        x = [p["batch_size"] for p in mine]
        y = [p["output_tokens_per_second"]["median"] for p in mine]
        low = [p["output_tokens_per_second"]["median"] - p["output_tokens_per_second"]["min"] for p in mine]
        high = [p["output_tokens_per_second"]["max"] - p["output_tokens_per_second"]["median"] for p in mine]
        axis.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=strategy,
                      color=STRATEGY_COLORS.get(strategy))
    roofs = sorted({(p["batch_size"], p["roofline"]["tokens_per_second"]) for p in points})
    if any(roof for _, roof in roofs):
        axis.plot([b for b, _ in roofs], [roof for _, roof in roofs], "k--",
                  label="roofline (prefill at the compute peak, decode at the bandwidth)")
    else:
        axis.text(0.01, 0.98, "no roofline: the profile has no bandwidth/compute peak (cpu)", transform=axis.transAxes,
                  va="top", fontsize=8)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("batch size (sequences)")
    axis.set_ylabel("output tokens/s")
    generation = report["generation"]
    axis.set_title(without_machine_paths(
        f"Generation throughput: {generation['model_name']} on {report['device']} ({report['profile']}), "
        f"{generation['max_new_tokens']} new tokens, median of {generation['repeats']}"), fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def memory_vs_batch_measured(report: dict, capacity_bytes: int | None):
    """Measured peak memory per point vs batch size beside the planner's prediction and the capacity."""
    figure, axis = plt.subplots(figsize=(8, 4.5))
    points = _timed_points(report)
    sizes = [p[key] for p in points for key in ("predicted_peak_bytes", "peak_memory_bytes") if p.get(key)]
    unit, unit_name = (GiB, "GiB") if max(sizes, default=0) >= GiB else (2**20, "MiB")
    # One planner line per cache: the dense one of static batches, the paged one of continuous batching.
    for backend, style in (("static", "k--"), ("continuous", "k:")):
        predicted = sorted({(p["batch_size"], p["predicted_peak_bytes"]) for p in points
                            if p["predicted_peak_bytes"] and (p.get("backend") == "continuous") == (backend == "continuous")})
        if predicted:
            axis.plot([b for b, _ in predicted], [v / unit for _, v in predicted], style, marker="x",
                      label=f"predicted (planner): {'paged cache (continuous)' if backend == 'continuous' else 'dense cache'}")
    measured = [p for p in points if p["peak_memory_bytes"]]
    for strategy in dict.fromkeys(p["strategy"] for p in measured):
        mine = sorted((p for p in measured if p["strategy"] == strategy), key=lambda p: p["batch_size"])
        axis.plot([p["batch_size"] for p in mine], [p["peak_memory_bytes"] / unit for p in mine], marker="o",
                  label=f"measured: {strategy}", color=STRATEGY_COLORS.get(strategy))
    if not measured:
        axis.text(0.01, 0.98, NO_PEAK_TEXT,
                  transform=axis.transAxes, va="top", fontsize=8)
    if capacity_bytes:
        axis.axhline(capacity_bytes / unit, color="#c44e52", label=f"capacity {format_bytes(capacity_bytes)}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size (sequences)")
    axis.set_ylabel(f"peak memory, {unit_name}")
    axis.set_title(without_machine_paths(
        f"Generation memory vs batch: {report['generation']['model_name']} ({report['profile']})"), fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def mfu_bars(report: dict, capacity_bytes: int | None = None):
    """Training points: MFU (or tokens/s where there is no peak) above, peak memory beside the plan below."""
    figure, (speed_axis, memory_axis) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    training = report.get("training") or {}
    points = [p for p in training.get("points", []) + training.get("baselines", []) if "tokens_per_second" in p]
    labels = [training_label(p) for p in points]
    has_mfu = any(p["mfu"] is not None for p in points)
    values = [(100 * (p["mfu"] or 0) if has_mfu else p["tokens_per_second"]) or 0 for p in points]
    bars = speed_axis.bar(labels, values, color=["#dd8452" if p.get("loop", "workbook") != "workbook" else "#4c72b0"
                                                 for p in points])
    for bar, p in zip(bars, points):
        speed_axis.annotate(f"{p['tokens_per_second'] or 0:,.0f} tok/s" if has_mfu else "MFU n/a",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    speed_axis.set_ylabel("MFU, % of the dense peak" if has_mfu else "tokens/s (no peak: MFU n/a)")
    speed_axis.set_title(without_machine_paths(f"Training sweep: {training.get('model', '?')} ({report['profile']}); "
                                               "orange: the baselines (HF Trainer, TRL SFTTrainer)"), fontsize=10)
    positions = range(len(points))
    sizes = [p[key] for p in points for key in ("peak_memory_bytes", "predicted_peak_bytes") if p.get(key)]
    unit, unit_name = (GiB, "GiB") if max(sizes, default=0) >= GiB else (2**20, "MiB")
    measured = [(i, p["peak_memory_bytes"] / unit) for i, p in zip(positions, points) if p.get("peak_memory_bytes")]
    planned = [(i, p["predicted_peak_bytes"] / unit) for i, p in zip(positions, points) if p.get("predicted_peak_bytes")]
    if measured:
        memory_axis.bar([i for i, _ in measured], [v for _, v in measured], color="#55a868", label="measured peak")
    else:  # above the panel, where no bar or mark is
        memory_axis.set_title(NO_PEAK_TEXT, fontsize=8, loc="left")
    if planned:
        memory_axis.scatter([i for i, _ in planned], [v for _, v in planned], marker="_", s=400, color="black",
                            zorder=3, label="planner")
    # The capacity line only where it is on the bars' scale: a CPU's RAM would flatten MiB-sized bars.
    drawn = bool(capacity_bytes) and capacity_bytes <= 4 * max(sizes, default=0)
    if drawn:
        memory_axis.axhline(capacity_bytes / unit, color="#c44e52", label=f"capacity {format_bytes(capacity_bytes)}")
    top = max([v for _, v in measured + planned] + ([capacity_bytes / unit] if drawn else []), default=1)
    memory_axis.set_ylim(0, 1.15 * top)  # room above the highest mark: none clipped at the edge
    off_scale = f"\n(capacity {format_bytes(capacity_bytes)}: off this scale)" if capacity_bytes and not drawn else ""
    memory_axis.set_ylabel(f"peak memory, {unit_name}{off_scale}")
    if measured or planned:
        memory_axis.legend(fontsize=8)
    memory_axis.tick_params(axis="x", labelsize=7, labelrotation=40)
    for label in memory_axis.get_xticklabels():
        label.set_horizontalalignment("right")
    figure.tight_layout()
    return figure


def speedup_over_baseline(report: dict):
    """Median output tokens/s of each point over the seeds' static-batch-32 baseline."""
    points = [p for p in _timed_points(report) if p.get("speedup_over_seed_after") is not None]
    figure, axis = plt.subplots(figsize=(max(8, 0.8 * len(points)), 4.2))  # wide enough for every label
    labels = [f"{p['strategy']}\nb{p['batch_size']}" for p in points]
    bars = axis.bar(labels, [p["speedup_over_seed_after"] for p in points],
                    color=[STRATEGY_COLORS.get(p["strategy"], "#4c72b0") for p in points])
    for bar, p in zip(bars, points):
        noisy = bool(p.get("speedup_noise"))  # either median's runs spread: a busy machine, not a speedup
        if noisy:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
        axis.annotate(f"{p['speedup_over_seed_after']:.2f}x" + ("\nnoisy" if noisy else ""),
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel("speedup over seed-after (static 32, file order)")
    hatched = "; hatched: noisy runs, rerun before comparing" if any(p.get("speedup_noise") for p in points) else ""
    axis.set_title(without_machine_paths(f"Speedup over the seeds' baseline ({report['profile']}, "
                                         f"{report['generation']['model_name']}){hatched}"), fontsize=10)
    axis.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    return figure


def benchmark_figures(report: dict, capacity_bytes: int | None = None) -> dict:
    """Every benchmark figure by its PNG name."""
    return {"bench_throughput.png": throughput_vs_batch(report),
            "bench_memory.png": memory_vs_batch_measured(report, capacity_bytes),
            "bench_mfu.png": mfu_bars(report, capacity_bytes), "bench_speedup.png": speedup_over_baseline(report)}
