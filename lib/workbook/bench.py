"""Benchmarks against the hardware's limits: the logic behind notebook 04 and ``workbook bench``.

    workbook bench --params cpu       # tiny model on this CPU, about a minute
    workbook bench --params h200      # 8B-shaped random bf16 model (generation), 1B-shaped (training)

Generation sweep, every strategy on the same prompts (random token ids, lengths uniform in
[prompt_len / 4, prompt_len], every output forced to ``bench_max_new_tokens`` so padding comes from
the prompts and the batch's longest output alone):

- ``seed-before``: one prompt at a time (seeds 000/002 before their change);
- ``seed-after``: static batches of 32 in file order, eager (the seeds' "after"; the baseline that
  speedups are quoted against);
- ``static-sorted``: static batches sorted longest first (the job's default), per batch size;
- ``static-compiled``: static KV cache + torch.compile, per batch size (skipped on CPU: it compiles
  again for every batch size, minutes of compiling for seconds of decoding);
- ``continuous``: transformers' continuous batching, per batch size.

Each point: one warm-up batch, then ``bench_repeats`` timed runs with the device synchronized; the
median counts and the spread (min, max) is kept. Reported per point: output tokens/s, examples/min,
time to first result, padding waste, peak memory beside the planner's prediction (CPU: "not
measured", never invented), and the fraction of the memory-bandwidth roofline and of the compute
peak reached. Bytes and FLOPs per decode step are counted from the model config (``decode_step_cost``);
the peaks come from the profile (0 on the cpu profile: "n/a").

Training sweep (``train.train`` on each point): micro-batch x gradient checkpointing x compile x
packing, one factor at a time around each micro-batch; tokens/s, MFU, peak memory vs prediction.

An NVML sampler (a thread) records GPU utilization, memory used, power and SM clock during each point.
NVML's utilization is the share of time some kernel ran, not how much of the chip it used: it is
reported under that name, and efficiency is judged by the roofline fractions instead.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from workbook import generate, memory, planning, presets
from workbook.params import AUTO

SEED_BATCH_SIZE = 32  # the seeds' "after": static batches of 32 in file order
STRATEGIES = ("seed-before", "seed-after", "static-sorted", "static-compiled", "continuous")
BASELINE = "seed-after"
NVML_INTERVAL_SECONDS = 0.1
NOT_MEASURED = "not measured"
NA = "n/a"
# The params keys the benchmark reads; notebook 04 declares them all in its parameters cell.
PARAMS_USED = ("profile", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops", "peak_fp16_tflops",
               "memory_bandwidth_gbs", "usd_per_gpu_hour", "dtype", "prompt_len", "seq_len", "safety_margin",
               "cuda_overhead_gib", "bench_generate_model", "bench_train_model", "bench_batch_sizes",
               "bench_strategies", "bench_examples", "bench_max_new_tokens", "bench_repeats",
               "bench_train_micro_batches", "bench_train_steps", "lora_rank")


class BenchError(ValueError):
    """The benchmark cannot run as configured; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# Counting: bytes and FLOPs per decode step, rooflines, peaks, cost.


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One decode step of a batch: what it must read from memory and compute."""

    bytes_read: int  # weights streamed once + the KV cache of every sequence
    flops: int  # 2 x matmul parameters per token + attention over the context, all rows
    weights_bytes: int
    kv_cache_bytes: int


def decode_step_cost(model, dtype: str, batch_size: int, context_tokens: int) -> StepCost:
    """Bytes and FLOPs of one decode step of ``batch_size`` sequences with ``context_tokens`` each.

    Bytes: every weight is read once per step (the input embedding only for the rows it gathers,
    so an untied embedding matrix is left out) plus each sequence's KV cache
    (``memory.kv_cache_bytes_per_token`` x context). FLOPs per token: 2 per matmul weight (one
    multiply-add) plus 4 x layers x heads x head_dim x context for the scores and the weighted
    values. Norms, rotary embeddings and the softmax are left out (well under 1%).
    """
    config = presets.load_config(model) if isinstance(model, str) else model
    shape = memory.model_shape(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    parameter_bytes = memory.BITS_PER_PARAMETER[memory.canonical_dtype(dtype)] // 8
    streamed = shape.parameters - (0 if tied else shape.vocab_size * shape.hidden_size)
    weights = streamed * parameter_bytes
    kv = batch_size * context_tokens * memory.kv_cache_bytes_per_token(shape, dtype)
    matmul = sum(layer.in_features * layer.out_features for layer in shape.linear_layers)
    per_token = 2 * matmul + 4 * shape.num_layers * shape.query_width * context_tokens
    return StepCost(bytes_read=weights + kv, flops=batch_size * per_token, weights_bytes=weights, kv_cache_bytes=kv)


def peak_tflops(params, dtype: str) -> float:
    """The profile's dense peak for ``dtype`` (fp32 has none in the profiles: 0)."""
    return {"bf16": params["peak_bf16_tflops"], "fp16": params["peak_fp16_tflops"]}.get(dtype, 0.0)


