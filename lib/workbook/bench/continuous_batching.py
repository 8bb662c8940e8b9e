"""Benchmark (not a test): static batches vs continuous batching on full-length and uneven outputs,
beside one direct call of transformers' continuous batching. Writes ``continuous_batching.json``
and ``continuous_batching.md``.

    workbook bench-continuous --out outputs/reference/cpu     # CPU, tiny model, minutes
    workbook bench-continuous --model Llama-3.1-8B --device cuda --dtype bf16 \\
        --examples 512 --max-new-tokens 1024 --memory-gib 40 --workloads uneven --repeats 1 \\
        --time-budget-seconds 330 --out outputs/reference/h100     # GPU: random bf16 weights, ~6 min

Workloads, on the same prompts (the shipped arithmetic prompts for the tiny model, else random
token ids of ``--prompt-tokens`` lengths), every output's length fixed in advance so that weights do
not matter (random weights on a GPU run the same):

- ``full``: every output ``--max-new-tokens`` long (the sweep's forced full length);
- ``uneven``: lengths drawn (seeded) from a lognormal with median ``max_new_tokens / 8`` and sigma
  1, capped at ``max_new_tokens``: most outputs end early, a few run to the cap, as teacher outputs do.

Static batches end a row by forcing end of sequence at its drawn length (a logits processor; end of
sequence is banned before it); the row then idles as padding until its batch's longest row ends.
transformers' continuous batching drops logits processors it does not support, so its requests end
instead at their own ``max_new_tokens`` (the drawn length), end of sequence disabled: the same
tokens are computed. Arms, each after a warm-up, repeated and interleaved (medians count):

- ``static-sorted``: the job's static path, length-sorted batches, records written per batch;
- ``continuous``: the job's continuous backend (one manager, each record written as it finishes);
- ``direct``: transformers alone with the same paged-cache sizing, nothing written: one
  ``generate_batch`` call (full), or the manager fed every request at once (uneven: generate_batch
  has one max_new_tokens for all).

``--memory-gib`` compares the arms at the same memory: each runs the largest batch its own plan fits
in that budget (static: ``planner.plan_generate``, dense cache; continuous and direct:
``planner.paged``), at most one per prompt; without it, every arm runs ``--batch-size``.

Peak memory on CPU is the process's resident memory, sampled every 10 ms, above its level before
the arm, beside the planner's terms beyond the weights; on a GPU the device's peak after a reset.
The roofline (``roofline``) is the least time an engine with the arm's batch always full needs for the
same tokens (``counting.pass_cost`` with refilled slots: prefill at the compute peak, decode at the
bandwidth), at the GPU spec table's peaks (or ``--bandwidth-gbs``, ``--peak-tflops``); each arm's
fraction of it is that time over its measured median.
``--time-budget-seconds`` stops the run in time: a repeat that would not fit is skipped, and at the
deadline the run stops, writes what it measured (``stopped`` says where) and exits with 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import LogitsProcessor

from workbook import decoding, generation, gpu, jsonl, models, notebook, runtime, tiny_model
from workbook.bench.budget import TimeBudget
from workbook.bench.counting import pass_cost
from workbook.bench.continuous_report import ARMS, markdown
from workbook.bench.engine_overhead import sample_prompts
from workbook.bench.generation_sweep import mixed_prompts
from workbook.generation.continuous import ContinuousBackend, stop_manager
from workbook.generation.engine import in_batches
from workbook.planner import plan_generate
from workbook.planner.paged import continuous_attention, plan_generate_paged

LOGNORMAL_SIGMA = 1.0
NO_END_OF_SEQUENCE = (-1,)  # transformers' continuous batching: -1 disables end of sequence
WARMUP_NEW_TOKENS = 8  # the warm-up compiles kernels and captures graphs; its length does not matter


def drawn_lengths(count: int, max_new_tokens: int, seed: int = 0) -> list[int]:
    """Output lengths of the uneven workload: lognormal, median max_new_tokens / 8, sigma 1, in [1, cap]."""
    rng = random.Random(seed)
    median = max(1.0, max_new_tokens / 8)
    return [min(max_new_tokens, max(1, round(rng.lognormvariate(math.log(median), LOGNORMAL_SIGMA))))
            for _ in range(count)]


class EndAtLength(LogitsProcessor):
    """Each row ends with end of sequence at its own length: every end id banned before (a model may
    end with any of them: end of text, end of turn), the first forced at it."""

    def __init__(self, prompt_width: int, lengths: list[int], eos_token_ids: tuple[int, ...]):
        self.prompt_width, self.eos_ids = prompt_width, torch.tensor(eos_token_ids)
        self.lengths, self.is_eos, self.is_first_eos = torch.tensor(lengths)[:, None], None, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # Selections by torch.where on the device: boolean indexing would wait for the GPU three times a
        # step, a cost the continuous arm (which ends each request by its own max_new_tokens) does not pay.
        if self.is_eos is None or self.is_eos.device != scores.device:
            self.lengths = self.lengths.to(scores.device)
            ids = torch.arange(scores.shape[-1], device=scores.device)
            self.is_eos = torch.isin(ids, self.eos_ids.to(scores.device))
            self.is_first_eos = ids == int(self.eos_ids[0])
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        forced, before = self.lengths == step + 1, self.lengths > step + 1
        banned = (forced & ~self.is_first_eos) | (before & self.is_eos)
        return torch.where(banned, -math.inf, torch.where(forced, 0.0, scores))


def end_processor_seconds(prompts, batch_size: int, vocab_size: int, device, eos_token_ids: tuple[int, ...],
                          calls: int = 50) -> float:
    """What EndAtLength adds to the static arm: the run's rows x decode steps (each batch runs to its
    longest output) at the cost per row of one call at the arm's batch and vocabulary, measured apart
    (``calls`` back to back, one synchronization: timing it inside the run would stall every step).
    The continuous arm ends requests by their own max_new_tokens and pays nothing like it."""
    batches = in_batches(generation.sort_longest_first(prompts), batch_size)
    row_steps = sum(len(batch) * max(p.max_new_tokens for p in batch) for batch in batches)
    rows = batches[0]
    processor = EndAtLength(1, [p.max_new_tokens for p in rows], eos_token_ids)
    ids = torch.zeros(len(rows), 2, dtype=torch.long, device=device)
    scores = torch.zeros(len(rows), vocab_size, device=device)  # generate's scores are fp32
    processor(ids, scores)  # first call: the lengths move to the device
    elapsed, _ = runtime.timed(device, lambda: [processor(ids, scores) for _ in range(calls)])
    return elapsed / calls / len(rows) * row_steps


def static_backend(model, settings, batch_size: int) -> generation.StaticBackend:
    backend = generation.StaticBackend(model, settings, batch_size)
    backend.logits_processors = lambda prompts: [EndAtLength(
        max(len(p.token_ids) for p in prompts), [p.max_new_tokens for p in prompts], settings.eos_token_ids)]
    return backend


class ResidentPeak:
    """Peak resident memory of this process above its level at the start, sampled every 10 ms."""

    def __enter__(self):
        self.process, self.stop = psutil.Process(), threading.Event()
        self.start_bytes = self.peak_bytes = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.01):
            self.peak_bytes = max(self.peak_bytes, self.process.memory_info().rss)

    def __exit__(self, *exc_info):
        self.stop.set()
        self.thread.join()
        self.increase_bytes = self.peak_bytes - self.start_bytes


def engine_arm(backend, prompts, folder: Path, device) -> dict:
    """The job's path: run_batches with records appended as the job appends them."""
    path = folder / f"arm-{time.perf_counter_ns()}.jsonl"
    first: list[float] = []
    starts = getattr(backend, "start_seconds", None)  # the continuous backend's manager starts
    earlier = len(starts) if starts is not None else 0
    with jsonl.LineAppender(path, getattr(backend, "fsync_every", None)) as appender:
        began = time.perf_counter()

        def write(outcome: generation.Outcome) -> None:
            if not first and outcome.completed:
                first.append(time.perf_counter() - began)
            appender.write({"index": prompt.index, "output_tokens": len(completion.token_ids)}
                           for prompt, completion in outcome.completed)

        batches = generation.run_batches(backend, prompts, write=write, log=lambda line: None)
        runtime.synchronize(device)
    path.unlink()
    summary = generation.summarize(batches, time.perf_counter() - began)
    return {"output_tokens": summary["output_tokens"], "padding_waste": summary["padding_waste"],
            "first_result_seconds": first[0] if first else None, "failed": summary["failed"],
            "start_seconds": sum(starts[earlier:]) if starts is not None else None}


