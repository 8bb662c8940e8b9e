"""The generation sweep: every strategy on the same prompts, each point warmed up, synchronized and
repeated, against the pass's roofline (``counting.pass_cost``: prefill at the compute peak, decode at the
bandwidth) and the peaks, with peak memory beside the planner.

Prompts are random token ids, lengths uniform in [prompt_len / 4, prompt_len], every output forced to
``bench_max_new_tokens`` so padding comes from the prompts and the batch's longest output alone:

- ``seed-before``: one prompt at a time (seeds 000/002 before their change);
- ``seed-after``: static batches of 32 in file order, eager (the seeds' "after"; the baseline that
  speedups are quoted against);
- ``static-sorted``: static batches sorted longest first (the job's default), per batch size;
- ``static-compiled``: static KV cache + torch.compile, per batch size (skipped on CPU: it compiles
  again for every batch size, minutes of compiling for seconds of decoding);
- ``continuous``: transformers' continuous batching, per batch size;
- ``hf-pipeline``: Hugging Face's ``pipeline("text-generation")`` on the same model, prompts and
  decoding, per batch size (``hf_pipeline``): not ours, the tool users know, measured beside ours;
  each of its points carries the workbook's best at that batch size over it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable

import torch
from accelerate.utils.memory import should_reduce_batch_size

from workbook import ceilings, decoding, generation, gpu, models, runtime
from workbook.bench import hf_pipeline
from workbook.bench.budget import NO_BUDGET, TimeBudget
from workbook.bench.counting import (
    BASELINE, HF_PIPELINE, NOT_MEASURED, SEED_BATCH_SIZE, BenchError, cost_figures, parse_int_list, parse_strategies,
    noise_note, pass_cost, pass_figures, run_dtype, spread,
)
from workbook.bench.sampler import NvmlSampler
from workbook.bench.settings import BenchSettings
from workbook.params import AUTO
from workbook.planner import profile


@dataclasses.dataclass
class GenerationSetup:
    model: object
    description: str
    model_name: str
    settings: generation.DecodingSettings
    prompts: list[generation.Prompt]
    device: torch.device
    dtype: str
    ceilings: dict | None = None  # this GPU's measured copy bandwidth and matmul (None on a CPU)


def generation_setup(settings: BenchSettings, device: torch.device | None = None) -> GenerationSetup:
    device = device or runtime.default_device()
    name = settings.bench_generate_model
    dtype = run_dtype(settings.dtype, device)
    # Before the model: the copy needs free memory. On a CPU the tiny model is overhead-bound, no roofline.
    measured = ceilings.measure(device).to_dict() if device.type == "cuda" else None
    loaded = models.load_model(name, dtype, device)
    model, described = loaded.model, loaded.description
    new_tokens = settings.bench_max_new_tokens
    forced = generation.DecodingSettings(new_tokens, decoding.eos_token_ids(model, None),
                                         decoding.pad_token_id(model, None), min_new_tokens=new_tokens)
    longest = settings.prompt_len
    context = decoding.context_length(model)
    if context and longest + new_tokens > context:
        raise BenchError(f"prompt_len {longest} + bench_max_new_tokens {new_tokens} exceed {name}'s context of "
                         f"{context} tokens; lower one of them")
    prompts = mixed_prompts(model.config.vocab_size, settings.bench_examples, (max(1, longest // 4), longest),
                            new_tokens)
    tokenizer = models.load_tokenizer(name)
    if tokenizer is not None:  # a real model: prompts its own tokenizer writes, so they survive a trip through text
        prompts = text_stable_prompts(tokenizer, prompts, longest)
    return GenerationSetup(model, described, name, forced, prompts, device, dtype, measured)


def text_stable_prompts(tokenizer, prompts: list[generation.Prompt], longest: int,
                        tries: int = 8) -> list[generation.Prompt]:
    """``prompts`` with ids the tokenizer gives back from their own text (at most ``longest`` each): each
    id moved onto one that is a whole character or more on its own, then decoded and encoded again until
    nothing changes. Random ids of a byte-level BPE rarely survive that trip (a lone continuation byte
    decodes to U+FFFD, neighbours merge), and a baseline that takes text (the pipeline) must run the very
    prompts the engine runs to be compared with it."""
    special = set(tokenizer.all_special_ids)
    whole = [token for token in range(len(tokenizer)) if token not in special
             and "\ufffd" not in tokenizer.decode([token], clean_up_tokenization_spaces=False)]
    stable = []
    for prompt in prompts:
        ids = [whole[token % len(whole)] for token in prompt.token_ids]
        for _ in range(tries):
            text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            again = tokenizer(text, add_special_tokens=False)["input_ids"][:longest] or ids[:1]
            if again == ids:
                break
            ids = again
        stable.append(dataclasses.replace(prompt, token_ids=ids))
    return stable


def mixed_prompts(vocab_size: int, count: int, lengths: tuple[int, int], max_new_tokens: int,
                  seed: int = 0) -> list[generation.Prompt]:
    """Random token ids (ids 4 and up: past the usual special tokens) of uniformly random lengths."""
    rng = random.Random(seed)
    return [generation.Prompt(i, [rng.randrange(4, vocab_size) for _ in range(rng.randint(*lengths))], max_new_tokens)
            for i in range(count)]


def planner_profile(settings: BenchSettings) -> dict:
    """The profile the planner's ``plan`` is asked with, for every plan of the sweep: the machine's memory
    and the attention the points run. One process on one GPU runs each point, so it plans one unsharded
    copy (tensor_parallel_size 1) with the static backend unless a point names its own."""
    return {**dataclasses.asdict(settings.hardware), "attn_implementation": settings.attn_implementation,
            "tensor_parallel_size": 1, "backend": "static"}


def planner_batch(settings: BenchSettings, setup: GenerationSetup) -> dict:
    """The planner's largest batch for the sweep's worst case (its longest prompt plus every new
    token) on the profile, and the batch the sweep can form: no larger than its prompts."""
    largest = profile.plan(planner_profile(settings), mode="generate", model=setup.model_name, batch_size=AUTO,
                           dtype=setup.dtype, prompt_len=max(len(p.token_ids) for p in setup.prompts),
                           max_new_tokens=setup.settings.max_new_tokens).max_batch_size
    name = settings.hardware.profile
    if largest == 0:
        raise BenchError(f"bench_batch_sizes has 'auto' but {setup.model_name} does not fit the {name} "
                         "profile even at batch 1 (workbook plan says what to change); give batch sizes instead")
    return {"planned": largest, "batch_size": min(largest, len(setup.prompts)),
            "note": f"the planner's largest batch on {name}: {largest}"
                    + (f", capped at the {len(setup.prompts)} prompts of the sweep (raise bench_examples to run it)"
                       if largest > len(setup.prompts) else "")}


def sweep_points(settings: BenchSettings, device: torch.device, planned: dict | None = None) -> list[dict]:
    """(strategy, batch size, sort, backend name) of every point, with a skip reason where one applies.
    ``planned``: ``planner_batch``'s answer, which an 'auto' batch size stands for."""
    auto = planned["batch_size"] if planned else None
    # A batch larger than the sweep's prompts runs them all in one batch: the same point as a batch of
    # exactly them (measured once, and labelled by the rows it holds).
    examples = settings.bench_examples
    batch_sizes = list(dict.fromkeys(min(batch, examples) for batch in
                                     parse_int_list(settings.bench_batch_sizes, "bench_batch_sizes", auto)))
    points = []
    for strategy in parse_strategies(settings.bench_strategies):
        if strategy == "seed-before":
            points.append({"strategy": strategy, "batch_size": 1, "backend": "static", "sort": False})
        elif strategy == "seed-after":
            points.append({"strategy": strategy, "batch_size": SEED_BATCH_SIZE, "backend": "static", "sort": False})
        else:
            # The pipeline's batch is one left-padded ``generate`` call: the static plan counts it.
            backend = {"static-sorted": "static", HF_PIPELINE: "static"}.get(strategy, strategy)
            for batch in batch_sizes:
                point = {"strategy": strategy, "batch_size": batch, "backend": backend,
                         "sort": strategy != HF_PIPELINE}  # the pipeline batches in input order
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
    starts = getattr(backend, "start_seconds", None)  # the continuous backend's manager starts, once a pass
    earlier = len(starts) if starts is not None else 0
    began = time.perf_counter()
    first: list[float] = []

    def write(outcome: generation.Outcome) -> None:
        if not first and outcome.completed:
            runtime.synchronize(setup.device)
            first.append(time.perf_counter() - began)
        for prompt, completion in outcome.completed:
            completions[prompt.index] = completion

    batches = generation.run_batches(backend, setup.prompts, write=write, sort_by_length=sort, log=lambda line: None)
    runtime.synchronize(setup.device)
    seconds = time.perf_counter() - began
    summary = generation.summarize(batches, seconds)
    summary["seconds"] = seconds  # unrounded: a GPU pass of ~10 ms is ±5% at 3 decimals, and tokens/s divide by it
    summary["time_to_first_result_seconds"] = first[0] if first else None
    summary["completions"] = completions
    # Inside the pass's seconds, as a job pays it once; recorded so a GPU's figure can be read without it.
    summary["manager_start_seconds"] = sum(starts[earlier:]) if starts is not None else None
    return summary


