"""The forecast check's report (``outputs/reference/<profile>/forecast.md``): each case's forecasts
against the runs they forecast, the runs' ETAs against the time they had left, and the generation
forecast's projection to every profile beside seed 000's claims."""

from __future__ import annotations

from workbook.forecast.command import units_seconds


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", result["what"] + f"; goal {result['goal']}. "
             f"OMP_NUM_THREADS={result['threads']}; {result['machine_note']}.", "",
             *([f"Load average (1, 5, 15 min) of the {_cores(result['hardware'])}-core machine: "
                f"{load['start']} at the start, {load['end']} at the end.", ""]
               if (load := result.get("load_average_1_5_15_min")) else []),
             *[f"{model}: random {built['dtype']} weights ({built['parameters']:,} parameters) built on "
               f"{built['built_on']} in {built['command_seconds']:.0f} s, the tiny model's tokenizer.\n" for model, built in
               result.get("models_built", {}).items()],
             "| case | seconds of | pilot | forecast (s), median | measured (s), median | error of each trial | "
             "median error | trials within goal | trials in range | the job's own spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        for clock in [clock for clock in ("wall", "cpu") if clock in row]:
            entry, pilot = row[clock], row[clock]["pilot"]
            size = (f"{pilot['batches']} batches, {pilot['share_of_job_batches']:.0%}" if row["mode"] == "generate"
                    else f"{pilot['steps']} steps, {pilot['share_of_job_steps']:.0%}")
            trials = len(entry["errors"])
            lines.append(f"| {row['case']} | {clock} | {size} | {entry['predicted_seconds_median']:.1f} | "
                         f"{entry['measured_seconds_median']:.1f} | {', '.join(f'{e:+.1%}' for e in entry['errors'])} | "
                         f"{entry['median_error']:+.1%} | {entry['trials_within_goal']} of {trials} | "
                         f"{entry['trials_in_range']} of {trials} | {entry['job_spread']:.1%} |")
    eta = [row for row in result["cases"] if row.get("eta_errors")]
    lines += ["", "The job's ETA (the progress bar's: the forecast's model over the batches left, scaled by the pace "
              "of its recent batches) against the time the run really had left, after each share of its batches; one error per trial:",
              "", "| case | " + " | ".join(f"after {float(share):.0%}" for share in eta[0]["eta_errors"]) + " |",
              "|---|" + "---|" * len(eta[0]["eta_errors"])] + [
        f"| {row['case']} | " + " | ".join(", ".join("-" if e is None else f"{e:+.0%}" for e in errors)
                                           for errors in row["eta_errors"].values()) + " |" for row in eta] if eta else []
    lines += phase_lines(result)
    unfinished = [f"- {row['case']}, trial {stopped['trial']}: {stopped['reason'].splitlines()[0]}"
                  + (f" (its forecast: {stopped['forecast']['predicted_seconds']:.1f} s)" if stopped["forecast"] else "")
                  for row in result["cases"] if (stopped := row.get("not_finished"))]
    lines += ["", "Not finished (the table holds only the trials that finished before):", *unfinished] if unfinished else []
    shares = [f"{mode}: " + ", ".join(f"{key.replace('_', ' ')} {share:.1%}" for key, share in by_key.items())
              for mode, by_key in result.get("efficiency", {}).items()]
    lines += ["", "Achieved share of this machine's peaks (the forecasts' median; a forecast elsewhere projects "
              "this profile's rows with it): " + "; ".join(shares)] if shares else []
    if "seed_000" in result:
        lines += projection_lines(result)
    return "\n".join(lines) + "\n"


def phase_lines(result: dict) -> list[str]:
    """Each training case's step model (the pilot's steps drawn across the run, every step priced by
    what it holds) against the run's own steps, per phase of the run; one figure per trial."""
    rows = [row for row in result["cases"] if row.get("phases")]
    if not rows:
        return []
    lines = ["", "A training step as the forecast's step model prices it (mean over the phase's steps) against the "
             "run's own steps in that phase (mean; the steps that start an epoch's loader left out of both, as the "
             "pilot leaves them out of its model); one figure per trial:", "",
             "| case | phase of the run | planned s/step | measured s/step | error |", "|---|---|---|---|---|"]
    for row in rows:
        for phase, entry in row["phases"].items():
            lines.append(f"| {row['case']} | {phase} | {', '.join(f'{v:.4f}' for v in entry['planned_step_seconds'])} | "
                         f"{', '.join(f'{v:.4f}' for v in entry['measured_step_seconds'])} | "
                         f"{', '.join(f'{e:+.1%}' for e in entry['error'])} |")
    return lines


def _cores(hardware: dict):
    return hardware.get("cpu", hardware).get("logical_cores", "?")


def projection_lines(result: dict) -> list[str]:
    """The generation case's forecast projected to every profile, beside seed 000's claims for its own
    job, and the same projection scaled to the seed's job by output tokens (labelled as such)."""
    row = next((row for row in result["cases"] if row["mode"] == "generate"), {"trials": []})
    first = row["trials"][0] if row["trials"] else (row.get("not_finished") or {}).get("forecast")
    if not first:
        return ["", "No projection to the other profiles: the generation case made no forecast."]
    seed, claims, job = result["seed_000"]["job"], result["seed_000"]["claims"], first["job"]
    scale = seed["prompts"] * seed["max_new_tokens"] / (job["prompts"] * job["max_new_tokens"])
    lines = ["", f"Projection of this check's generation job ({job['prompts']:,} prompts x {job['max_new_tokens']} new "
             f"tokens, {job['model']}, batch {job['batch_size']}, {job['backend']}) from its forecast on "
             f"{result['profile']} to every profile (the forecast's `profiles`), "
             f"beside seed 000's claims for its own job: {seed['what']}. The column 'scaled to the seed's size' "
             f"multiplies this job's projection by the ratio of output tokens ({seed['prompts']:,} x "
             f"{seed['max_new_tokens']:,} over {job['prompts']:,} x {job['max_new_tokens']}, x{scale:.0f}): a rough "
             f"scale, not a measurement. It assumes every output runs to the {seed['max_new_tokens']:,} cap (outputs "
             "that end earlier make the job shorter) at this job's cost per token (longer contexts make each token dearer and fit smaller batches: "
             "longer); and it is the workbook at the planner's batch, not the seed's script at its own.",
             "", "| profile | this job: wall | this job: USD | basis | scaled to the seed's size: wall | USD | "
             "seed 000's claim (its job) |", "|---|---|---|---|---|---|---|"]
    for entry in first["profiles"]:
        wall, usd = entry["wall_seconds"], entry["usd"]
        this_job, scaled = (("- | -", "- | -") if wall is None else
                            (f"{units_seconds(wall)} | ${usd:.4f}", f"{units_seconds(wall * scale)} | ${usd * scale:,.2f}"))
        lines.append(f"| {entry['profile']} | {this_job} | {entry['basis']} | {scaled} | "
                     f"{claims.get(entry['profile'], '-')} |")
    return lines
