"""A forecast without a pilot: the job's work (``work``) on every profile's GPU at a measured
efficiency, or at a labelled prior until one is measured. Needs no GPU and no weights: a preset, or
a folder with config.json (and the tokenizer, for exact token counts), and the prompts file::

    result = forecast_without_pilot(params)     # the job as params describe it, on every profile
    result.rows                                 # wall time, range, GPU-hours, $ and basis per profile

Each call of the engine is priced at its roofline: its bytes over the bandwidth the decode reaches,
its FLOPs over the compute the prefill (training: the step) reaches, whichever takes longer.
Efficiencies (achieved share of the datasheet peak, or of this machine's measured ceilings on the
cpu profile) come from, in order: ``outputs/reference/<profile>/roofline_efficiency.json`` (this
forecast held against a real run there), a pilot forecast's ``efficiency`` committed under
``outputs/reference/<profile>/`` (``forecast.json``), else ``PRIORS`` (labelled prior, with their
source). One profile's efficiency is never used for another. Output lengths come from the reference
outputs the input carries, else ``expected_new_tokens`` (one length, or lengths equally likely), else
max_new_tokens as the bound; the result says which.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbook import arithmetic, ceilings, models, params as params_module, presets, tiny_model
from workbook.notebook import markdown_table
from workbook.forecast import model as forecast
from workbook.forecast.settings import ForecastSettings, jobs_on_profiles
from workbook.forecast.work import (GenerationWork, ModelWork, flop_counter_check, generation_work, model_work,
                                    training_work)
from workbook.generation import records
from workbook.generation.backends import resolve_backend
from workbook.generation.files import resolve_input_path
from workbook.generation.job import tokenize_prompts
from workbook.generation.settings import GenerationSettings
from workbook.hardware import Hardware
from workbook.paths import REFERENCE_DIR, REPO_ROOT
from workbook.planner import profile as planner_profile
from workbook.planner.plans import DoesNotFitError
from workbook.training.config import TrainConfig, config_from_params

EFFICIENCY_FILE = "roofline_efficiency.json"
# A token of English text is about 4 bytes of UTF-8 for the BPE tokenizers of current LLMs (OpenAI's
# rule of thumb, "1 token ~= 4 chars in English"); code and other languages differ. Used only where
# the model has no tokenizer (a preset): the counts are then estimates, and say so.
BYTES_PER_TOKEN_ESTIMATE = 4.0
MEASURED_SPREAD = 0.15  # a measured efficiency's range: the CPU check holds the forecast within 15%

# Priors until a GPU run measures the efficiency: each a (low, middle, high) share of the datasheet peak.
PRIORS = {
    "decode_bandwidth": ((0.30, 0.50, 0.75),
                         "prior (not measured on this GPU): decode reads the weights and KV cache at no more than the "
                         "copy ceiling (an H100 copies at ~85-90% of its datasheet bandwidth, workbook ceilings); "
                         "transformers' Python-driven decode loses more to per-step launches: 30-75% assumed"),
    "compute": ((0.30, 0.50, 0.70),
                "prior (not measured on this GPU): a prefill is large bf16 matmuls, which cuBLAS runs at ~70-80% of "
                "the dense datasheet peak, plus attention and unfused element-wise work: 30-70% assumed"),
    "train_compute": ((0.25, 0.38, 0.45),
                      "prior (not measured on this GPU): Llama 3 pre-training reached 38-43% bf16 MFU on H100 "
                      "(Meta, 'The Llama 3 Herd of Models', 2024, table 4); a single-node fine-tune with "
                      "transformers rarely does better: 25-45% assumed"),
}


@dataclass(frozen=True)
class Efficiency:
    """Achieved shares of the peaks, each (low, middle, high), and where they come from."""

    decode_bandwidth: tuple[float, float, float]
    compute: tuple[float, float, float]
    basis: str  # 'measured' or 'prior'
    source: str

    def at(self, which: int) -> dict:
        return {"decode_bandwidth": self.decode_bandwidth[which], "compute": self.compute[which]}


def _spread(value: float) -> tuple[float, float, float]:
    return (value / (1 + MEASURED_SPREAD), value, value * (1 + MEASURED_SPREAD))


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if REPO_ROOT in path.parents else str(path)


def efficiency_for(profile_name: str, mode: str, root: Path = REFERENCE_DIR) -> Efficiency:
    """The efficiency of ``mode`` ('generate' or 'train') on ``profile_name``'s device: this
    forecast's own calibration there, a pilot forecast's, or the priors, in that order."""
    own = root / profile_name / EFFICIENCY_FILE
    if own.is_file():
        recorded = json.loads(own.read_text()).get("efficiency", {}).get(mode)
        if recorded:
            return Efficiency(_spread(recorded["decode_bandwidth"] or recorded["compute"]),
                              _spread(recorded["compute"]), "measured",
                              f"measured on {profile_name} by this forecast against a real run ({_relative(own)})")
    pilot = forecast.reference_efficiencies(profile_name, mode, root)
    if pilot:
        return Efficiency(_spread(pilot.get("decode_bandwidth") or pilot["compute"]), _spread(pilot["compute"]),
                          "measured", f"measured on {profile_name} by a pilot forecast ({pilot['file']})")
    compute = PRIORS["train_compute" if mode == "train" else "compute"]
    return Efficiency(PRIORS["decode_bandwidth"][0], compute[0], "prior",
                      f"decode: {PRIORS['decode_bandwidth'][1]}; compute: {compute[1]}")


_measured_here: dict = {}


def peaks_for(hardware: Hardware, dtype: str) -> forecast.Peaks | None:
    """A profile's datasheet peaks, or on the cpu profile this machine's measured ceilings: those its
    committed efficiency was measured against (``roofline_efficiency.json``), else measured now
    (fp32 matmul and copy bandwidth, once per process)."""
    peaks = forecast.profile_peaks(hardware, dtype)
    if peaks is not None or hardware.gpu_count > 0:
        return peaks
    recorded = REFERENCE_DIR / hardware.profile / EFFICIENCY_FILE
    if recorded.is_file() and json.loads(recorded.read_text()).get("peaks"):
        # The ceilings its efficiency was measured against: a share of other ceilings would mean nothing.
        return forecast.Peaks(**json.loads(recorded.read_text())["peaks"])
    if "cpu" not in _measured_here:
        measured = ceilings.measure("cpu", copy_bytes=128 * 2 ** 20, matmul_size=1024, repeats=3)
        _measured_here["cpu"] = forecast.Peaks(measured.matmul_flops_per_second, measured.copy_bytes_per_second,
                                               f"this machine's ceilings, {measured.how}")
    return _measured_here["cpu"]


def seconds(job: GenerationWork, peaks: forecast.Peaks, efficiency: dict) -> float:
    """Wall seconds of the job's calls at their roofline: each phase of each call at the slower of its
    bytes over the decode's achieved bandwidth and its FLOPs over the achieved compute."""
    bandwidth = peaks.bytes_per_second * efficiency["decode_bandwidth"]
    compute = peaks.flops * efficiency["compute"]

    def phase(work) -> float:
        return max(work.bytes / bandwidth, work.flops / compute)

    if job.calls:
        return sum(phase(call.prefill) + phase(call.decode) for call in job.calls)
    return phase(job.prefill) + phase(job.decode)