def _engine_pass(setup: GenerationSetup, point: dict) -> tuple[Callable[[], dict], dict]:
    """The workbook's backend for one point, warmed up on one batch: (one timed pass, no extra facts)."""
    backend = generation.make_backend(point["backend"], setup.model, setup.settings, point["batch_size"])
    ordered = generation.sort_longest_first(setup.prompts) if point["sort"] else setup.prompts
    warm_up = ordered[:backend.prompts_per_call]
    split = False
    try:
        backend.generate(warm_up)
    except Exception as error:
        # A broken path (a kernel, a compile) fails at every size: the engine's split would retry it ~2x the
        # batch times, each a new shape (a new compile), before giving up. Only out-of-memory is split,
        # once the failed batch's frames are gone.
        if not should_reduce_batch_size(getattr(error, "error", error)):  # a PartialFailure carries its cause
            raise
        split = True
    if split:
        generation.generate_with_split(backend, warm_up, log=lambda line: None)
    return (lambda: _run_strategy(setup, backend, point["sort"])), {}


def generation_point(setup: GenerationSetup, settings: BenchSettings, point: dict, repeats: int,
                     log: Callable[[str], None] = print) -> dict:
    """Warm up, then time ``repeats`` passes of one strategy at one batch size."""
    result = dict(point)
    if point.get("skipped"):
        return result
    batch = point["batch_size"]
    dtype = setup.dtype
    runtime.reset_peak_memory(setup.device)
    prepare = hf_pipeline.prepare if point["strategy"] == HF_PIPELINE else _engine_pass
    runs = []
    try:
        one_pass, facts = prepare(setup, point)
        result.update(facts)
        with NvmlSampler() as sampler:
            for repeat in range(repeats):
                runs.append(one_pass())
                log(f"{point['strategy']} batch {batch}: run {repeat + 1}/{repeats}: {runs[-1]['seconds']:.2f} s, "
                    f"{runs[-1]['output_tokens_per_second']} output tokens/s")
    except torch.cuda.OutOfMemoryError as error:
        if point["strategy"] != HF_PIPELINE:  # the engine splits a batch that does not fit; the pipeline cannot
            raise
        runtime.reset_peak_memory(setup.device)  # frees what the failed batch left cached, for the next point
        return {**result, "skipped": f"ran out of GPU memory at batch {batch} (the pipeline has no fallback; the "
                                     f"workbook's engine splits such a batch): {str(error)[:200]}"}
    seconds = [run["seconds"] for run in runs]
    median_run = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
    tokens = median_run["output_tokens"]
    tokens_per_second = [run["output_tokens"] / run["seconds"] for run in runs]
    rows = min(batch, len(setup.prompts))  # the batches the pass formed: a batch size above the prompts is not run
    lengths = [len(p.token_ids) for p in setup.prompts]
    # The roofline of the tokens the pass made: a row that ended at end of sequence (continuous batching
    # ignores min_new_tokens) is judged at its own length, and a continuous point refills its slots.
    made = median_run["completions"]
    ran = [p for p in setup.prompts if p.index in made]
    whole = pass_cost(setup.model.config, dtype, [len(p.token_ids) for p in ran], rows,
                      [len(made[p.index].token_ids) for p in ran], refill=point["backend"] == "continuous")
    try:
        predicted = profile.plan(planner_profile(settings), mode="generate", model=setup.model_name, batch_size=rows,
                                 prompt_len=max(lengths), max_new_tokens=setup.settings.max_new_tokens,
                                 dtype=dtype, backend=point["backend"]).total_bytes  # continuous: paged plan
    except ValueError as error:
        predicted = None
        result["prediction_error"] = str(error)
    measured = runtime.peak_memory(setup.device)
    peak_bytes = measured.total_bytes if measured else None
    hardware = settings.hardware
    result.update(
        examples=median_run["generated"], failed=median_run["failed"], output_tokens=tokens,
        seconds=spread(seconds),
        output_tokens_per_second=spread(tokens_per_second),
        examples_per_minute=60 * median_run["generated"] / median_run["seconds"],
        time_to_first_result_seconds=median_run["time_to_first_result_seconds"],
        manager_start_seconds=median_run.get("manager_start_seconds"),
        padding_waste=median_run["padding_waste"],
        peak_memory_bytes=peak_bytes, peak_memory_note=NOT_MEASURED + " (CPU: torch keeps no peak of tensor memory)"
        if peak_bytes is None else "torch.cuda.max_memory_reserved + memory outside PyTorch's allocator",
        predicted_peak_bytes=predicted,
        rows_per_batch=rows, pass_cost=dataclasses.asdict(whole),
        **pass_figures(whole, tokens, median_run["seconds"], hardware.memory_bandwidth_gbs,
                       gpu.dense_peak_tflops(hardware, dtype), setup.ceilings),
        cost=cost_figures(median_run["seconds"], median_run["generated"], tokens, hardware.usd_per_gpu_hour),
        nvml=sampler.summary(),
        # transformers' continuous batching ignores min_new_tokens (measured): its rows may end at
        # end of sequence, so it is counted rather than assumed.
        full_length_outputs=sum(len(completion.token_ids) == setup.settings.max_new_tokens
                                for completion in median_run["completions"].values()),
        ended_at_eos=sum(completion.finish_reason == "eos" for completion in median_run["completions"].values()),
        completions=median_run["completions"],
    )
    return result