def roofline_tokens_per_second(cost: StepCost, batch_size: int, bandwidth_gbs: float,
                               peak_tflops_value: float) -> dict:
    """Output tokens/s if a decode step took only its memory reads at peak bandwidth (``bandwidth``),
    or only its FLOPs at the peak (``compute``); the roofline is the lower of the two. None: no peak."""
    bandwidth = batch_size * bandwidth_gbs * 1e9 / cost.bytes_read if bandwidth_gbs else None
    compute = batch_size * peak_tflops_value * 1e12 / cost.flops if peak_tflops_value else None
    bounds = [value for value in (bandwidth, compute) if value is not None]
    return {"bandwidth": bandwidth, "compute": compute, "roofline": min(bounds) if bounds else None}


def fractions_of_peak(tokens_per_second: float | None, cost: StepCost, batch_size: int, bandwidth_gbs: float,
                      peak_tflops_value: float) -> dict:
    """Achieved memory traffic / peak bandwidth and achieved FLOP/s / peak; None where there is no peak."""
    if not tokens_per_second:
        return {"bandwidth": None, "compute": None}
    steps_per_second = tokens_per_second / batch_size
    return {"bandwidth": steps_per_second * cost.bytes_read / (bandwidth_gbs * 1e9) if bandwidth_gbs else None,
            "compute": steps_per_second * cost.flops / (peak_tflops_value * 1e12) if peak_tflops_value else None}


def cost_figures(seconds: float, examples: int, output_tokens: int, usd_per_gpu_hour: float, gpus: int = 1) -> dict:
    """US dollars per 1,000 examples and per million output tokens at the profile's price; None when
    the profile has no price (cpu)."""
    if not usd_per_gpu_hour or not seconds:
        return {"usd_per_1000_examples": None, "usd_per_million_tokens": None,
                "note": f"{NA}: the profile has no price per GPU-hour" if not usd_per_gpu_hour else NA}
    dollars = seconds / 3600 * gpus * usd_per_gpu_hour
    return {"usd_per_1000_examples": dollars / examples * 1000 if examples else None,
            "usd_per_million_tokens": dollars / output_tokens * 1e6 if output_tokens else None,
            "note": f"{gpus} GPU(s) x ${usd_per_gpu_hour:g}/GPU-hour"}