def direct_arm(model, backend: ContinuousBackend, prompts, uneven: bool) -> dict:
    """transformers alone, sized as the backend sizes it; nothing written."""
    limit, new_tokens = backend.batch_size, max(p.max_new_tokens for p in prompts)
    longest = max(len(p.token_ids) for p in prompts)
    began = time.perf_counter()
    if not uneven:
        results = model.generate_batch([p.token_ids for p in prompts], progress_bar=False,
                                       **backend.manager_arguments(limit, longest, new_tokens, hints=False))
        outputs = [len(result.generated_tokens) for result in results.values()]
        return {"output_tokens": sum(outputs), "first_result_seconds": None, "failed": len(prompts) - len(outputs),
                "start_seconds": None}  # inside generate_batch: not separable
    manager = model.init_continuous_batching(**backend.manager_arguments(limit, longest, new_tokens))
    if callable(getattr(manager, "warmup", None)):
        manager.warmup()  # as generate_batch and the backend do: CUDA graphs captured before the first request
    manager.start()
    start_seconds = time.perf_counter() - began
    first, outputs = None, []
    try:
        for prompt in prompts:
            manager.add_request(prompt.token_ids, request_id=str(prompt.index), max_new_tokens=prompt.max_new_tokens)
        while len(outputs) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                break
            if result is not None and result.is_finished():
                first = first if first is not None else time.perf_counter() - began
                outputs.append(len(result.generated_tokens))
    finally:  # a time budget's end leaves requests in flight: stopped at once, not generated to their end
        stop_manager(manager, hard=len(outputs) < len(prompts))
    return {"output_tokens": sum(outputs), "first_result_seconds": first, "failed": len(prompts) - len(outputs),
            "start_seconds": start_seconds}


