"""Seed 000's own job as the no-pilot forecast's worked example: 53,597 prompts through an 8B model,
up to 2,048 new tokens each, static batches, on every profile, beside the seed's claims::

    workbook forecast --seed-000 outputs/reference/cpu     # seed_000_forecast.md + .json

The seed's input file is not public, so its prompts are synthetic: a file of its size whose records
carry a reference output (the earlier teacher's, as the seed's records do), with lengths drawn from
the shapes in ``SHAPE`` (assumed, and stated in the result). The text is words of English, so the
bytes-per-token estimate a preset (no tokenizer) counts with applies to it as to English prose.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

from workbook import params as params_module
from workbook.bench.claims import SEED_000_CLAIMS, SEED_000_JOB
from workbook.forecast import roofline
from workbook.forecast.settings import jobs_on_profiles
from workbook.generation.settings import GenerationSettings
from workbook.hardware import Hardware

MODEL = "Llama-3.1-8B"  # the seed's teacher: "llama-3.1-8b-maml-merged"
# Assumed shapes (the seed states none): short questions and chat-model answers, log-normal, in tokens.
SHAPE = {"prompt_median_tokens": 48, "prompt_sigma": 0.8, "prompt_range": (8, 1024),
         "output_median_tokens": 320, "output_sigma": 0.75, "output_range": (16, 4096)}
WORDS = ("the value of a function is its output when the input is given so we solve for each term and check "
         "that result against what was asked then write code which returns answer").split()


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of English words at the bytes-per-token estimate."""
    target, words = tokens * roofline.BYTES_PER_TOKEN_ESTIMATE, []
    length = 0
    while length < target - 1:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def _draw(rng: random.Random, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), bounds[0]), bounds[1]))


def write_prompts(path: Path, count: int = SEED_000_JOB["prompts"], seed: int = 0) -> Path:
    """A prompts file of ``count`` records in the seed's input format (input, output, difficulty,
    domain), lengths drawn from ``SHAPE``."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for index in range(count):
            prompt = _draw(rng, SHAPE["prompt_median_tokens"], SHAPE["prompt_sigma"], SHAPE["prompt_range"])
            output = _draw(rng, SHAPE["output_median_tokens"], SHAPE["output_sigma"], SHAPE["output_range"])
            handle.write(json.dumps({"id": index, "input": _text(rng, prompt), "output": _text(rng, output),
                                     "difficulty": rng.choice(("easy", "hard")),
                                     "domain": rng.choice(("math", "coding"))}) + "\n")
    return path


def seed_params(prompts_path: Path) -> params_module.Params:
    """The seed's job on the h200 profile (the other profiles take it over): static batches at the
    planner's batch, sampled at temperature 0.7, top_p 0.9, up to 2,048 new tokens."""
    params = params_module.load(params_module.profile_path("h200"))
    return params_module.apply_overrides(params, {
        "model": MODEL, "prompts_path": str(prompts_path), "max_new_tokens": SEED_000_JOB["max_new_tokens"],
        "backend": "static", "do_sample": True, "temperature": 0.7, "top_p": 0.9})


SEED_BATCHES = {"h200": 32, "h100": 16, "a100-40gb": 8, "a6000": 10}  # the seed's own table
SEED_USD_PER_HOUR = (0.50, 0.80)  # the seed's H200 rate (Vast.ai)


def forecast(log=print) -> tuple[roofline.RooflineForecast, list[dict]]:
    """The seed's job on every profile at the planner's batch, and at the seed's own batches."""
    with tempfile.TemporaryDirectory(prefix="seed-000-") as scratch:
        params = seed_params(write_prompts(Path(scratch) / "prompts.jsonl"))
        made = roofline.forecast_without_pilot(params, log=log)
        settings, on_profiles = GenerationSettings.from_params(params), jobs_on_profiles(params)
        lengths = roofline.job_lengths(settings)
        model = roofline.model_work(roofline.presets.load_config(MODEL), settings.dtype)
        at_seed_batch = [roofline.generation_row(Hardware.from_params(on_profiles[name]),
                                                 GenerationSettings.from_params(on_profiles[name]).replace(batch_size=batch),
                                                 model, lengths)
                         for name, batch in SEED_BATCHES.items()]
    for row in at_seed_batch:
        row.pop("error", None)  # the row's basis says it; the exception is not part of the table
    made.job["planned_prompt_len"] = settings.prompt_len
    made.job["prompts_path"] = (f"synthetic: {SEED_000_JOB['prompts']:,} records with reference outputs, lengths "
                                "log-normal as workbook.forecast.seed_example.SHAPE states")
    return made, at_seed_batch