def parse_int_list(text: str, key: str, auto: int | None = None) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; 'auto' entries become ``auto`` where one is given; an error names the key."""
    parts = [part for part in str(text).replace(" ", "").split(",") if part]
    try:
        values = [auto if part == AUTO and auto is not None else int(part) for part in parts]
    except ValueError:
        raise BenchError(f"{key} is {text!r}; expected comma-separated positive integers, e.g. '1,8,32'") from None
    if not values or any(value < 1 for value in values):
        raise BenchError(f"{key} is {text!r}; expected comma-separated positive integers, e.g. '1,8,32'")
    return values


def parse_strategies(text: str) -> list[str]:
    chosen = [part.strip() for part in str(text).split(",") if part.strip()]
    unknown = [name for name in chosen if name not in STRATEGIES]
    if unknown or not chosen:
        raise BenchError(f"bench_strategies is {text!r}; expected a comma-separated subset of {', '.join(STRATEGIES)}")
    return chosen


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


# ----------------------------------------------------------------------------------------------
# NVML sampler.


class NvmlSampler:
    """Samples every GPU's utilization (share of time a kernel ran), memory used, power and SM
    clock on a thread while a point runs. ``nvml``: the pynvml module (tests pass a fake); on a
    machine without NVML ``summary()`` says it is unavailable and why."""

    def __init__(self, nvml=None, interval_seconds: float = NVML_INTERVAL_SECONDS):
        self.interval_seconds = interval_seconds
        self.samples: list[dict] = []
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list = []
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            self.nvml = nvml
            if not self._handles:
                self.reason = "NVML reports no GPU"
        except Exception as error:  # ImportError, NVMLError_LibraryNotFound, driver not loaded
            self.nvml, self.reason = None, f"NVML unavailable ({type(error).__name__}: {error})".strip()

    @property
    def available(self) -> bool:
        return self.nvml is not None and bool(self._handles)

    def sample_once(self) -> None:
        nvml, now = self.nvml, time.perf_counter()
        for index, handle in enumerate(self._handles):
            self.samples.append({
                "t": now, "gpu": index,
                "kernel_time_percent": nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                "memory_used_bytes": nvml.nvmlDeviceGetMemoryInfo(handle).used,
                "power_watts": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            })

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as error:  # a reading failed mid-run: keep what was sampled
                self.reason = f"sampling stopped: {type(error).__name__}: {error}"
                return
            self._stop.wait(self.interval_seconds)

    def __enter__(self) -> "NvmlSampler":
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.available:
            return {"available": False, "reason": self.reason, "samples": 0}

        def stats(key):
            values = [s[key] for s in self.samples]
            return {"mean": statistics.fmean(values), "max": max(values)} if values else None

        return {"available": True, "samples": len(self.samples), "interval_seconds": self.interval_seconds,
                "kernel_time_percent": stats("kernel_time_percent"),
                "memory_used_bytes": stats("memory_used_bytes"), "power_watts": stats("power_watts"),
                "sm_clock_mhz": stats("sm_clock_mhz"), "reason": self.reason,
                "what": "NVML 'utilization.gpu': share of time at least one kernel ran; not efficiency "
                        "(see the roofline fractions)"}


# ----------------------------------------------------------------------------------------------
# Device helpers.


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_dtype(params, device: torch.device) -> str:
    """The profile's dtype on a GPU; fp32 on CPU (bf16 matmuls there are emulated and slow)."""
    return params["dtype"] if device.type == "cuda" else "fp32"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Free what earlier points left cached, then start a new high-water mark."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measured_peak_bytes(device: torch.device) -> int | None:
    """Peak reserved by PyTorch + memory outside its allocator (the CUDA context), as the planner
    counts; None on CPU (no resettable high-water mark)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.max_memory_reserved(device) + total - free - torch.cuda.memory_reserved(device)


# ----------------------------------------------------------------------------------------------
# Generation sweep.


@dataclasses.dataclass
class GenerationSetup:
    model: object
    description: str
    model_name: str
    settings: generate.DecodingSettings
    prompts: list[generate.Prompt]
    device: torch.device
    dtype: str


def generation_setup(params, device: torch.device | None = None) -> GenerationSetup:
    from workbook import finder, generate_bench
    device = device or bench_device()
    name = params["bench_generate_model"]
    dtype = run_dtype(params, device)
    model, described = finder.load_probe_model(name, dtype, device)
    eos_ids = generate.eos_token_ids(model, None)
    pad = generate.pad_token_id(model, None, eos_ids)
    new_tokens = params["bench_max_new_tokens"]
    settings = generate.DecodingSettings(new_tokens, eos_ids, pad, min_new_tokens=new_tokens)
    longest = params["prompt_len"]
    context = generate.context_length(model)
    if context and longest + new_tokens > context:
        raise BenchError(f"prompt_len {longest} + bench_max_new_tokens {new_tokens} exceed {name}'s context of "
                         f"{context} tokens; lower one of them")
    prompts = generate_bench.mixed_prompts(model.config.vocab_size, params["bench_examples"],
                                           (max(1, longest // 4), longest), new_tokens)
    return GenerationSetup(model, described, name, settings, prompts, device, dtype)


def planner_batch(params, setup: GenerationSetup) -> dict:
    """The planner's largest batch for the sweep's worst case (its longest prompt plus every new
    token) on the profile, and the batch the sweep can form: no larger than its prompts."""
    largest = planning.plan(params, mode="generate", model=setup.model_name, batch_size=AUTO, dtype=setup.dtype,
                            prompt_len=max(len(p.token_ids) for p in setup.prompts),
                            max_new_tokens=setup.settings.max_new_tokens).max_batch_size
    if largest == 0:
        raise BenchError(f"bench_batch_sizes has 'auto' but {setup.model_name} does not fit the {params['profile']} "
                         "profile even at batch 1 (workbook plan says what to change); give batch sizes instead")
    return {"planned": largest, "batch_size": min(largest, len(setup.prompts)),
            "note": f"the planner's largest batch on {params['profile']}: {largest}"
                    + (f", capped at the {len(setup.prompts)} prompts of the sweep (raise bench_examples to run it)"
                       if largest > len(setup.prompts) else "")}


def _points(params, device: torch.device, planned: dict | None = None) -> list[dict]:
    """(strategy, batch size, sort, backend name) of every point, with a skip reason where one applies.
    ``planned``: ``planner_batch``'s answer, which an 'auto' batch size stands for."""
    auto = planned["batch_size"] if planned else None
    batch_sizes = list(dict.fromkeys(parse_int_list(params["bench_batch_sizes"], "bench_batch_sizes", auto)))
    points = []
    for strategy in parse_strategies(params["bench_strategies"]):
        if strategy == "seed-before":
            points.append({"strategy": strategy, "batch_size": 1, "backend": "static", "sort": False})
        elif strategy == "seed-after":
            points.append({"strategy": strategy, "batch_size": SEED_BATCH_SIZE, "backend": "static", "sort": False})
        else:
            backend = {"static-sorted": "static"}.get(strategy, strategy)
            for batch in batch_sizes:
                point = {"strategy": strategy, "batch_size": batch, "backend": backend, "sort": True}
                if batch == auto:
                    point["planner_batch"] = planned["note"]
                if strategy == "static-compiled" and device.type != "cuda":
                    point["skipped"] = ("skipped on CPU: torch.compile compiles again for every batch size "
                                        "(minutes) for seconds of decoding; measured on a GPU session")
                points.append(point)
    return points


def _run_strategy(setup: GenerationSetup, backend, sort: bool) -> dict:
    """One pass over every prompt; completions kept (for the equality check) and the first result's time."""
    completions: dict[int, list[int]] = {}
    began = time.perf_counter()
    first: list[float] = []

    def write(outcome: generate.Outcome) -> None:
        if not first and outcome.completed:
            synchronize(setup.device)
            first.append(time.perf_counter() - began)
        for prompt, completion in outcome.completed:
            completions[prompt.index] = completion

    batches = generate.run_batches(backend, setup.prompts, write=write, sort_by_length=sort, log=lambda line: None)
    synchronize(setup.device)
    seconds = time.perf_counter() - began
    summary = generate.summarize(batches, seconds)
    summary["time_to_first_result_seconds"] = first[0] if first else None
    summary["completions"] = completions
    return summary


