"""Benchmark of the generation engine (not a test): what it costs over a bare ``generate`` loop, and
what sorting prompts by length gains. Writes ``generate_bench.json`` and ``generate_bench.md``.

    workbook bench-engine-overhead                    # CPU, tiny model, ~1-2 minutes
    workbook bench-engine-overhead --model llama-3.1-8b --device cuda --dtype bf16 --profile h200 \\
        --examples 512 --batch-size 64 --max-new-tokens 256 --prompt-tokens 32 1024

Arms, on the same prompts and batch size, each timed with the device synchronized, after one warm-up
batch, repeated and interleaved (the median counts):

- ``bare``: seed 000's loop with its slice fixed: file order, left padding, ``generate``, slice.
- ``engine``: ``generation.run_batches`` in file order: adds failure isolation, statistics, and
  records appended and fsynced per batch. ``engine / bare - 1`` is the engine's overhead.
- ``sorted``: the same with prompts sorted longest first, as the job runs. ``engine / sorted`` is
  the gain of length sorting.

Datasets: ``sample``, the shipped arithmetic prompts (short, similar lengths, end of sequence ends
them; tiny model only), and ``mixed``, random token ids of lengths uniform in ``--prompt-tokens``
with every output forced to ``max_new_tokens`` (``min_new_tokens``), so that padding comes from the
prompt lengths alone. A preset name (``llama-3.1-8b``) builds that architecture with random weights
on the device (``models.load_model``): timing does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from workbook import arithmetic, decoding, generation, jsonl, models, notebook, params, runtime, tiny_model
from workbook.bench.generation_sweep import mixed_prompts
from workbook.planner.formulas import token_cost

ARMS = ("bare", "engine", "sorted")


def bare_loop(model, prompts: list[generation.Prompt], settings: generation.DecodingSettings, batch_size: int) -> int:
    """The seed's loop, slice fixed: file order, one ``generate`` per batch. Returns output tokens."""
    output_tokens = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        rows = [p.token_ids for p in batch]
        input_ids, attention_mask = decoding.left_pad(rows, settings.pad_token_id, model.device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                generation_config=settings.generation_config(settings.max_new_tokens))
        generated = output[:, input_ids.shape[1]:].tolist()
        output_tokens += sum(len(generation.finish(row, settings.max_new_tokens, settings.eos_token_ids).token_ids)
                             for row in generated)
    return output_tokens


def engine_run(model, prompts, settings, batch_size: int, sort_by_length: bool, folder: Path) -> dict:
    """``run_batches`` with records appended and fsynced per batch, as the job writes them."""
    path = folder / f"engine-{time.perf_counter_ns()}.jsonl"
    with jsonl.LineAppender(path) as appender:
        def write(outcome: generation.Outcome) -> None:
            appender.write({"index": prompt.index, "output_tokens": len(completion.token_ids),
                            "finish_reason": completion.finish_reason} for prompt, completion in outcome.completed)
        batches = generation.run_batches(generation.StaticBackend(model, settings, batch_size), prompts, write=write,
                                       sort_by_length=sort_by_length, log=lambda line: None)
    path.unlink()
    return generation.summarize(batches, seconds=sum(b.seconds for b in batches))


def sample_prompts(tokenizer, count: int, max_new_tokens: int) -> list[generation.Prompt]:
    texts = [record["input"] for record in arithmetic.sample_records()[:count]]
    ids = generation.tokenize_prompts(tokenizer, texts, use_chat_template=True)
    return [generation.Prompt(i, row, max_new_tokens) for i, row in enumerate(ids)]


def run_dataset(name, model, prompts, settings, batch_size: int, repeats: int, folder: Path, log) -> dict:
    device = model.device
    generation.StaticBackend(model, settings, batch_size).generate(prompts[:batch_size])  # warm-up
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    details: dict[str, dict] = {}
    for repeat in range(repeats):
        for arm in ARMS:
            if arm == "bare":
                elapsed, output_tokens = runtime.timed(device, lambda: bare_loop(model, prompts, settings, batch_size))
                details[arm] = {"output_tokens": output_tokens}
            else:
                elapsed, summary = runtime.timed(device, lambda: engine_run(model, prompts, settings, batch_size,
                                                                    arm == "sorted", folder))
                details[arm] = {key: summary[key] for key in ("output_tokens", "padding_waste", "batches")}
            seconds[arm].append(elapsed)
            log(f"{name}: {arm} run {repeat + 1}/{repeats}: {elapsed:.2f} s")
    median = {arm: statistics.median(values) for arm, values in seconds.items()}
    lengths = [len(p.token_ids) for p in prompts]
    return {
        "dataset": name,
        "examples": len(prompts),
        "prompt_tokens_min_max": [min(lengths), max(lengths)],
        "max_new_tokens": settings.max_new_tokens,
        "forced_full_length": bool(settings.min_new_tokens),
        "batch_size": batch_size,
        "seconds": seconds,
        "median_seconds": {arm: round(value, 3) for arm, value in median.items()},
        "output_tokens_per_second": {arm: round(details[arm]["output_tokens"] / median[arm], 1) for arm in ARMS},
        "padding_waste": {arm: details[arm].get("padding_waste") for arm in ARMS if arm != "bare"},
        "engine_overhead_vs_bare": round(median["engine"] / median["bare"] - 1, 4),
        # The same in absolute terms: what the engine adds per batch (an fsync, records, statistics)
        # does not grow with the model, so this is what carries over to a large model on a GPU.
        "engine_overhead_ms_per_batch": round(1000 * (median["engine"] - median["bare"])
                                              / details["engine"]["batches"], 2),
        "length_sorting_speedup": round(median["engine"] / median["sorted"], 4),
    }


