"""The continuous-batching benchmark's report (``continuous_batching.md``): each arm's time, tokens/s,
first result, padding and memory beside its plan, its share of the roofline, and the
attention transformers' manager ran."""

from __future__ import annotations

from workbook.bench import published

ARMS = ("static-sorted", "continuous", "direct")


def markdown(report: dict) -> str:
    rows = ["| workload | arm | batch | median s | output tok/s | first result s | padding waste | peak memory MiB | "
            "planned MiB | roofline fraction |", "|---|---|---|---|---|---|---|---|---|---|"]
    for result in report["results"]:
        for arm in result.get("arms", ARMS):  # a time budget's end leaves out an arm it cut
            first = result["first_result_seconds"][arm]
            planned = result["planned_bytes"].get(arm)
            waste = result["padding_waste"] if arm == "static-sorted" else "none (no padded rows)"
            fraction = result["roofline_fraction"][arm]
            rows.append(f"| {result['workload']} | {arm} | {result['batch_size'][arm]} | "
                        f"{result['median_seconds'][arm]} | {result['output_tokens_per_second'][arm]} | "
                        f"{'n/a (one call)' if first is None else round(first, 3)} | {waste} | "
                        f"{result['peak_memory_bytes'][arm] / 2**20:.0f} | "
                        f"{'' if planned is None else round(planned / 2**20)} | "
                        f"{'n/a (no peaks)' if fraction is None else fraction} |")
    ratios = [f"- {r['workload']}: continuous {_times(r['continuous_vs_static'])} static-sorted "
              f"({_times(r.get('continuous_vs_static_after_start'))} without its manager's start, "
              f"{_seconds(r.get('manager_start_seconds', {}).get('continuous'))}, paid once per job; "
              f"{_times(r.get('continuous_vs_static_without_processor'))} without static's end-at-length processor, "
              f"{_seconds(r.get('static_end_processor_seconds'))} measured apart), "
              f"{_times(r['continuous_vs_direct'])} direct (1.0 = as fast; medians of {r['repeats_done']}); "
              f"continuous ran attention {_attention_text(r.get('continuous_attention'))}"
              for r in report["results"]]
    load = report["load_average_1min_before_after"]
    stopped = [f"Stopped early: {report['stopped']}", ""] if report.get("stopped") else []
    return "\n".join([
        f"{report['model']} on {report['device']} ({report['dtype']}, {report['threads']} threads), up to "
        f"{report['repeats']} repeats; uneven lengths: {report['uneven_lengths']}", "",
        f"Hardware: {report['hardware']}; 1-minute load average {load[0]} before, {load[1]} after "
        "(other processes share the machine)", "", *stopped, *rows, "",
        f"Peak memory: {report['peak_memory_measured_as']}; planned: the planner's peak (CPU: beyond the weights, "
        "no overheads; continuous: the paged plan, static: the dense one, direct: as continuous). Batch: "
        f"{report['batch_sizes_from']}.", "",
        f"Roofline: {report['roofline']}", "", published.vllm_line(), "",
        "Direct: transformers alone with the backend's paged-cache sizing, nothing written: one generate_batch call "
        "(full), the manager fed every request at once (uneven: generate_batch takes one max_new_tokens for all).", "",
        *ratios, "", f"Command: `{report['command']}`", ""])


def _times(ratio: float | None) -> str:
    return "n/a (an arm not measured: the time budget ran out)" if ratio is None else f"{ratio}x"


def _seconds(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f} s"


def _attention_text(attention: str | None) -> str:
    if attention is None:
        return "(not recorded)"
    if "flash" in attention:
        return f"{attention} (each request attends its own keys)"
    return (f"{attention} (one dense mask over every request in flight: a step of n decoding requests scores "
            "n x all their keys, so its cost grows with n^2; transformers switches to flash attention where it is "
            "installed)")
