"""What `workbook forecast` leaves for the job it forecast, read back by that job as plain JSON: where
the file lies (beside a generation output; in a training folder), the ETA plan it priced per prompt,
and its prediction set beside what the run measured. The forecast (``workbook.forecast``) writes the
file; generation and training read it with this module alone, knowing nothing of how it was made::

    made = read(generation_file(output))           # None without a forecast
    summary["forecast"] = beside_measured(generation_file(output), 41.5, "this process's start to its summary")
"""

from __future__ import annotations

import json
from pathlib import Path

FORECAST_SUFFIX = ".forecast.json"  # beside a generation output: the forecast its job started with
TRAINING_FILE_NAME = "forecast.json"  # in a training run's output folder


def generation_file(output: str | Path) -> Path:
    """Where the forecast of the generation job writing ``output`` lies."""
    return Path(output).with_suffix(FORECAST_SUFFIX)


def training_file(output_dir: str | Path) -> Path:
    """Where the forecast of the training run writing into ``output_dir`` lies."""
    return Path(output_dir) / TRAINING_FILE_NAME


def read(forecast_file: Path) -> dict | None:
    """The recorded forecast, or None when there is none."""
    return json.loads(forecast_file.read_text()) if forecast_file.is_file() else None


def eta_plan(forecast_file: Path) -> dict | None:
    """A generation forecast's plan for its job's ETA (``seconds_per_prompt_by_tokens``: the seconds
    its model gave each prompt still to run, by prompt tokens); None without one."""
    made = read(forecast_file)
    plan = (made or {}).get("eta_plan") if (made or {}).get("mode", "generate") == "generate" else None
    return plan if plan and plan.get("seconds_per_prompt_by_tokens") else None


def beside_measured(forecast_file: Path, measured_seconds: float | None, what: str,
                    after_pilot: bool = False) -> dict | None:
    """What a run records in its summary: the forecast it started with (the file `workbook forecast`
    wrote for it, if any) beside its measured wall time and the error; None without a forecast.
    ``after_pilot``: the run resumed after the pilot's outputs, so it is compared with the time the
    forecast left for it (``remaining_wall_seconds``), not the whole job's."""
    made = read(forecast_file)
    if made is None:
        return None
    predicted = made["remaining_wall_seconds"] if after_pilot else made["predicted_wall_seconds"]
    scale = predicted / made["predicted_wall_seconds"] if made["predicted_wall_seconds"] else 1.0
    return {"file": str(forecast_file), "compared_with": "remaining after the pilot" if after_pilot else "whole job",
            "predicted_wall_seconds": predicted,
            "predicted_wall_seconds_range": [bound * scale for bound in made["predicted_wall_seconds_range"]],
            "pilot_share": made["pilot"].get("share_of_job_batches", made["pilot"].get("share_of_job_steps")),
            "measured_wall_seconds": None if measured_seconds is None else round(measured_seconds, 3),
            "measured": what,
            "error": None if not measured_seconds else round((predicted - measured_seconds) / measured_seconds, 4)}