def arm_batch_sizes(config, dtype: str, prompts, batch_size: int, memory_gib: float | None) -> dict[str, int]:
    """Each arm's batch: ``batch_size``, or with ``memory_gib`` the largest its own plan fits in it."""
    if not memory_gib:
        return {arm: batch_size for arm in ARMS}
    lengths = {"prompt_len": max(len(p.token_ids) for p in prompts),
               "new_tokens": max(p.max_new_tokens for p in prompts)}
    budget = int(memory_gib * 2**30)
    static = plan_generate(config, batch_size=1, gpu_memory_bytes=budget, dtype=dtype, **lengths).max_batch_size
    paged = plan_generate_paged(config, batch_size=1, gpu_memory_bytes=budget, dtype=dtype,
                                attn_implementation=continuous_attention("sdpa"), **lengths).max_batch_size
    if not static or not paged:
        raise SystemExit(f"error: --memory-gib {memory_gib} does not fit batch 1 of this model and these lengths "
                         "(the planner says so); give more memory or shorter --max-new-tokens")
    return {"static-sorted": min(static, len(prompts)), "continuous": min(paged, len(prompts)),
            "direct": min(paged, len(prompts))}


def run_workload(name, model, prompts, eos_ids, pad, batch_sizes, repeats, folder, log, budget: TimeBudget,
                 peaks: tuple[float | None, float | None]) -> dict:
    device = model.device
    new_tokens = max(p.max_new_tokens for p in prompts)
    static = static_backend(model, generation.DecodingSettings(new_tokens, eos_ids, pad), batch_sizes["static-sorted"])
    continuous = ContinuousBackend(model, generation.DecodingSettings(new_tokens, NO_END_OF_SEQUENCE, pad),
                                   batch_sizes["continuous"])
    warmup = [generation.Prompt(p.index, p.token_ids, min(p.max_new_tokens, WARMUP_NEW_TOKENS))
              for p in generation.sort_longest_first(prompts)[:max(batch_sizes.values())]]
    static.generate(warmup[:batch_sizes["static-sorted"]])
    continuous.generate(warmup[:batch_sizes["continuous"]])
    seconds, starts = {arm: [] for arm in ARMS}, {arm: [] for arm in ARMS}
    details, memory, stopped = {}, {arm: 0 for arm in ARMS}, False
    try:
        for repeat in range(repeats):
            if repeat and not budget.fits(sum(max(values) for values in seconds.values())):
                log(f"{name}: repeat {repeat + 1}/{repeats} skipped: it would not end within the time budget")
                break
            for arm in ARMS:
                budget.check()
                runtime.reset_peak_memory(device)
                with ResidentPeak() as peak:
                    if arm == "direct":
                        elapsed, result = runtime.timed(device, lambda: direct_arm(model, continuous, prompts, name == "uneven"))
                    else:
                        elapsed, result = runtime.timed(device, lambda: engine_arm(
                            static if arm == "static-sorted" else continuous, prompts, folder, device))
                seconds[arm].append(elapsed)
                starts[arm].append(result["start_seconds"] or 0.0)
                details[arm] = result
                on_device = runtime.peak_memory(device)  # a GPU: its whole peak, weights included
                memory[arm] = max(memory[arm], on_device.total_bytes if on_device else peak.increase_bytes)
                log(f"{name}: {arm} run {repeat + 1}/{repeats}: {elapsed:.2f} s, {result['output_tokens']} output tokens")
    except KeyboardInterrupt:
        if not (budget.expired and details):
            raise
        stopped = True  # the time budget ended inside an arm: the arms it finished are the result
    arms = [arm for arm in ARMS if seconds[arm]]
    median = {arm: statistics.median(seconds[arm]) for arm in arms}
    processor = (end_processor_seconds(prompts, batch_sizes["static-sorted"], model.config.vocab_size, device,
                                       tuple(eos_ids)) if "static-sorted" in arms else None)
    lengths = [p.max_new_tokens for p in prompts]
    longest_prompt = max(len(p.token_ids) for p in prompts)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model.dtype]
    config = model.config
    planned = {}
    for arm, plan, attention in (("static-sorted", plan_generate, "sdpa"),
                                 ("continuous", plan_generate_paged, continuous_attention("sdpa"))):
        made = plan(config, batch_size=batch_sizes[arm], prompt_len=longest_prompt, new_tokens=new_tokens,
                    gpu_memory_bytes=psutil.virtual_memory().total, dtype=dtype, overhead_bytes=0,
                    fragmentation_fraction=0.0, attn_implementation=attention)
        planned[arm] = made.total_bytes - (made.weights_bytes if device.type == "cpu" else 0)
    # Each arm beside the least time an engine with its batch always full needs for the same tokens.
    prompt_lengths = [len(p.token_ids) for p in prompts]
    roofline = {arm: pass_cost(config, dtype, prompt_lengths, batch_sizes[arm], lengths, refill=True
                               ).roofline_seconds(*peaks) for arm in arms}
    return {
        "workload": name,
        "examples": len(prompts),
        "output_tokens_min_median_max": [min(lengths), statistics.median(lengths), max(lengths)],
        "arms": arms,  # those measured: a time budget that ran out inside an arm leaves it out
        "stopped_by_budget": stopped,
        "output_tokens": {arm: details[arm]["output_tokens"] for arm in arms},
        "batch_size": batch_sizes,
        "repeats_done": min(len(seconds[arm]) for arm in arms),
        "seconds": {arm: seconds[arm] for arm in arms},
        "median_seconds": {arm: round(value, 3) for arm, value in median.items()},
        "output_tokens_per_second": {arm: round(details[arm]["output_tokens"] / median[arm], 1) for arm in arms},
        "padding_waste": details["static-sorted"]["padding_waste"],
        "first_result_seconds": {arm: details[arm]["first_result_seconds"] for arm in arms},
        "continuous_vs_static": _ratio(median, "static-sorted", "continuous"),
        "continuous_vs_direct": _ratio(median, "direct", "continuous"),
        # The manager's start (paged cache, CUDA graphs) is paid once per job: a long job amortizes it.
        "manager_start_seconds": {arm: None if details[arm]["start_seconds"] is None else statistics.median(starts[arm])
                                  for arm in arms},
        "continuous_vs_static_after_start": _ratio(  # each repeat less its own start, then the median
            {arm: statistics.median(s - start for s, start in zip(seconds[arm], starts[arm])) for arm in arms},
            "static-sorted", "continuous"),
        # The static arm's end-at-length processor is the workload's, not the engine's: its cost apart.
        "static_end_processor_seconds": processor and float(f"{processor:.3g}"),
        "continuous_vs_static_without_processor": processor and _ratio(
            {**median, "static-sorted": median["static-sorted"] - processor}, "static-sorted", "continuous"),
        "failed": {arm: details[arm]["failed"] for arm in arms},
        "peak_memory_bytes": {arm: memory[arm] for arm in arms},
        "planned_bytes": planned,
        "roofline_seconds": {arm: r and {phase: float(f"{value:.3g}") for phase, value in r.items()}
                             for arm, r in roofline.items()},
        "roofline_fraction": {arm: r and float(f"{r['total'] / median[arm]:.3g}") for arm, r in roofline.items()},
        "paged_layout": vars(continuous.layout) if continuous.layout else None,
        "continuous_attention": continuous.attention,
    }