# ----------------------------------------------------------------------------------------------
# Lengths: prompts counted with the model's tokenizer (or estimated), outputs said, not guessed.

# Where the output lengths come from, in order, as the forecast's --json and report name it.
REFERENCE_OUTPUTS = "reference outputs in the input"
EXPECTED_NEW_TOKENS = "expected_new_tokens (params)"
MAX_NEW_TOKENS_BOUND = "max_new_tokens as the bound"


@dataclass
class JobLengths:
    prompt_tokens: list[int]
    output_tokens: list[float] | None  # per prompt, end of sequence included; None: not known (max_new_tokens)
    output_basis: str  # REFERENCE_OUTPUTS, EXPECTED_NEW_TOKENS or MAX_NEW_TOKENS_BOUND
    token_counts: str  # how the tokens were counted
    prompts_path: str
    notes: list[str] = field(default_factory=list)
    expected_new_tokens: tuple[int, ...] = ()  # the lengths params state, as stated (before the cap)
    # A stated distribution's ends: every output at its shortest length, every output at its longest;
    # the forecast's range runs between them. None: the range is the efficiency's alone.
    output_range: tuple[list[float], list[float]] | None = None


def reference_output(record: dict, output_field: str = "output") -> str | None:
    """The output a record already carries from an earlier teacher: its ``output`` field, else its
    ``metadata.original_output`` (seed 000's format); None when it has neither as text."""
    value = record.get(output_field)
    if isinstance(value, str) and value:
        return value
    original = (record.get("metadata") or {}).get("original_output") if isinstance(record.get("metadata"), dict) else None
    return original if isinstance(original, str) and original else None