def same_greedy_tokens(candidate: generation.Completion | None, reference: generation.Completion) -> bool:
    """Whether ``candidate`` is the reference's greedy output. The reference ran under min_new_tokens
    (EOS masked until the full length); continuous batching ignores it, so a candidate that ended at
    EOS is compared up to its EOS: before that step both took the same argmax."""
    if candidate is None:
        return False
    if candidate.finish_reason == "eos" and reference.finish_reason != "eos":
        body = candidate.token_ids[:-1]
        return reference.token_ids[:len(body)] == body
    return candidate.token_ids == reference.token_ids


def generation_sweep(settings: BenchSettings, log: Callable[[str], None] = print, setup: GenerationSetup | None = None,
                     on_point: Callable[[dict], None] = lambda point: None, budget: TimeBudget = NO_BUDGET) -> dict:
    """Every point of the sweep; ``on_point`` gets each as it is measured (its outputs left out), so a
    sweep stopped part way still leaves what it measured; the points ``budget`` leaves no time for are
    marked so."""
    setup = setup or generation_setup(settings)
    repeats = settings.bench_repeats
    planned = planner_batch(settings, setup) if AUTO in str(settings.bench_batch_sizes) else None
    points = []
    for point in sweep_points(settings, setup.device, planned):
        points.append(budget.measure(point, lambda: generation_point(setup, settings, point, repeats, log)))
        if point["strategy"] == "static-compiled" and not point.get("skipped"):
            # Its CUDA graphs keep their memory pool while the compiled step lives (on the model): the next
            # point would carry it in its peak memory. Dropped, as a fresh process would have none.
            torch._dynamo.reset()
        on_point({key: value for key, value in points[-1].items() if key != "completions"})
    # Greedy decoding: every strategy must give the tokens one-at-a-time generation gives.
    reference = next((p["completions"] for p in points if p["strategy"] == "seed-before" and "completions" in p), None)
    baseline = next((p for p in points if p["strategy"] == BASELINE and "seconds" in p), None)
    for point in points:
        completions = point.pop("completions", None)
        # hf-pipeline: only prompts it ran with the sweep's own ids can be compared.
        comparable = point.pop("comparable_prompts", None)
        if completions is not None and reference is not None:
            kept = reference.keys() if comparable is None else set(comparable)
            compared = {i: c for i, c in reference.items() if i in kept}
            point["identical_to_one_at_a_time"] = sum(
                same_greedy_tokens(completions.get(i), completion) for i, completion in compared.items())
            point["compared_with_one_at_a_time"] = len(compared)
        if baseline is not None and "output_tokens_per_second" in point:
            point["speedup_over_seed_after"] = (point["output_tokens_per_second"]["median"]
                                                / baseline["output_tokens_per_second"]["median"])
            # A ratio is as noisy as either of its medians: a busy machine slows one point's runs, not both.
            point["speedup_noise"] = next((f"{name}: {note}" for name, note in (
                (BASELINE, noise_note(baseline["output_tokens_per_second"]["runs"])),
                (point["strategy"], noise_note(point["output_tokens_per_second"]["runs"]))) if note), "")
    for point in points:
        if point["strategy"] == HF_PIPELINE and "output_tokens_per_second" in point:
            point["workbook_best_over_pipeline"] = hf_pipeline.best_workbook_ratio(point, points)
    lengths = [len(p.token_ids) for p in setup.prompts]
    return {"model": setup.description, "model_name": setup.model_name, "device": str(setup.device),
            "dtype": setup.dtype,
            "examples": len(setup.prompts), "prompt_tokens_min_max": [min(lengths), max(lengths)],
            "max_new_tokens": setup.settings.max_new_tokens, "repeats": repeats,
            "forced_full_length": "min_new_tokens = max_new_tokens; each point's full_length_outputs says how many "
                                  "ran to it (continuous batching ignores min_new_tokens)",
            "baseline": BASELINE, "planner_batch": planned, "points": points,
            "hf_pipeline": hf_pipeline.HOW if any(p["strategy"] == HF_PIPELINE for p in points) else None,
            "ceilings": setup.ceilings or "not measured: a CPU (the tiny model is bound by overheads, not bandwidth)"}
