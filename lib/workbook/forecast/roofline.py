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
source). One profile's efficiency is never used for another.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbook import arithmetic, ceilings, models, params as params_module, presets, tiny_model
from workbook.notebook import markdown_table
from workbook.forecast import model as forecast
from workbook.forecast.work import (GenerationWork, ModelWork, flop_counter_check, generation_work, model_work,
                                    training_work)
from workbook.generation import records
from workbook.generation.backends import resolve_backend
from workbook.generation.files import resolve_input_path
from workbook.generation.job import tokenize_prompts
from workbook.paths import REFERENCE_DIR, REPO_ROOT
from workbook.planner import profile as planner_profile
from workbook.planner.plans import DoesNotFitError

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


def peaks_for(profile: dict, dtype: str) -> forecast.Peaks | None:
    """A profile's datasheet peaks, or on the cpu profile this machine's measured ceilings: those its
    committed efficiency was measured against (``roofline_efficiency.json``), else measured now
    (fp32 matmul and copy bandwidth, once per process)."""
    peaks = forecast.profile_peaks(profile, dtype)
    if peaks is not None or profile["gpu_count"] > 0:
        return peaks
    recorded = REFERENCE_DIR / profile["profile"] / EFFICIENCY_FILE
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


@dataclass
class JobLengths:
    prompt_tokens: list[int]
    output_tokens: list[float] | None  # per prompt, end of sequence included; None: not known
    output_basis: str  # 'reference outputs', 'expected_new_tokens' or 'max_new_tokens (bound)'
    token_counts: str  # how the tokens were counted
    prompts_path: str
    notes: list[str] = field(default_factory=list)


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


def job_lengths(params, tokenizer=None) -> JobLengths:
    """The job's prompt lengths in tokens (the job's own tokenization with ``tokenizer``, else the
    bytes-per-token estimate) and its output lengths: the reference outputs every record carries,
    else ``expected_new_tokens`` for every output, else none (the forecast takes max_new_tokens)."""
    path = resolve_input_path(params["prompts_path"])
    examples, bad = records.load_examples(path, prompt_field=params["prompt_field"], on_bad_line=params["on_bad_line"],
                                          max_examples=params["max_examples"])
    if not examples:
        raise ValueError(f"{path}: no prompts to forecast")
    samples = params["samples_per_prompt"]
    notes = [f"{len(bad)} bad line(s) of {path} left out"] if bad else []
    if tokenizer is not None:
        system = params["system_prompt"]
        if system.startswith("@"):
            system = resolve_input_path(system[1:]).read_text()
        prompts = [len(ids) for ids in tokenize_prompts(tokenizer, [e.prompt for e in examples],
                                                        params["use_chat_template"], system)]
        counts = f"counted with the model's tokenizer ({params['model']})"

        def count(text):
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        prompts = [estimated_tokens(e.prompt) for e in examples]
        counts = (f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN_ESTIMATE:g} per token (the model has no tokenizer; "
                  "chat-template tokens not counted)")
        count = estimated_tokens
    references = [reference_output(e.record) for e in examples]
    if all(references):
        outputs, basis = [count(text) + 1.0 for text in references], "reference outputs"  # + end of sequence
    elif params.get("expected_new_tokens"):
        outputs, basis = [float(params["expected_new_tokens"])] * len(examples), "expected_new_tokens"
        if any(references):
            notes.append(f"{sum(map(bool, references))} of {len(examples)} records carry a reference output; "
                         "all must for the forecast to use them")
    else:
        outputs, basis = None, "max_new_tokens (bound)"
    repeat = lambda values: [value for value in values for _ in range(samples)]  # noqa: E731 - one row per sample
    return JobLengths(repeat(prompts), repeat(outputs) if outputs else None, basis, counts, _relative(path), notes)


# ----------------------------------------------------------------------------------------------
# The forecast on every profile.


HARDWARE_KEYS = ("profile", "gpu", "gpu_spec", "gpu_name_pattern", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops",
                 "peak_fp16_tflops", "memory_bandwidth_gbs", "supports_bf16", "supports_tf32", "usd_per_gpu_hour",
                 "cuda_overhead_gib", "data_parallel_processes", "train_processes", "tensor_parallel_size", "dtype")


def on_profile(params, other: dict) -> params_module.Params:
    """The job of ``params`` on ``other``'s machine: its hardware facts, price, process layout and
    dtype; the job's own settings (model, prompts, lengths, batch size) kept."""
    return params_module.Params({**params, **{key: other[key] for key in HARDWARE_KEYS if key in other}})


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


def _row_cost(seconds_: float, settings: dict) -> dict:
    return forecast.cost(seconds_, settings, settings.get("num_nodes", 1))