def estimated_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE))


def dealt(lengths: list[float], count: int) -> list[float]:
    """``count`` outputs, each of ``lengths`` an equal share of them (to one output): which prompt
    gets which length is not stated, so they are dealt in a fixed pseudo-random order (the same on
    every run), not in file order, where a pattern in the file could meet the batches' cuts."""
    order = random.Random(0).sample(range(count), count)
    outputs = [0.0] * count
    for rank, index in enumerate(order):
        outputs[index] = lengths[rank % len(lengths)]
    return outputs


def job_lengths(settings: GenerationSettings, tokenizer=None, expected: tuple[int, ...] = ()) -> JobLengths:
    """The job's prompt lengths in tokens (the job's own tokenization with ``tokenizer``, else the
    bytes-per-token estimate) and its output lengths: the reference outputs every record carries,
    else the ``expected`` lengths (``expected_new_tokens``, each capped at max_new_tokens, dealt
    over the outputs in equal shares), else none (the forecast takes max_new_tokens as the bound)."""
    path = resolve_input_path(settings.prompts_path)
    examples, bad = records.load_examples(path, prompt_field=settings.prompt_field, on_bad_line=settings.on_bad_line,
                                          max_examples=settings.max_examples)
    if not examples:
        raise ValueError(f"{path}: no prompts to forecast")
    notes = [f"{len(bad)} bad line(s) of {path} left out"] if bad else []
    if tokenizer is not None:
        system = settings.system_prompt
        if system.startswith("@"):
            system = resolve_input_path(system[1:]).read_text()
        prompts = [len(ids) for ids in tokenize_prompts(tokenizer, [e.prompt for e in examples],
                                                        settings.use_chat_template, system)]
        counts = f"counted with the model's tokenizer ({settings.model})"

        def count(text):
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        prompts = [estimated_tokens(e.prompt) for e in examples]
        counts = (f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN_ESTIMATE:g} per token (the model has no tokenizer; "
                  "chat-template tokens not counted)")
        count = estimated_tokens
    samples = settings.samples_per_prompt
    repeat = lambda values: [value for value in values for _ in range(samples)]  # noqa: E731 - one row per sample
    prompts = repeat(prompts)
    references = [reference_output(e.record) for e in examples]
    partly = (f"{sum(map(bool, references))} of {len(examples)} records carry a reference output; all must for the "
              "forecast to use them") if any(references) else None
    if all(references):
        return JobLengths(prompts, repeat([count(text) + 1.0 for text in references]),  # + end of sequence
                          REFERENCE_OUTPUTS, counts, _relative(path), notes)
    if not expected:
        return JobLengths(prompts, None, MAX_NEW_TOKENS_BOUND, counts, _relative(path), notes + ([partly] if partly else []))
    capped = [float(min(length, settings.max_new_tokens)) for length in expected]
    if max(expected) > settings.max_new_tokens:
        notes.append(f"expected_new_tokens {','.join(map(str, expected))}: each length over max_new_tokens "
                     f"({settings.max_new_tokens}) counted as {settings.max_new_tokens}, where the job stops")
    ends = ([min(capped)] * len(prompts), [max(capped)] * len(prompts)) if len(set(capped)) > 1 else None
    return JobLengths(prompts, dealt(capped, len(prompts)), EXPECTED_NEW_TOKENS, counts, _relative(path),
                      notes + ([partly] if partly else []), tuple(expected), ends)


