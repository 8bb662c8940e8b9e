"""The forecast's plan for its job's ETA: the seconds its model gives each batch of the job still to
run (``planned_batch_seconds``: a static job's batches, a stream's groups of ``batch_size``
completions), shared out over each batch's prompts and kept by prompt length (``eta_plan``), plain
data the job reads back beside its output (``generation.progress.planned_by_prompt``)::

    planned = planned_batch_seconds(forecast_dict)
    plan = eta_plan(batches, planned(batches))     # recorded as the forecast's "eta_plan"
"""

from __future__ import annotations

import collections
import statistics

from workbook.forecast import model, stream


def planned_batch_seconds(made: dict):
    """A function giving each batch's seconds (batches in run order) by the model of a generation
    forecast (``made``: its recorded dict, or ``Forecast.to_dict()``). A stream's (continuous)
    batches are its groups of ``batch_size`` completions."""
    outputs = model.OutputLengths([(length, lengths) for length, lengths in made["pilot"]["output_lengths"]])
    if "step_seconds" in made["timings"]:
        timings = stream.StreamTimings(**made["timings"])
        return lambda batches: stream.group_seconds(
            [len(p.token_ids) for batch in batches for p in batch], group=len(batches[0]) if batches else 1,
            max_new_tokens=max((p.max_new_tokens for batch in batches for p in batch), default=1),
            timings=timings, outputs=outputs)
    timings = model.GenerationTimings(**made["timings"])

    def planned(batch) -> float:
        longest = max(len(p.token_ids) for p in batch)
        steps = model.expected_longest(outputs.nearest(longest), len(batch), max(p.max_new_tokens for p in batch))
        return sum(model.batch_seconds(len(batch), longest, steps, timings))
    return lambda batches: [planned(batch) for batch in batches]


def eta_plan(batches: list[list], seconds: list[float]) -> dict:
    """The job's ETA plan as plain data: each batch's planned ``seconds`` shared equally over its
    prompts, the mean per prompt length. A batch of the job then costs the sum of its prompts' shares,
    which is the model's own batch seconds for the batches planned here (the job run next, in one
    process) and a batch's worth of similar prompts when the job splits them otherwise (several
    processes, a resume after a kill)."""
    shares: dict[int, list[float]] = collections.defaultdict(list)
    for batch, planned in zip(batches, seconds):
        for prompt in batch:
            shares[len(prompt.token_ids)].append(planned / len(batch))
    return {"seconds_per_prompt_by_tokens": [[tokens, statistics.fmean(each)] for tokens, each in sorted(shares.items())],
            "prompts": sum(len(batch) for batch in batches), "batches": len(batches)}