def _processes(settings: dict, mode: str) -> int:
    key = "data_parallel_processes" if mode == "generate" else "train_processes"
    tensor = settings.get("tensor_parallel_size", 1) if mode == "generate" else 1
    tensor = tensor if isinstance(tensor, int) else 1
    return max(1, settings[key] // tensor) * settings.get("num_nodes", 1)


def fitting_batch(settings, mode: str) -> int:
    """The batch the job runs with on this profile (the planner's largest for 'auto'), or DoesNotFitError
    with what to change when that batch does not fit its memory: a run that cannot start has no time."""
    batch = planner_profile.resolve_batch_size(settings, mode)
    planner_profile.plan(settings, mode=mode, batch_size=batch).require_fit()
    return batch


def require_somewhere_to_run(rows: list[dict], own_profile: str) -> list[dict]:
    """``rows`` without their errors; DoesNotFitError (the job's own profile's) when no profile can run
    the job at all: a table of 'does not fit' forecasts nothing."""
    errors = {row["profile"]: row.pop("error") for row in rows if "error" in row}
    if errors and all(row["wall_seconds"] is None for row in rows):
        raise errors.get(own_profile) or next(iter(errors.values()))
    return rows


def generation_row(settings, model: ModelWork, lengths: JobLengths) -> dict:
    """One profile's row: the job's work at the planner's batch, at the profile's efficiency."""
    name = settings["profile"]
    peaks = peaks_for(settings, settings["dtype"])
    if peaks is None:
        return {"profile": name, "wall_seconds": None, "basis": "not forecast: the profile states no peaks"}
    backend, _ = resolve_backend(settings)
    backend = "static" if backend == "static-compiled" else backend
    try:
        batch = fitting_batch({**settings, "backend": backend}, "generate")
    except DoesNotFitError as error:
        return {"profile": name, "wall_seconds": None, "basis": f"does not fit: {error}", "error": error}
    efficiency = efficiency_for(name, "generate")
    processes = _processes(settings, "generate")
    bound = [float(settings["max_new_tokens"])] * len(lengths.prompt_tokens)
    expected = lengths.output_tokens or bound
    order = sorted(range(len(lengths.prompt_tokens)), key=lambda i: (-lengths.prompt_tokens[i], i))

    def slowest(outputs, which):  # the job's split: each process every processes-th prompt of the sorted list
        worst, work = 0.0, None
        for rank in range(processes):
            mine = order[rank::processes]
            job = generation_work(model, [lengths.prompt_tokens[i] for i in mine], [outputs[i] for i in mine],
                                  backend=backend, batch_size=batch, max_new_tokens=settings["max_new_tokens"])
            took = seconds(job, peaks, efficiency.at(which))
            if work is None or took > worst:
                worst, work = took, job
        return worst, work

    middle, job = slowest(expected, 1)
    low, _ = slowest(expected, 2)
    high, _ = slowest(expected, 0)
    at_bound = slowest(bound, 0)[0] if lengths.output_tokens else high
    cost_low, cost_high = _row_cost(low, settings), _row_cost(high, settings)
    where = (peaks.source if settings["gpu_count"] == 0 else f"params/{name}.yaml datasheet peaks")
    return {"profile": name, "batch_size": batch, "backend": backend, "processes": processes,
            "wall_seconds": middle, "wall_seconds_range": [low, high],
            "every_output_to_max_new_tokens_seconds": at_bound, **_row_cost(middle, settings),
            "usd_range": [cost_low["usd"], cost_high["usd"]],
            "efficiency": {"basis": efficiency.basis, **efficiency.at(1), "range": [efficiency.at(0), efficiency.at(2)]},
            "basis": f"{efficiency.basis} efficiency: {efficiency.source}; peaks: {where}; outputs: {lengths.output_basis}",
            "work": job.summary(), "peaks": asdict(peaks)}


def pilot_or_work(params) -> str:
    """'pilot' where this machine can run the job's model (the tiny model, or a folder with weights on
    the profile's kind of device), else 'work': a preset (random weights, no tokenizer), a folder
    without weights, or a GPU profile on a machine without a GPU."""
    model_name = params["model"]
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
    return "work" if params["gpu_count"] > 0 and not torch.cuda.is_available() else "pilot"


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
    params/), from its work and each profile's efficiency. Nothing runs the model."""
    params = job_params(params)
    config = presets.load_config(models.model_source(params["model"]))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(params["model"])
    lengths = job_lengths(params, tokenizer)
    profiles = params_module.load_all() if profiles is None else profiles
    profiles = {**profiles, params["profile"]: params}
    rows = []
    for name, other in sorted(profiles.items()):
        settings = params if name == params["profile"] else on_profile(params, other)
        log(f"forecast (no pilot): {name}")
        rows.append(generation_row(settings, model_work(config, settings["dtype"]), lengths))
    rows = require_somewhere_to_run(rows, params["profile"])
    notes = [f"outputs: {lengths.output_basis}" + {
        "reference outputs": ": the lengths of the outputs the input already carries (an earlier teacher's); a new "
                             "model's outputs differ, and every_output_to_max_new_tokens is the bound",
        "expected_new_tokens": f": every output {params.get('expected_new_tokens')} tokens, as stated in params",
        "max_new_tokens (bound)": ": no reference outputs in the input and no expected_new_tokens set, so every "
                                  "output runs to max_new_tokens: an upper bound"}[lengths.output_basis],
             f"tokens {lengths.token_counts}",
             "not in the time: start-up and loading the weights (minutes for an 8B model), writing the outputs"]
    prompts = lengths.prompt_tokens
    # The count checked against the real ops on the meta model, at the job's longest prompt (a few rows).
    checked = flop_counter_check(config, model_work(config, params["dtype"]), min(4, len(prompts)), max(prompts))
    return RooflineForecast(
        mode="generate", profile=params["profile"], model=params["model"],
        job={"prompts": len(prompts), "max_new_tokens": params["max_new_tokens"], "prompts_path": lengths.prompts_path,
             "prompt_tokens": {"min": min(prompts), "median": sorted(prompts)[len(prompts) // 2], "max": max(prompts),
                               "total": sum(prompts)}},
        lengths={"output_basis": lengths.output_basis, "token_counts": lengths.token_counts,
                 "output_tokens_total": sum(lengths.output_tokens) if lengths.output_tokens else None},
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


def training_example_tokens(params, tokenizer=None) -> tuple[list[int], str, str]:
    """(tokens per training example, where they came from, how they were counted): each record's
    input as the training formats it (the chat template's user turn) plus its output and the end of
    sequence, from ``train_data_path`` (else the shipped arithmetic sample)."""
    path = Path(params["train_data_path"]).expanduser() if params["train_data_path"] else arithmetic.SAMPLE_PROMPTS_PATH
    examples, _ = records.load_examples(resolve_input_path(str(path)), prompt_field=params["input_field"],
                                        on_bad_line=params["on_bad_line"])
    outputs = [e.record.get(params["output_field"]) or "" for e in examples]
    if tokenizer is not None:
        inputs = [len(ids) for ids in tokenize_prompts(tokenizer, [e.prompt for e in examples], params["use_chat_template"])]
        counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in outputs]
        how = f"counted with the model's tokenizer ({params['model']})"
    else:
        inputs, counts = [estimated_tokens(e.prompt) for e in examples], [estimated_tokens(t) for t in outputs]
        how = f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN_ESTIMATE:g} per token (the model has no tokenizer)"
    return [a + b + 1 for a, b in zip(inputs, counts)], _relative(resolve_input_path(str(path))), how