def output_note(lengths: JobLengths) -> str:
    """Where the output lengths came from, for the report."""
    if lengths.output_basis == REFERENCE_OUTPUTS:
        what = ("the lengths of the outputs the input already carries (an earlier teacher's); a new model's outputs "
                "differ, and every_output_to_max_new_tokens is the bound")
    elif lengths.output_basis == EXPECTED_NEW_TOKENS and lengths.output_range is None:
        what = f"every output {lengths.output_tokens[0]:g} tokens, as params state it"
    elif lengths.output_basis == EXPECTED_NEW_TOKENS:
        shortest, longest = lengths.output_range[0][0], lengths.output_range[1][0]
        what = (f"lengths {', '.join(map(str, lengths.expected_new_tokens))} tokens as params state them, each an "
                f"equal share of the outputs; the range runs from every output at {shortest:g} tokens (and the "
                f"high efficiency) to every output at {longest:g} (and the low)")
    else:
        what = ("no reference outputs in the input and no expected_new_tokens set, so every output runs to "
                "max_new_tokens: an upper bound (set expected_new_tokens to the length you expect, or to a previous "
                "run's percentiles)")
    return f"outputs: {lengths.output_basis}: {what}"


# ----------------------------------------------------------------------------------------------
# The forecast on every profile.


@dataclass
class RooflineForecast:
    mode: str
    profile: str
    model: str
    job: dict
    lengths: dict
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    method: str = "work at measured or prior efficiency (no pilot)"
    flop_counter_check: dict = field(default_factory=dict)  # the analytical count beside torch's FLOP counter

    def to_dict(self) -> dict:
        return forecast.round_floats(asdict(self))