def generation_point(setup: GenerationSetup, params, point: dict, repeats: int,
                     log: Callable[[str], None] = print) -> dict:
    """Warm up, then time ``repeats`` passes of one strategy at one batch size."""
    result = dict(point)
    if point.get("skipped"):
        return result
    batch = point["batch_size"]
    dtype = setup.dtype
    backend = generate.make_backend(point["backend"], setup.model, setup.settings, batch)
    reset_peak_memory(setup.device)
    ordered = generate.sort_longest_first(setup.prompts) if point["sort"] else setup.prompts
    generate.generate_with_split(backend, ordered[:backend.prompts_per_call], log=lambda line: None)  # warm-up
    runs = []
    with NvmlSampler() as sampler:
        for repeat in range(repeats):
            runs.append(_run_strategy(setup, backend, point["sort"]))
            log(f"{point['strategy']} batch {batch}: run {repeat + 1}/{repeats}: {runs[-1]['seconds']:.2f} s, "
                f"{runs[-1]['output_tokens_per_second']} output tokens/s")
    seconds = [run["seconds"] for run in runs]
    median_run = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
    tokens = median_run["output_tokens"]
    tokens_per_second = [run["output_tokens"] / run["seconds"] for run in runs]
    mean_context = statistics.fmean(len(p.token_ids) for p in setup.prompts) + setup.settings.max_new_tokens / 2
    cost = decode_step_cost(setup.model.config, dtype, batch, round(mean_context))
    peak = peak_tflops(params, dtype)
    bandwidth = params["memory_bandwidth_gbs"]
    achieved = statistics.median(tokens_per_second)
    longest_prompt = max(len(p.token_ids) for p in setup.prompts)
    try:
        predicted = planning.plan(params, mode="generate", model=setup.model_name, batch_size=batch,
                                  prompt_len=longest_prompt, max_new_tokens=setup.settings.max_new_tokens,
                                  dtype=dtype).total_bytes
    except ValueError as error:
        predicted = None
        result["prediction_error"] = str(error)
    peak_bytes = measured_peak_bytes(setup.device)
    result.update(
        examples=median_run["generated"], failed=median_run["failed"], output_tokens=tokens,
        seconds=spread(seconds),
        output_tokens_per_second=spread(tokens_per_second),
        examples_per_minute=60 * median_run["generated"] / median_run["seconds"],
        time_to_first_result_seconds=median_run["time_to_first_result_seconds"],
        padding_waste=median_run["padding_waste"],
        peak_memory_bytes=peak_bytes, peak_memory_note=NOT_MEASURED + " (CPU: no resettable high-water mark)"
        if peak_bytes is None else "torch.cuda.max_memory_reserved + memory outside PyTorch's allocator",
        predicted_peak_bytes=predicted,
        decode_step={"bytes_read": cost.bytes_read, "flops": cost.flops, "context_tokens": round(mean_context)},
        roofline_tokens_per_second=roofline_tokens_per_second(cost, batch, bandwidth, peak),
        fraction_of_peak=fractions_of_peak(achieved, cost, batch, bandwidth, peak),
        cost=cost_figures(median_run["seconds"], median_run["generated"], tokens, params["usd_per_gpu_hour"]),
        nvml=sampler.summary(),
        # transformers' continuous batching ignores min_new_tokens (measured): its rows may end at
        # end of sequence, so it is counted rather than assumed.
        full_length_outputs=sum(len(completion.token_ids) == setup.settings.max_new_tokens
                                for completion in median_run["completions"].values()),
        ended_at_eos=sum(completion.finish_reason == "eos" for completion in median_run["completions"].values()),
        completions=median_run["completions"],
    )
    return result


def same_greedy_tokens(candidate: generate.Completion | None, reference: generate.Completion) -> bool:
    """Whether ``candidate`` is the reference's greedy output. The reference ran under min_new_tokens
    (EOS masked until the full length); continuous batching ignores it, so a candidate that ended at
    EOS is compared up to its EOS: before that step both took the same argmax."""
    if candidate is None:
        return False
    if candidate.finish_reason == "eos" and reference.finish_reason != "eos":
        body = candidate.token_ids[:-1]
        return reference.token_ids[:len(body)] == body
    return candidate.token_ids == reference.token_ids