def forecast_training_without_pilot(params, *, profiles: dict | None = None, tokenizer=None) -> RooflineForecast:
    """A packed training run on every profile from its steps' work (compute-bound) at each profile's
    training efficiency. Nothing runs the model."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(params["model"])
    tokens, path, how = training_example_tokens(params, tokenizer)
    rows = require_somewhere_to_run(training_forecast_rows(params, tokens, profiles), params["profile"])
    return RooflineForecast(
        mode="train", profile=params["profile"], model=params["model"],
        job={"examples": len(tokens), "train_data_path": path, "tokens": sum(tokens), "epochs": params["epochs"],
             "max_steps": params["max_steps"], "prompts": len(tokens), "max_new_tokens": None},
        lengths={"output_basis": "the training data's own outputs", "token_counts": how}, rows=rows,
        notes=[f"tokens {how}", "packed rows of the profile's seq_len (max_seq_length 'auto': seq_len); not in the "
               "time: start-up, loading, validation passes and saving the model"])


def training_forecast_rows(params, example_tokens: list[int], profiles: dict | None = None) -> list[dict]:
    """A packed training run's steps on every profile at its training efficiency (compute-bound)."""
    config = presets.load_config(models.model_source(params["model"]))
    profiles = params_module.load_all() if profiles is None else profiles
    rows = []
    for name, other in sorted({**profiles, params["profile"]: params}.items()):
        settings = params if name == params["profile"] else on_profile(params, other)
        peaks = peaks_for(settings, settings["dtype"])
        if peaks is None:
            continue
        seq_len = settings["seq_len"] if settings["max_seq_length"] == "auto" else settings["max_seq_length"]
        try:
            micro = fitting_batch({**settings, "seq_len": seq_len}, "train")
        except DoesNotFitError as error:
            rows.append({"profile": name, "wall_seconds": None, "basis": f"does not fit: {error}", "error": error})
            continue
        run = training_work(model_work(config, settings["dtype"]), example_tokens, seq_len=seq_len,
                            micro_batch_size=micro, accumulation=settings["gradient_accumulation_steps"],
                            processes=_processes(settings, "train"), epochs=settings["epochs"],
                            max_steps=settings["max_steps"], lora=settings["lora_rank"] > 0,
                            recompute=settings["grad_checkpointing"])
        efficiency = efficiency_for(name, "train")
        gpus = max(_processes(settings, "train"), 1)
        took = [run.total.flops / (peaks.flops * efficiency.compute[i] * gpus) for i in range(3)]
        rows.append({"profile": name, "batch_size": micro, "wall_seconds": took[1],
                     "wall_seconds_range": [took[2], took[0]], **_row_cost(took[1], settings),
                     "usd_range": [_row_cost(took[2], settings)["usd"], _row_cost(took[0], settings)["usd"]],
                     "efficiency": {"basis": efficiency.basis, "compute": efficiency.compute[1]},
                     "basis": f"{efficiency.basis} efficiency: {efficiency.source}", "work": run.summary()})
    return rows