def _processes(hardware: Hardware, processes: int, tensor_parallel_size: int | str = 1) -> int:
    """The job's copies of the model over every node: ``processes`` per node, each ``tensor_parallel_size``
    of them holding one copy ('auto' counted as 1)."""
    tensor = tensor_parallel_size if isinstance(tensor_parallel_size, int) else 1
    return max(1, processes // tensor) * hardware.num_nodes


def fitting_batch(planner_params, mode: str) -> int:
    """The batch the job runs with on this profile (the planner's largest for 'auto'), or DoesNotFitError
    with what to change when that batch does not fit its memory: a run that cannot start has no time.
    ``planner_params``: the profile the planner is asked with (``GenerationSettings.profile_params``)."""
    batch = planner_profile.resolve_batch_size(planner_params, mode)
    planner_profile.plan(planner_params, mode=mode, batch_size=batch).require_fit()
    return batch


def require_somewhere_to_run(rows: list[dict], own_profile: str) -> list[dict]:
    """``rows`` without their errors; DoesNotFitError (the job's own profile's) when no profile can run
    the job at all: a table of 'does not fit' forecasts nothing."""
    errors = {row["profile"]: row.pop("error") for row in rows if "error" in row}
    if errors and all(row["wall_seconds"] is None for row in rows):
        raise errors.get(own_profile) or next(iter(errors.values()))
    return rows


def generation_row(hardware: Hardware, settings: GenerationSettings, model: ModelWork, lengths: JobLengths) -> dict:
    """One profile's row: the job (``settings``, as it runs on that profile) on ``hardware``, its work at
    the planner's batch and the profile's efficiency."""
    name = hardware.profile
    peaks = peaks_for(hardware, settings.dtype)
    if peaks is None:
        return {"profile": name, "wall_seconds": None, "basis": "not forecast: the profile states no peaks"}
    backend, _ = resolve_backend(settings.profile_params)
    backend = "static" if backend == "static-compiled" else backend
    try:
        batch = fitting_batch({**settings.profile_params, "backend": backend}, "generate")
    except DoesNotFitError as error:
        return {"profile": name, "wall_seconds": None, "basis": f"does not fit: {error}", "error": error}
    efficiency = efficiency_for(name, "generate")
    processes = _processes(hardware, settings.data_parallel_processes, settings.tensor_parallel_size)
    bound = [float(settings.max_new_tokens)] * len(lengths.prompt_tokens)
    expected = lengths.output_tokens or bound
    shortest, longest = lengths.output_range or (expected, expected)
    order = sorted(range(len(lengths.prompt_tokens)), key=lambda i: (-lengths.prompt_tokens[i], i))

    def slowest(outputs, which):  # the job's split: each process every processes-th prompt of the sorted list
        worst, work = 0.0, None
        for rank in range(processes):
            mine = order[rank::processes]
            job = generation_work(model, [lengths.prompt_tokens[i] for i in mine], [outputs[i] for i in mine],
                                  backend=backend, batch_size=batch, max_new_tokens=settings.max_new_tokens)
            took = seconds(job, peaks, efficiency.at(which))
            if work is None or took > worst:
                worst, work = took, job
        return worst, work

    middle, job = slowest(expected, 1)
    low, _ = slowest(shortest, 2)
    high, _ = slowest(longest, 0)
    at_bound = slowest(bound, 0)[0] if lengths.output_tokens else high
    cost_low, cost_high = (forecast.cost(took, hardware, hardware.num_nodes) for took in (low, high))
    where = (peaks.source if hardware.gpu_count == 0 else f"params/{name}.yaml datasheet peaks")
    return {"profile": name, "batch_size": batch, "backend": backend, "processes": processes,
            "wall_seconds": middle, "wall_seconds_range": [low, high],
            "every_output_to_max_new_tokens_seconds": at_bound, **forecast.cost(middle, hardware, hardware.num_nodes),
            "usd_range": [cost_low["usd"], cost_high["usd"]],
            "efficiency": {"basis": efficiency.basis, **efficiency.at(1), "range": [efficiency.at(0), efficiency.at(2)]},
            "basis": f"{efficiency.basis} efficiency: {efficiency.source}; peaks: {where}; outputs: {lengths.output_basis}",
            "work": job.summary(), "peaks": asdict(peaks)}


def pilot_or_work(model_name: str, hardware: Hardware) -> str:
    """'pilot' where this machine can run the job's model (the tiny model, or a folder with weights on
    the profile's kind of device), else 'work': a preset (random weights, no tokenizer), a folder
    without weights, or a GPU profile on a machine without a GPU."""
    if model_name == tiny_model.TINY_MODEL_NAME:
        return "pilot"
    try:
        if models.is_preset(model_name):
            return "work"
    except ValueError:  # neither a preset nor a folder: the pilot's loading says so
        return "pilot"
    folder = Path(model_name).expanduser()
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return "work"
    return "work" if hardware.has_gpu and not torch.cuda.is_available() else "pilot"


def load_tokenizer_if_any(model_name: str):
    """The model's tokenizer where it has one (the tiny model, a folder with tokenizer files); None
    for a preset or a folder without one (the counts are then estimates)."""
    if models.is_preset(model_name):
        return None
    if model_name == tiny_model.TINY_MODEL_NAME:  # the tiny model's tokenizer is built, not trained: no model build
        return tiny_model.build_tokenizer()
    try:
        return models.load_tokenizer(model_name)
    except Exception:  # a folder with config.json only: no tokenizer files is allowed here
        return None


def job_params(params) -> params_module.Params:
    """``params`` with the keys it lacks (a notebook declares only its own) from its profile's file,
    else the schema's defaults: the job the profile runs, with what ``params`` states over it."""
    if all(key in params for key in params_module.SCHEMA):
        return params
    try:
        base = params_module.load(params_module.profile_path(params["profile"]))
    except (params_module.ParamsError, KeyError, OSError, ValueError):
        base = params_module.defaults()
    return params_module.Params({**base, **params})


def forecast_without_pilot(params, *, profiles: dict | None = None, tokenizer=None, log=print) -> RooflineForecast:
    """The generation job ``params`` describe, on every profile (``profiles``: default all of
    params/), from its work and each profile's efficiency. Nothing runs the model. The entry: the
    params become typed settings here, the job's and each profile's."""
    params = job_params(params)
    settings, own = GenerationSettings.from_params(params), ForecastSettings.from_params(params)
    on_each = {name: (Hardware.from_params(there), GenerationSettings.from_params(there))
               for name, there in jobs_on_profiles(params, profiles).items()}
    return generation_without_pilot(settings, own, on_each, tokenizer=tokenizer, log=log)


def generation_without_pilot(settings: GenerationSettings, own: ForecastSettings,
                             on_each: dict[str, tuple[Hardware, GenerationSettings]], *, tokenizer=None,
                             log=print) -> RooflineForecast:
    """The job ``settings`` describe on each profile of ``on_each`` (its machine, and the job as it runs
    there: that profile's layout and dtype)."""
    config = presets.load_config(models.model_source(settings.model))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(settings.model)
    lengths = job_lengths(settings, tokenizer, own.expected_lengths)
    rows = []
    for name, (hardware, there) in sorted(on_each.items()):
        log(f"forecast (no pilot): {name}")
        rows.append(generation_row(hardware, there, model_work(config, there.dtype), lengths))
    rows = require_somewhere_to_run(rows, settings.profile)
    notes = [output_note(lengths), f"tokens {lengths.token_counts}",
             "not in the time: start-up and loading the weights (minutes for an 8B model), writing the outputs"]
    prompts = lengths.prompt_tokens
    # The count checked against the real ops on the meta model, at the job's longest prompt (a few rows).
    checked = flop_counter_check(config, model_work(config, settings.dtype), min(4, len(prompts)), max(prompts))
    return RooflineForecast(
        mode="generate", profile=settings.profile, model=settings.model,
        job={"prompts": len(prompts), "max_new_tokens": settings.max_new_tokens, "prompts_path": lengths.prompts_path,
             "prompt_tokens": {"min": min(prompts), "median": sorted(prompts)[len(prompts) // 2], "max": max(prompts),
                               "total": sum(prompts)}},
        lengths={"output_basis": lengths.output_basis, "token_counts": lengths.token_counts,
                 "output_tokens_total": sum(lengths.output_tokens) if lengths.output_tokens else None,
                 "expected_new_tokens": list(lengths.expected_new_tokens) or None},
        rows=rows, notes=notes + lengths.notes, flop_counter_check=checked)


def forecast_lines(result: RooflineForecast, pilot_rows: list[dict] | None = None) -> list[str]:
    """The forecast as a table for the terminal (and notebook 01); a pilot forecast's rows beside it
    where one was made."""
    pilot = {row["profile"]: row for row in pilot_rows or []}
    rows = []
    for row in result.rows:
        if row.get("wall_seconds") is None:
            rows.append({"profile": row["profile"], "wall": "-", "basis": row["basis"]})
            continue
        low, high = row["wall_seconds_range"]
        line = {"profile": row["profile"], "batch": row["batch_size"], "wall": _hours(row["wall_seconds"]),
                "range": f"{_hours(low)} - {_hours(high)}", "GPU-hours": f"{row['gpu_hours']:.2f}",
                "USD": f"{row['usd_range'][0]:.2f} - {row['usd_range'][1]:.2f}",
                "all to max_new_tokens": _hours(row["every_output_to_max_new_tokens_seconds"])
                if row.get("every_output_to_max_new_tokens_seconds") else "-",
                "efficiency": row["efficiency"]["basis"]}
        if pilot_rows is not None:
            other = pilot.get(row["profile"], {})
            line["pilot forecast"] = _hours(other["wall_seconds"]) if other.get("wall_seconds") else "-"
        rows.append(line)
    head = (f"forecast without a pilot ({result.method}): {result.job['prompts']} prompts of {result.model}, up to "
            f"{result.job['max_new_tokens']} new tokens; outputs: {result.lengths['output_basis']}"
            if result.mode == "generate" else f"forecast without a pilot ({result.method}): training {result.model} on "
            f"{result.job['examples']} examples ({result.job['tokens']:,} tokens) of {result.job['train_data_path']}")
    return [head, "", markdown_table(rows)] + [f"note: {note}" for note in result.notes]


def _hours(seconds_: float) -> str:
    if seconds_ < 1:  # a tiny model on a GPU: milliseconds
        return f"{seconds_ * 1000:.2g} ms"
    return f"{seconds_:.1f} s" if seconds_ < 120 else f"{seconds_ / 60:.1f} min" if seconds_ < 7200 else f"{seconds_ / 3600:.2f} h"


def training_example_tokens(config: TrainConfig, tokenizer=None) -> tuple[list[int], str, str]:
    """(tokens per training example, where they came from, how they were counted): each record's
    input as the training formats it (the chat template's user turn) plus its output and the end of
    sequence, from the run's data (``config.data_path``: train_data_path, notebook 02's outputs, else
    the shipped arithmetic sample)."""
    path = resolve_input_path(config.data_path or str(arithmetic.SAMPLE_PROMPTS_PATH))
    examples, _ = records.load_examples(path, prompt_field=config.input_field, on_bad_line=config.on_bad_line)
    outputs = [e.record.get(config.output_field) or "" for e in examples]
    if tokenizer is not None:
        inputs = [len(ids) for ids in tokenize_prompts(tokenizer, [e.prompt for e in examples], config.use_chat_template)]
        counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in outputs]
        how = f"counted with the model's tokenizer ({config.model})"
    else:
        inputs, counts = [estimated_tokens(e.prompt) for e in examples], [estimated_tokens(t) for t in outputs]
        how = f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN_ESTIMATE:g} per token (the model has no tokenizer)"
    return [a + b + 1 for a, b in zip(inputs, counts)], _relative(path), how