def _rows(rows_in: list[dict]) -> list[str]:
    rows = []
    for row in rows_in:
        if row.get("wall_seconds") is None:
            rows.append(f"| {row['profile']} | - | - | - | - | - | - | {row['basis']} |")
            continue
        low, high = row["wall_seconds_range"]
        rows.append(f"| {row['profile']} | {row['batch_size']} | {row['wall_seconds'] / 3600:.2f} h "
                    f"({low / 3600:.2f}-{high / 3600:.2f}) | {row['every_output_to_max_new_tokens_seconds'] / 3600:.2f} h | "
                    f"{row['gpu_hours']:.2f} | ${row['usd_range'][0]:.2f}-{row['usd_range'][1]:.2f} at "
                    f"${row['usd_per_gpu_hour']:g}/GPU-hour | {row['efficiency']['basis']} | "
                    f"{SEED_000_CLAIMS.get(row['profile'], '-')} |")
    return rows


def _checked(check: dict) -> str:
    if not isinstance(check.get("flop_counter"), dict):
        return f"FLOPs not checked against torch's FLOP counter: {check.get('flop_counter')}"
    rows, length = check["shape"]
    differences = ", ".join(f"{key} {value:+.2%}" for key, value in check["relative_difference"].items())
    return (f"the analytical FLOPs against torch's FLOP counter running the real ops on the meta model (a prefill "
            f"of {rows} x {length} tokens and the decode step after it): {differences}")


def markdown(made: roofline.RooflineForecast, at_seed_batch: list[dict], command: str) -> str:
    h200 = next((row for row in made.rows if row["profile"] == "h200" and row.get("wall_seconds")), None)
    rate = ""
    if h200:
        low, high = (seconds / 3600 for seconds in h200["wall_seconds_range"])
        rate = (f"- at the seed's H200 rate (${SEED_USD_PER_HOUR[0]:.2f}-{SEED_USD_PER_HOUR[1]:.2f}/h): "
                f"${low * SEED_USD_PER_HOUR[0]:.2f}-{high * SEED_USD_PER_HOUR[1]:.2f} for the planner's batch")
    head = ("| profile | batch | wall (range) | every output to 2,048 tokens | GPU-hours | USD (range) | "
            "efficiency | seed's claim |", "|---|---|---|---|---|---|---|---|")
    return "\n".join([
        "# Seed 000's job, forecast without a GPU", "", f"`{command}`", "",
        f"{SEED_000_JOB['what']}. Prompts: {made.job['prompts_path']} ({SHAPE}). Token counts: "
        f"{made.lengths['token_counts']}. Outputs: {made.lengths['output_basis']}.", "",
        f"At the planner's batch on each profile (the largest that fits a {made.job['planned_prompt_len']}-token "
        "prompt, the profiles' prompt_len, and 2,048 new tokens):", "", *head, *_rows(made.rows), "",
        "At the seed's own batch sizes (32, 16, 8, 10):", "", *head, *_rows(at_seed_batch), "",
        *[f"- {note}" for note in made.notes], *([rate] if rate else []), f"- {_checked(made.flop_counter_check)}",
        "- a static batch decodes until its longest output ends: at a batch of hundreds nearly every batch holds "
        "one long output, which is why the forecast sits nearer the all-to-2,048 bound than the median output "
        "suggests (the continuous backend does not wait)",
        f"- efficiency priors: {'; '.join(text for _, text in roofline.PRIORS.values())}",
        "- a profile's row turns 'measured' once a GPU run leaves its efficiency in outputs/reference/<profile>/", ""])


def write(out: str | Path, command: str, log=print) -> dict:
    """The seed's job forecast on every profile, into ``out`` (seed_000_forecast.json and .md)."""
    made, at_seed_batch = forecast(log=log)
    record = {"what": "seed 000's job (53,597 prompts, an 8B model, up to 2,048 new tokens) forecast on every "
                      "profile from its work, without a GPU", "command": command, "shape": SHAPE,
              "seed_claims": SEED_000_CLAIMS, **made.to_dict(),
              "rows_at_seed_batch": roofline.forecast.round_floats(at_seed_batch)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed_000_forecast.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "seed_000_forecast.md").write_text(markdown(made, at_seed_batch, command))
    return record


def table_rows(record: dict) -> list[dict]:
    """The committed seed 000 forecast (``write``'s JSON) as rows for a table: hours and dollars per
    profile beside the seed's claim."""
    rows = []
    for row in record["rows"]:
        if row.get("wall_seconds") is None:
            rows.append({"profile": row["profile"], "hours": "-", "basis": row["basis"]})
            continue
        low, high = row["wall_seconds_range"]
        rows.append({"profile": row["profile"], "batch": row["batch_size"], "hours": round(row["wall_seconds"] / 3600, 2),
                     "range (h)": f"{low / 3600:.2f}-{high / 3600:.2f}",
                     "all to 2,048 tokens (h)": round(row["every_output_to_max_new_tokens_seconds"] / 3600, 2),
                     "USD": f"{row['usd_range'][0]:.2f}-{row['usd_range'][1]:.2f}",
                     "efficiency": row["efficiency"]["basis"],
                     "seed's claim": record["seed_claims"].get(row["profile"], "-")})
    return rows