def generation_sweep(params, log: Callable[[str], None] = print, setup: GenerationSetup | None = None) -> dict:
    setup = setup or generation_setup(params)
    repeats = params["bench_repeats"]
    planned = planner_batch(params, setup) if AUTO in str(params["bench_batch_sizes"]) else None
    points = [generation_point(setup, params, point, repeats, log) for point in _points(params, setup.device, planned)]
    # Greedy decoding: every strategy must give the tokens one-at-a-time generation gives.
    reference = next((p["completions"] for p in points if p["strategy"] == "seed-before" and "completions" in p), None)
    baseline = next((p for p in points if p["strategy"] == BASELINE and "seconds" in p), None)
    for point in points:
        completions = point.pop("completions", None)
        if completions is not None and reference is not None:
            point["identical_to_one_at_a_time"] = sum(
                same_greedy_tokens(completions.get(i), completion) for i, completion in reference.items())
        if baseline is not None and "output_tokens_per_second" in point:
            point["speedup_over_seed_after"] = (point["output_tokens_per_second"]["median"]
                                                / baseline["output_tokens_per_second"]["median"])
    lengths = [len(p.token_ids) for p in setup.prompts]
    return {"model": setup.description, "model_name": setup.model_name, "device": str(setup.device),
            "dtype": setup.dtype,
            "examples": len(setup.prompts), "prompt_tokens_min_max": [min(lengths), max(lengths)],
            "max_new_tokens": setup.settings.max_new_tokens, "repeats": repeats,
            "forced_full_length": "min_new_tokens = max_new_tokens; each point's full_length_outputs says how many "
                                  "ran to it (continuous batching ignores min_new_tokens)",
            "baseline": BASELINE, "planner_batch": planned, "points": points}


# ----------------------------------------------------------------------------------------------
# Training sweep.


def training_points(params, device: torch.device) -> list[dict]:
    """One factor at a time around each micro-batch: the plain point, then checkpointing, compile and
    length grouping instead of packing (a full grid would cost 8 runs per micro-batch)."""
    points = []
    for micro in parse_int_list(params["bench_train_micro_batches"], "bench_train_micro_batches"):
        base = {"micro_batch_size": micro, "grad_checkpointing": False, "torch_compile": False, "padding": "packing"}
        for change in ({}, {"grad_checkpointing": True}, {"torch_compile": True}, {"padding": "length_grouped"}):
            point = {**base, **change}
            if point["torch_compile"] and device.type != "cuda":
                point["skipped"] = ("skipped on CPU: compiling takes longer than the whole CPU sweep; "
                                    "measured on a GPU session")
            points.append(point)
    return points


def training_point(params, point: dict, work_dir: Path, log: Callable[[str], None] = print) -> dict:
    from workbook import train
    result = dict(point)
    if point.get("skipped"):
        return result
    device = bench_device()
    model = params["bench_train_model"]
    preset = train.is_preset_model(model)
    steps = params["bench_train_steps"]
    output_dir = Path(tempfile.mkdtemp(dir=work_dir, prefix="train-"))
    config = train.TrainConfig(
        model=model, data_path="", data_description="the shipped arithmetic sample" if not preset else "synthetic",
        output_dir=str(output_dir), use_chat_template=not preset,
        max_seq_length=params["seq_len"] if preset else "auto", padding=point["padding"], validation_fraction=0.0,
        micro_batch_size=point["micro_batch_size"], max_steps=steps, warmup_steps=0,
        dtype=run_dtype(params, device), tf32=device.type == "cuda",
        grad_checkpointing=point["grad_checkpointing"], torch_compile=point["torch_compile"],
        lora_rank=params["lora_rank"], profile=params["profile"], peak_bf16_tflops=params["peak_bf16_tflops"],
        peak_fp16_tflops=params["peak_fp16_tflops"], usd_per_gpu_hour=params["usd_per_gpu_hour"],
        plan_settings={key: params[key] for key in ("gpu_count", "gpu_memory_gib", "cuda_overhead_gib",
                                                   "safety_margin")},
        synthetic_examples=max(64, point["micro_batch_size"] * steps + 8))
    try:
        with NvmlSampler() as sampler:
            measured = train.train(config)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    throughput, memory_figures = measured["throughput"], measured["memory"]
    tokens_per_second = throughput["tokens_per_second"]
    result.update(
        steps=measured["steps"]["reached"], timed_steps=max(0, measured["steps"]["reached"] - train.TIMING_WARMUP_STEPS),
        max_seq_length=measured["data"]["max_seq_length"] if "max_seq_length" in measured["data"] else None,
        tokens_per_second=tokens_per_second, achieved_tflops=throughput["achieved_tflops"],
        mfu=throughput["mfu"], mfu_note=throughput["mfu_note"],
        peak_memory_bytes=memory_figures["measured"].get("peak_bytes"),
        peak_memory_note=memory_figures["measured"].get("note"),
        predicted_peak_bytes=memory_figures["predicted_peak_bytes"],
        padding_fraction=measured["plan"]["padding_fraction"],
        cost=cost_figures(1e6 / tokens_per_second if tokens_per_second else 0, 0, 1_000_000,
                          params["usd_per_gpu_hour"], max(1, measured["time"]["gpus"])),
        nvml=sampler.summary(), model=measured["model_description"],
    )
    result["cost"].pop("usd_per_1000_examples", None)
    log(f"train micro-batch {point['micro_batch_size']}, checkpointing {point['grad_checkpointing']}, "
        f"{point['padding']}: {tokens_per_second or 0:,.0f} tokens/s")
    return result