@dataclass(frozen=True)
class TrainingOnProfile:
    """A training run as one profile runs it: that profile's machine, the run's config with the
    profile's process layout and dtype, and the profile the planner is asked with."""

    hardware: Hardware
    config: TrainConfig
    planner_params: dict


def forecast_training_without_pilot(params, *, profiles: dict | None = None, tokenizer=None) -> RooflineForecast:
    """A packed training run on every profile from its steps' work (compute-bound) at each profile's
    training efficiency. Nothing runs the model. The entry: the params become typed settings here."""
    params = job_params(params)
    own = ForecastSettings.from_params(params)
    with tempfile.TemporaryDirectory(prefix="forecast-") as scratch:  # the run folder the config is resolved in
        on_each = {name: TrainingOnProfile(Hardware.from_params(there), config_from_params(there, scratch), there)
                   for name, there in jobs_on_profiles(params, profiles).items()}
    return training_without_pilot(on_each[own.profile].config, own, on_each, tokenizer=tokenizer)


def training_without_pilot(config: TrainConfig, own: ForecastSettings, on_each: dict[str, TrainingOnProfile], *,
                           tokenizer=None) -> RooflineForecast:
    """The training run ``config`` describes on each profile of ``on_each``."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(config.model)
    tokens, path, how = training_example_tokens(config, tokenizer)
    model_config = presets.load_config(models.model_source(config.model))
    rows = require_somewhere_to_run(training_forecast_rows(on_each, tokens, own.seq_len, model_config), own.profile)
    return RooflineForecast(
        mode="train", profile=own.profile, model=config.model,
        job={"examples": len(tokens), "train_data_path": path, "tokens": sum(tokens), "epochs": config.epochs,
             "max_steps": config.max_steps, "prompts": len(tokens), "max_new_tokens": None},
        lengths={"output_basis": "the training data's own outputs", "token_counts": how}, rows=rows,
        notes=[f"tokens {how}", "packed rows of the profile's seq_len (max_seq_length 'auto': seq_len); not in the "
               "time: start-up, loading, validation passes and saving the model"])


def training_forecast_rows(on_each: dict[str, TrainingOnProfile], example_tokens: list[int], seq_len: int,
                           model_config) -> list[dict]:
    """A packed training run's steps on every profile at its training efficiency (compute-bound);
    ``seq_len``: the rows' length where max_seq_length is 'auto'; ``model_config``: the model's."""
    rows = []
    for name, run_there in sorted(on_each.items()):
        hardware, config = run_there.hardware, run_there.config
        peaks = peaks_for(hardware, config.dtype)
        if peaks is None:
            continue
        row_length = seq_len if config.max_seq_length == "auto" else config.max_seq_length
        try:
            micro = fitting_batch({**run_there.planner_params, "seq_len": row_length}, "train")
        except DoesNotFitError as error:
            rows.append({"profile": name, "wall_seconds": None, "basis": f"does not fit: {error}", "error": error})
            continue
        processes = _processes(hardware, config.processes)
        run = training_work(model_work(model_config, config.dtype),
                            example_tokens, seq_len=row_length, micro_batch_size=micro,
                            accumulation=config.gradient_accumulation_steps, processes=processes, epochs=config.epochs,
                            max_steps=config.max_steps, lora=config.lora_rank > 0, recompute=config.grad_checkpointing)
        efficiency = efficiency_for(name, "train")
        took = [run.total.flops / (peaks.flops * efficiency.compute[i] * processes) for i in range(3)]

        def cost(seconds_: float) -> dict:
            return forecast.cost(seconds_, hardware, hardware.num_nodes)

        rows.append({"profile": name, "batch_size": micro, "wall_seconds": took[1],
                     "wall_seconds_range": [took[2], took[0]], **cost(took[1]),
                     "usd_range": [cost(took[2])["usd"], cost(took[0])["usd"]],
                     "efficiency": {"basis": efficiency.basis, "compute": efficiency.compute[1]},
                     "basis": f"{efficiency.basis} efficiency: {efficiency.source}", "work": run.summary()})
    return rows