def _ratio(median: dict, slower: str, faster: str) -> float | None:
    """How many times faster ``faster`` ran than ``slower``; None when either was not measured."""
    return round(median[slower] / median[faster], 3) if slower in median and faster in median else None


def roofline_peaks(device: torch.device, dtype: str, bandwidth_gbs: float | None, peak_tflops: float | None
                   ) -> tuple[tuple[float | None, float | None], str]:
    """(bandwidth GB/s, dense TFLOP/s for ``dtype``) of the roofline, and where they come from: the
    arguments, else the GPU spec table (one place for GPU specs); none on CPU."""
    spec = gpu.spec_for_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    table = gpu.dense_peak_tflops(spec, dtype) if spec else None
    bandwidth, peak = bandwidth_gbs or (spec and spec.memory_bandwidth_gbs), peak_tflops or table
    if not (bandwidth and peak):
        return (None, None), (f"n/a: no {'bandwidth' if not bandwidth else dtype + ' compute peak'} for "
                              f"{runtime.device_description(device)} (--bandwidth-gbs and --peak-tflops give them)")
    sources = [f"{bandwidth:g} GB/s" + (" (--bandwidth-gbs)" if bandwidth_gbs else ""),
               f"{peak:g} TFLOP/s {dtype}" + (" (--peak-tflops)" if peak_tflops else "")]
    if spec and not (bandwidth_gbs and peak_tflops):
        sources.append(f"the GPU spec table's {spec.name} ({spec.source})")
    return (bandwidth, peak), ", ".join(sources)


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="workbook bench-continuous",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny', a local model dir, or a preset (random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="every arm's batch (without --memory-gib)")
    parser.add_argument("--memory-gib", type=float, help="each arm at the largest batch its plan fits in this memory")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 200), metavar=("MIN", "MAX"),
                        help="random prompts' lengths (models other than tiny)")
    parser.add_argument("--workloads", default="full,uneven")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the roofline (default: the GPU "
                        "spec table's for this GPU; none on CPU)")
    parser.add_argument("--peak-tflops", type=float, help="dense compute peak for --dtype, for the roofline's prefill "
                        "(default: the GPU spec table's; none on CPU)")
    parser.add_argument("--time-budget-seconds", type=float, help="stop within this many seconds of the start, "
                        "writing what was measured (default: no limit)")
    parser.add_argument("--out", help="results folder (default: a new outputs/<timestamp>-continuous-bench-<device>/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    budget = TimeBudget(args.time_budget_seconds)  # from the start: model building counts too
    out = Path(args.out) if args.out else notebook.new_run_dir(f"continuous-bench-{args.device.split(':')[0]}")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    results, load_before, stopped, interrupted = [], os.getloadavg(), None, False
    try:
        loaded = models.load_model(args.model, args.dtype, device)
        model = loaded.model
        tokenizer = models.load_tokenizer(args.model) if args.model == tiny_model.TINY_MODEL_NAME else None
        eos_ids, pad = decoding.eos_token_ids(model, tokenizer), decoding.pad_token_id(model, tokenizer)
        if tokenizer is not None:
            base = sample_prompts(tokenizer, args.examples, args.max_new_tokens)
        else:
            base = mixed_prompts(model.config.vocab_size, args.examples, tuple(args.prompt_tokens),
                                 args.max_new_tokens)
        batch_sizes = arm_batch_sizes(model.config, args.dtype, base, args.batch_size, args.memory_gib)
        peaks, peaks_source = roofline_peaks(device, args.dtype, args.bandwidth_gbs, args.peak_tflops)
        lengths = {"full": [args.max_new_tokens] * len(base), "uneven": drawn_lengths(len(base), args.max_new_tokens)}
        with tempfile.TemporaryDirectory(dir=out) as folder:
            for name in args.workloads.split(","):
                prompts = [generation.Prompt(p.index, p.token_ids, length) for p, length in zip(base, lengths[name])]
                results.append(run_workload(name, model, prompts, eos_ids, pad, batch_sizes, args.repeats,
                                            Path(folder), print, budget, peaks))
                if results[-1]["stopped_by_budget"]:
                    break
    except KeyboardInterrupt:
        if not budget.expired:
            raise
        interrupted = True
    finally:
        budget.cancel()
    cut = [r for r in results if r["stopped_by_budget"]]
    if interrupted or cut:
        stopped = (f"the time budget of {args.time_budget_seconds:g} s ran out after {len(results) - len(cut)} of "
                   f"{len(args.workloads.split(','))} workloads; the results hold the finished ones"
                   + (f", and the arms of '{cut[0]['workload']}' that finished ({', '.join(cut[0]['arms'])})"
                      if cut else ""))
    uneven = drawn_lengths(args.examples, args.max_new_tokens)
    report = {
        "what": "static (length-sorted) vs continuous batching on full-length and uneven outputs, and the "
                "continuous backend vs transformers' continuous batching called directly with the same cache",
        "model": args.model if stopped and not results else loaded.description, "device": str(device),
        "dtype": args.dtype, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "repeats": args.repeats, "hardware": runtime.device_description(device),
        # Other processes share this machine's cores: its load average says how busy it was.
        "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "uneven_lengths": f"lognormal(median {max(1, args.max_new_tokens // 8)}, sigma {LOGNORMAL_SIGMA}) capped at "
                          f"{args.max_new_tokens}, seed 0: mean {statistics.fmean(uneven):.1f}, "
                          f"p50 {statistics.median(uneven)}, max {max(uneven)}",
        "batch_sizes_from": (f"the largest each arm's plan fits in {args.memory_gib:g} GiB (at most one per prompt)"
                             if args.memory_gib else f"--batch-size {args.batch_size} for every arm"),
        "peak_memory_measured_as": "resident memory above its level before the arm, sampled every 10 ms (CPU)"
        if device.type == "cpu" else "torch.cuda.max_memory_reserved + memory outside PyTorch's allocator",
        "roofline": "n/a" if stopped and not results else (
            f"{peaks_source}; the least time an engine with the arm's batch always full needs for the same tokens "
            "(counting.pass_cost, refilled slots: prefill at the compute peak, decode steps reading the weights once "
            "and each token's context once at the bandwidth), over the arm's median"),
        "stopped": stopped,
        "command": "workbook bench-continuous " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": results,
    }
    (out / "continuous_batching.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / "continuous_batching.md").write_text(text)
    print(text + f"wrote {out / 'continuous_batching.json'} and {out / 'continuous_batching.md'}")
    return 3 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