def training_sweep(params, work_dir: Path, log: Callable[[str], None] = print) -> dict:
    from workbook import train
    device = bench_device()
    points = [training_point(params, point, work_dir, log) for point in training_points(params, device)]
    return {"model": params["bench_train_model"], "lora_rank": params["lora_rank"], "device": str(device),
            "steps_per_point": params["bench_train_steps"],
            "repeats": 1, "what": f"tokens/s over the steps after the first {train.TIMING_WARMUP_STEPS} (warm-up) "
            "of each point, one run per point", "points": points}


# ----------------------------------------------------------------------------------------------
# Seed claims, beside this run's figures.


def tf32_matmul_speedup(device: torch.device, size: int = 8192, repeats: int = 10) -> dict | None:
    """fp32 matmul TFLOP/s with TF32 off and on, and bf16, on a GPU; None on CPU (no TF32)."""
    if device.type != "cuda":
        return None
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    previous = torch.backends.cuda.matmul.allow_tf32
    figures = {}
    try:
        for label, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                   ("bf16", torch.bfloat16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            x, y = a.to(dtype), b.to(dtype)
            torch.matmul(x, y)
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            for _ in range(repeats):
                torch.matmul(x, y)
            torch.cuda.synchronize(device)
            figures[label] = 2 * size ** 3 * repeats / (time.perf_counter() - began) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return {"tflops": figures, "tf32_over_fp32": figures["tf32"] / figures["fp32"],
            "bf16_over_tf32": figures["bf16"] / figures["tf32"]}


def _point(points: list[dict], strategy: str, batch: int | None = None) -> dict | None:
    for point in points:
        if point["strategy"] == strategy and "seconds" in point and (batch is None or point["batch_size"] == batch):
            return point
    return None


def claims_table(generation: dict | None, training: dict | None, matmul: dict | None, on_gpu: bool) -> list[dict]:
    """Each claim of ../shared/seeds/README.md beside this run's figure, or why there is none."""
    points = generation["points"] if generation else []
    before, after = _point(points, "seed-before"), _point(points, BASELINE)
    timed = [p for p in points if "seconds" in p]
    big_model = bool(generation) and "8B" in generation["model_name"].upper()
    rows = []

    equal = [p for p in timed if "identical_to_one_at_a_time" in p]
    rows.append({"seed": "000", "claim": "slice each output at its count of non-pad prompt tokens",
                 "measured": (f"engine slices at the padded prompt length; {sum(p['identical_to_one_at_a_time'] for p in equal)}"
                              f" of {sum(p['examples'] for p in equal)} outputs over {len(equal)} points identical to "
                              "one-at-a-time generation (an output continuous batching ended at EOS is compared up to "
                              "it: that backend ignores min_new_tokens)") if equal else "not measured in this run (needs seed-before)"})

    if after:
        figure = (f"{after['examples_per_minute']:.0f} examples/min at batch 32, "
                  f"{generation['max_new_tokens']} new tokens each ({generation['model']})")
        rows.append({"seed": "000", "claim": "~300-400 examples/minute, 8B model, batch 32, 2048 new tokens",
                     "measured": figure if (on_gpu and big_model) else
                     f"not measurable on this hardware (no GPU / not an 8B model); here: {figure}"})
    else:
        rows.append({"seed": "000", "claim": "~300-400 examples/minute, 8B model, batch 32, 2048 new tokens",
                     "measured": "not measured in this run (needs seed-after)"})

    rows.append({"seed": "003", "claim": "TF32 gives 8x faster matrix ops",
                 "measured": (f"fp32 matmul: TF32 {matmul['tf32_over_fp32']:.1f}x over plain fp32; bf16 a further "
                              f"{matmul['bf16_over_tf32']:.1f}x (TF32 changes fp32 matmuls only)") if matmul else
                 "not measurable on this hardware (no TF32 on CPU); bf16 autocast matmuls do not use TF32"})
    rows.append({"seed": "003", "claim": "2-3x speedup from library upgrades",
                 "measured": "not measurable in one run (one software version; compare runs across versions in notebook 05)"})

    kernel = [p["nvml"]["kernel_time_percent"]["mean"] for p in timed
              if p.get("nvml", {}).get("available") and p["nvml"].get("kernel_time_percent")]
    fractions = [p["fraction_of_peak"]["bandwidth"] for p in timed if p["fraction_of_peak"]["bandwidth"] is not None]
    rows.append({"seed": "000/002", "claim": "GPU utilization 85-95% (nvidia-smi)",
                 "measured": (f"NVML kernel time {min(kernel):.0f}-{max(kernel):.0f}% of the time while the points reached "
                              f"{min(fractions):.0%}-{max(fractions):.0%} of the bandwidth roofline")
                 if kernel and fractions else "not measurable on this hardware (no NVML / no bandwidth peak)"})

    measured_memory = [p for p in timed if p.get("peak_memory_bytes") and p.get("predicted_peak_bytes")]
    kv_8b = memory.kv_cache_bytes("Llama-3.1-8B", "bf16", batch_size=1, tokens=512 + 2048)
    rows.append({"seed": "000", "claim": "KV cache ~500MB per example (8B, 2048 new tokens)",
                 "measured": (f"counted from the Llama-3.1-8B config: {kv_8b / 1e6:.0f} MB per example at 512 prompt + "
                              "2048 new tokens (bf16): arithmetic, not hardware")})
    rows.append({"seed": "004/001", "claim": "memory figures per batch size; ~20GB per GPU with TP=4",
                 "measured": ("measured peak / planner: " + ", ".join(
                     f"{p['strategy']} b{p['batch_size']} {p['peak_memory_bytes'] / p['predicted_peak_bytes']:.2f}"
                     for p in measured_memory)) if measured_memory else
                 "not measurable on this hardware (CPU: no peak memory); planner predictions are in the points"})
    failed = sum(p["failed"] for p in timed)
    lost = sum(generation["examples"] - p["examples"] - p["failed"] for p in timed) if generation else 0
    rows.append({"seed": "000", "claim": "a failed batch counts all its examples as lost",
                 "measured": f"{lost} examples lost, {failed} failed alone, over {len(timed)} points" if timed
                 else "not measured in this run"})
    if training:
        mfus = [p["mfu"] for p in training["points"] if p.get("mfu") is not None]
        rows.append({"seed": "004", "claim": "bf16 + compile + flash attention make a 1B fine-tune fast",
                     "measured": f"MFU {min(mfus):.1%}-{max(mfus):.1%} over the training points" if mfus else
                     "not measurable on this hardware (no GPU peak: MFU n/a)"})
    return rows


def goals_table(generation: dict | None, training: dict | None) -> list[dict]:
    """The workbook's performance goals (issue 6) beside this run's figures: the best strategy at the
    planner's batch against the bandwidth roofline and the seeds' baseline, and the best MFU."""
    at_planner = [p for p in (generation or {}).get("points", []) if p.get("planner_batch") and "seconds" in p]
    best = max(at_planner, key=lambda p: p["output_tokens_per_second"]["median"], default=None)
    where = f" ({best['strategy']}, batch {best['batch_size']}; {best['planner_batch']})" if best else ""
    bandwidth = best and best["fraction_of_peak"]["bandwidth"]
    speedup = best and best.get("speedup_over_seed_after")
    mfus = [p["mfu"] for p in (training or {}).get("points", []) if p.get("mfu") is not None]

    def row(goal: str, value, target: float, text: str, missing: str) -> dict:
        if value is None:
            return {"goal": goal, "measured": missing, "met": NA}
        return {"goal": goal, "measured": text,
                "met": "yes" if value >= target else f"no: {value / target:.0%} of the goal"}

    no_auto = "not measured: bench_batch_sizes has no 'auto' point"
    return [row(GOALS[0], bandwidth, 0.60, f"{bandwidth or 0:.1%}{where}",
                no_auto if not best else "n/a: the profile has no bandwidth peak"),
            row(GOALS[1], speedup, 10.0, f"{speedup or 0:.1f}x{where}",
                no_auto if not best else "not measured: needs seed-after"),
            row(GOALS[2], max(mfus) if mfus else None, 0.45, f"{max(mfus or [0]):.1%} (best training point)",
                "n/a: no MFU (no GPU peak or no training sweep)")]


GOALS = ("best generation strategy at the planner's batch >= 60% of the bandwidth roofline",
         "best generation strategy at the planner's batch >= 10x the seeds' static batch 32",
         "training >= 45% MFU (the 1B full fine-tune on an H200)")


# ----------------------------------------------------------------------------------------------
# The whole benchmark.


def run_benchmark(params, work_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Both sweeps, the claims and the context (params, versions, hardware), as one JSON-ready dict."""
    from workbook import gpu
    missing = [key for key in PARAMS_USED if key not in params]
    if missing:
        raise BenchError(f"the benchmark needs parameter(s) {', '.join(missing)}; declare them in notebook 04's "
                         "parameters cell or add them to the params file")
    device = bench_device()
    began = time.perf_counter()
    generation = generation_sweep(params, log)
    reset_peak_memory(device)  # the generation model is gone: training measures its own memory only
    training = training_sweep(params, Path(work_dir), log) if params["bench_train_steps"] else None
    matmul = tf32_matmul_speedup(device)
    dtype = run_dtype(params, device)
    return {
        "what": "generation and training sweeps against the profile's bandwidth and compute peaks",
        "profile": params["profile"],
        "params": {key: params[key] for key in params},
        "peaks": {"memory_bandwidth_gbs": params["memory_bandwidth_gbs"], "dense_tflops": peak_tflops(params, dtype),
                  "dtype": dtype, "usd_per_gpu_hour": params["usd_per_gpu_hour"],
                  "note": "from the profile; 0 means none to measure against (n/a)"},
        "versions": gpu.software_versions(),
        "hardware": gpu.detect(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "generation": generation,
        "training": training,
        "matmul": matmul,
        "claims": claims_table(generation, training, matmul, device.type == "cuda"),
        "goals": goals_table(generation, training),
        "seconds": time.perf_counter() - began,
    }


# ----------------------------------------------------------------------------------------------
# Tables for the notebook and the CLI.


def _format(value, pattern: str = "{:,.1f}", missing: str = NA) -> str:
    return missing if value is None else pattern.format(value)


def generation_rows(report: dict) -> list[dict]:
    from workbook.units import format_bytes
    rows = []
    for p in report["generation"]["points"]:
        batch = f"{p['batch_size']}" + (" (planner)" if p.get("planner_batch") else "")
        if p.get("skipped"):
            rows.append({"strategy": p["strategy"], "batch": batch, "output tok/s (median, min-max)": p["skipped"]})
            continue
        tps = p["output_tokens_per_second"]
        rows.append({
            "strategy": p["strategy"], "batch": batch,
            "output tok/s (median, min-max)": f"{tps['median']:,.1f} ({tps['min']:,.1f}-{tps['max']:,.1f})",
            "examples/min": f"{p['examples_per_minute']:,.1f}",
            "first result s": _format(p["time_to_first_result_seconds"], "{:.3f}"),
            "padding waste": _format(p["padding_waste"], "{:.1%}"),
            "peak memory": format_bytes(p["peak_memory_bytes"]) if p["peak_memory_bytes"] else NOT_MEASURED,
            "planner": format_bytes(p["predicted_peak_bytes"]) if p["predicted_peak_bytes"] else NA,
            "of bandwidth roofline": _format(p["fraction_of_peak"]["bandwidth"], "{:.1%}"),
            "of compute peak": _format(p["fraction_of_peak"]["compute"], "{:.2%}"),
            "speedup vs seed-after": _format(p.get("speedup_over_seed_after"), "{:.2f}x"),
            "$ / 1k examples": _format(p["cost"]["usd_per_1000_examples"], "${:.4f}"),
        })
    return rows


def training_rows(report: dict) -> list[dict]:
    from workbook.units import format_bytes
    rows = []
    for p in (report["training"] or {}).get("points", []):
        row = {"micro-batch": p["micro_batch_size"], "checkpointing": p["grad_checkpointing"],
               "compile": p["torch_compile"], "padding": p["padding"]}
        if p.get("skipped"):
            rows.append({**row, "tokens/s": p["skipped"]})
            continue
        rows.append({**row, "tokens/s": _format(p["tokens_per_second"], "{:,.0f}"),
                     "MFU": _format(p["mfu"], "{:.1%}", missing=p["mfu_note"]),
                     "peak memory": format_bytes(p["peak_memory_bytes"]) if p["peak_memory_bytes"] else NOT_MEASURED,
                     "planner": format_bytes(p["predicted_peak_bytes"]) if p["predicted_peak_bytes"] else NA,
                     "$ / M tokens": _format(p["cost"]["usd_per_million_tokens"], "${:.3f}")})
    return rows


def nvml_rows(report: dict) -> list[dict]:
    rows = []
    for p in report["generation"]["points"] + (report["training"] or {}).get("points", []):
        if "nvml" not in p:
            continue
        nvml = p["nvml"]
        label = p.get("strategy", "train") + f" b{p.get('batch_size', p.get('micro_batch_size'))}"
        if not nvml["available"]:
            rows.append({"point": label, "kernel running (% of time)": nvml["reason"]})
            continue
        rows.append({"point": label,
                     "kernel running (% of time)": _format(nvml["kernel_time_percent"]["mean"], "{:.0f}"),
                     "memory used": _format(nvml["memory_used_bytes"]["max"] / 2**30, "{:.1f} GiB"),
                     "power W": _format(nvml["power_watts"]["mean"], "{:.0f}"),
                     "SM clock MHz": _format(nvml["sm_clock_mhz"]["mean"], "{:.0f}")})
    return rows


# ----------------------------------------------------------------------------------------------
# Command line: `workbook bench --params FILE [--set key=value ...]`.


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """Run the benchmark into a new run folder: benchmark.json, the PNGs and benchmark.md."""
    import json
    import sys

    from workbook import notebook, params as params_module, runner

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        params = runner.resolve_params(params_arg, overrides, log=say)[0]
        run_dir = notebook.new_run_dir(f"bench-{params['profile']}")
        report = run_benchmark(params, run_dir, log=say)
    except (params_module.ParamsError, BenchError, generate.GenerationError, memory.DoesNotFitError) as error:
        say(f"error: {error}")
        return 2
    report["command"] = "workbook bench --params " + params_arg + (" --set " + " ".join(overrides) if overrides else "")
    (run_dir / "benchmark.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    from workbook import plots  # matplotlib only for the figures
    capacity = int(params["gpu_memory_gib"] * 2**30) if params["gpu_count"] else None
    for name, figure in plots.benchmark_figures(report, capacity).items():
        figure.savefig(run_dir / name, dpi=120, bbox_inches="tight")
    text = "\n\n".join(f"## {title}\n\n{notebook.markdown_table(rows)}" for title, rows in (
        ("Generation", generation_rows(report)), ("Training", training_rows(report)),
        ("Seed claims", report["claims"]), ("Goals", report["goals"]), ("NVML (share of time a kernel ran, not efficiency)", nvml_rows(report))))
    (run_dir / "benchmark.md").write_text(f"`{report['command']}`\n\n{text}\n")
    print(text)
    print(f"wrote {run_dir / 'benchmark.json'}, {run_dir / 'benchmark.md'} and the PNGs")
    return 0