def weights_read_bound(model_name: str, dtype: str, batch_size: int, bandwidth_gbs: float) -> float | None:
    """Output tokens/s if each decode step only had to read the weights once at peak bandwidth (the
    memory-bandwidth roofline of batched decoding, KV-cache reads left out)."""
    if not bandwidth_gbs:
        return None
    weights = token_cost(model_name, dtype).weights_bytes  # as the sweep counts them
    return batch_size * bandwidth_gbs * 1e9 / weights


def markdown_table(results: list[dict]) -> str:
    rows = ["| dataset | examples | prompt tokens | batch | bare s | engine s | sorted s | engine overhead "
            "| sorting speedup | padding waste (file order -> sorted) | sorted output tok/s |", "|" + "---|" * 11]
    for r in results:
        low, high = r["prompt_tokens_min_max"]
        seconds, waste = r["median_seconds"], r["padding_waste"]
        rows.append(f"| {r['dataset']} | {r['examples']} | {low}-{high} | {r['batch_size']} | {seconds['bare']} "
                    f"| {seconds['engine']} | {seconds['sorted']} | {r['engine_overhead_vs_bare']:+.1%} "
                    f"({r['engine_overhead_ms_per_batch']:+.1f} ms/batch) "
                    f"| {r['length_sorting_speedup']:.2f}x | {waste['engine']:.1%} -> {waste['sorted']:.1%} "
                    f"| {r['output_tokens_per_second']['sorted']} |")
    return "\n".join(rows)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="workbook bench-engine-overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny', a local model dir, or a preset (random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--profile", help="params profile whose memory bandwidth gives the roofline (GPU)")
    parser.add_argument("--examples", type=int, default=128, help="prompts of the mixed dataset (sample: twice)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="mixed dataset; sample uses 8")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 200), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 is steadier "
                                                     "on a machine other jobs share")
    parser.add_argument("--out", help="results folder (default: a new outputs/<timestamp>-generate-bench-<device>/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parse_arguments(argv)
    out = Path(args.out) if args.out else notebook.new_run_dir(f"generate-bench-{args.device.split(':')[0]}")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = models.load_model(args.model, args.dtype, device)
    model, described = loaded.model, loaded.description
    is_tiny = args.model == tiny_model.TINY_MODEL_NAME
    tokenizer = models.load_tokenizer(args.model) if is_tiny else None
    eos_ids = decoding.eos_token_ids(model, tokenizer)
    pad = decoding.pad_token_id(model, tokenizer)
    results = []
    with tempfile.TemporaryDirectory(dir=out) as folder:
        if is_tiny:  # the arithmetic prompts mean something to the tiny model only
            settings = generation.DecodingSettings(8, eos_ids, pad)
            prompts = sample_prompts(tokenizer, min(args.examples * 2, 300), settings.max_new_tokens)
            results.append(run_dataset("sample", model, prompts, settings, args.batch_size, args.repeats,
                                       Path(folder), print))
        settings = generation.DecodingSettings(args.max_new_tokens, eos_ids, pad, min_new_tokens=args.max_new_tokens)
        prompts = mixed_prompts(model.config.vocab_size, args.examples, tuple(args.prompt_tokens),
                                args.max_new_tokens)
        results.append(run_dataset("mixed", model, prompts, settings, args.batch_size, args.repeats,
                                   Path(folder), print))
    bandwidth = params.load(params.profile_path(args.profile))["memory_bandwidth_gbs"] if args.profile else 0
    bound = weights_read_bound(args.model, args.dtype, args.batch_size, bandwidth) if bandwidth else None
    report = {
        "what": "generation engine overhead over a bare generate loop, and the gain of length sorting",
        "model": described, "device": str(device), "dtype": args.dtype, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "profile": args.profile,
        "weights_read_bound_output_tokens_per_second": round(bound, 1) if bound else None,
        "command": "workbook bench-engine-overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "results": results,
    }
    (out / "generate_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    text = (f"{described} on {device} ({args.dtype}, {torch.get_num_threads()} threads), medians of "
            f"{args.repeats}\n\n{markdown_table(results)}\n")
    (out / "generate_bench.md").write_text(text)
    print(text + f"wrote {out / 'generate_bench.json'} and {out / 'generate_bench.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
