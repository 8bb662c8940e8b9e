"""The running job's ETA, shown in its progress: the planned cost of the batches still to run,
scaled by how its recent batches compare with their plan (``remaining_seconds``); the plan is the
seconds a forecast priced each prompt at, when `workbook forecast` left one beside the output
(``planned_by_prompt``, read with ``recorded_forecast``), else the positions each batch computes
(``positions_cost``). After a run, how right its ETA was (``eta_errors``, ``eta_rows``)::

    plan = planned_by_prompt(recorded_forecast.eta_plan(forecast_file)) or positions_cost
    remaining_seconds(plan(batches), finished_at_seconds=[14.2, 26.0, 41.0])
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

PACE_BATCHES = 3  # the fewest recent batches an ETA's pace is taken over


def planned_by_prompt(plan: dict | None):
    """A function giving each batch's planned seconds (batches in run order) from a forecast's ETA
    plan: the sum of the seconds its model priced each of the batch's prompts at, the nearest
    prompt length priced standing in for one it did not price; None without a plan. A stream's
    (continuous) batches are its groups of ``batch_size`` completions."""
    if not plan:
        return None
    table = sorted((int(tokens), float(seconds)) for tokens, seconds in plan["seconds_per_prompt_by_tokens"])
    lengths = [tokens for tokens, _ in table]

    def seconds_of(tokens: int) -> float:
        at = bisect.bisect_left(lengths, tokens)
        nearest = min((i for i in (at - 1, at) if 0 <= i < len(table)), key=lambda i: abs(lengths[i] - tokens))
        return table[nearest][1]
    return lambda batches: [sum(seconds_of(len(p.token_ids)) for p in batch) for batch in batches]


def positions_cost(batches) -> list[float]:
    """Each batch's planned cost without a forecast: the positions it computes (rows x (longest
    prompt + its new-token limit)); relative units are enough, since ``remaining_seconds`` scales by pace."""
    return [len(batch) * (max(len(p.token_ids) for p in batch) + max(p.max_new_tokens for p in batch))
            for batch in batches]


def remaining_seconds(batch_seconds_planned: list[float], finished_at_seconds: list[float]) -> float:
    """ETA of a running job: the planned seconds of the batches still to run, scaled by how its
    recent batches compare with their plan. ``finished_at_seconds``: when each batch done so far
    finished, in seconds since the job's first batch began. Counting examples left is wrong early:
    the first batches hold the longest prompts, so a per-example rate from them overstates what is
    left. The pace is that of the last quarter of the batches done (at least ``PACE_BATCHES``), not
    of all: prompts shorten as the run goes, so the batches just done are the likest to those left,
    where a plan's error in how cost grows with length shows, and a first batch's one-off costs
    (warm-up, compilation) drop out (measured on CPU over 11 runs: mean |error| 11% with the pace of
    every batch done, 8% with the recent quarter's)."""
    done = len(finished_at_seconds)
    if not done:
        return sum(batch_seconds_planned)
    first = done - min(done, max(PACE_BATCHES, done // 4))
    began = finished_at_seconds[first - 1] if first else 0.0
    planned = sum(batch_seconds_planned[first:done])
    pace = (finished_at_seconds[-1] - began) / planned if planned > 0 else 1.0
    return pace * sum(batch_seconds_planned[done:])


ETA_CHECKPOINTS = (0.1, 0.25, 0.5, 0.75)  # shares of a run's batches at which its ETA is checked


def eta_errors(batch_list: list[dict]) -> list[dict]:
    """How right a finished run's ETA was: at each share of its batches (rank 0's, as they
    finished), the ETA it showed (``remaining_seconds`` over the batches' ``planned``) against the
    time it really had left until its last batch. Empty without a plan."""
    own = [batch for batch in batch_list if batch.get("rank", 0) == 0]
    if len(own) < 2 or any(batch.get("planned") is None for batch in own):
        return []
    plan, end, rows = [batch["planned"] for batch in own], own[-1]["finished_at_seconds"], []
    for share in ETA_CHECKPOINTS:
        done = max(1, int(share * len(own)))
        at = own[done - 1]["finished_at_seconds"]
        if done < len(own) and end > at:
            eta = remaining_seconds(plan, [batch["finished_at_seconds"] for batch in own[:done]])
            rows.append({"share_of_batches": share, "after_batches": done, "eta_seconds": round(eta, 3),
                         "left_seconds": round(end - at, 3), "error": round((eta - (end - at)) / (end - at), 4)})
    return rows


def eta_rows(root: Path) -> list[dict]:
    """Every generation run under ``root`` whose batches kept their plan: its ETA's error against
    the time it really had left, at each checkpoint (notebook 05)."""
    rows = []
    for path in sorted(root.rglob("*.summary.json")):
        try:
            batches = json.loads(path.read_text()).get("batch_list") or []
        except (OSError, ValueError):
            continue
        checks = eta_errors(batches)
        if checks:
            rows.append({"run": str(path.relative_to(root)), **{
                f"ETA error after {check['share_of_batches']:.0%} of the batches": f"{check['error']:+.0%} "
                f"({check['eta_seconds']:.1f} s said, {check['left_seconds']:.1f} s left)" for check in checks}})
    return rows
