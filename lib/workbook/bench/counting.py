"""Counting what the hardware must do: bytes and FLOPs per decode step, the rooflines they imply,
the profile's peaks, the cost, and the small parsers and statistics the sweeps share."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from workbook.params import AUTO
from workbook.planner.formulas import token_cost

SEED_BATCH_SIZE = 32  # the seeds' "after": static batches of 32 in file order
HF_PIPELINE = "hf-pipeline"  # Hugging Face's pipeline("text-generation"): the tool users know, measured beside ours
STRATEGIES = ("seed-before", "seed-after", "static-sorted", "static-compiled", "continuous", HF_PIPELINE)
BASELINE = "seed-after"
NOT_MEASURED = "not measured"
NA = "n/a"


class BenchError(ValueError):
    """The benchmark cannot run as configured; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One decode step of a batch: what it must read from memory and compute."""

    bytes_read: int  # weights streamed once + the KV cache of every sequence
    flops: int  # 2 x matmul parameters per token + attention over the context, all rows
    weights_bytes: int
    kv_cache_bytes: int


def decode_step_cost(model, dtype: str, batch_size: int, context_tokens: int) -> StepCost:
    """Bytes and FLOPs of one decode step of ``batch_size`` sequences with ``context_tokens`` each:
    every weight read once (``token_cost``) plus each sequence's KV cache; per token, the matmuls
    plus attention over the context."""
    unit = token_cost(model, dtype)
    kv = batch_size * context_tokens * unit.kv_bytes_per_token
    per_token = unit.matmul_flops + unit.attention_flops * context_tokens
    return StepCost(bytes_read=unit.weights_bytes + kv, flops=batch_size * per_token,
                    weights_bytes=unit.weights_bytes, kv_cache_bytes=kv)


@dataclasses.dataclass(frozen=True)
class PassCost:
    """A whole generation pass as an ideal engine runs it: no padding, no wasted row."""

    prefill_flops: int
    prefill_bytes: int  # the weights, once per batch
    decode_flops: int
    decode_bytes: int  # the weights once per step, and every row's KV cache
    decode_steps: int

    def roofline_seconds(self, bandwidth_gbs: float, peak_tflops_value: float) -> dict | None:
        """The least time the pass can take: each phase at whichever of ``bandwidth_gbs`` and the
        compute peak binds it (prefill: compute; decode: bandwidth, until batches grow very large).
        None without both peaks."""
        if not bandwidth_gbs or not peak_tflops_value:
            return None
        bandwidth, peak = bandwidth_gbs * 1e9, peak_tflops_value * 1e12
        prefill = max(self.prefill_flops / peak, self.prefill_bytes / bandwidth)
        decode = max(self.decode_bytes / bandwidth, self.decode_flops / peak)
        return {"prefill": prefill, "decode": decode, "total": prefill + decode}


def pass_cost(model, dtype: str, prompt_lengths: list[int], batch_size: int, new_tokens: int | list[int], *,
              refill: bool = False) -> PassCost:
    """Every prompt (of ``prompt_lengths`` tokens) gets ``new_tokens`` (one count for all, or each
    prompt's own: outputs that ended at end of sequence), ``batch_size`` rows a batch. Prefill: each
    prompt's real tokens through the matmuls and causal attention (half the square of its length),
    which also gives the first new token; then each row's ``new_tokens - 1`` decode steps, the step
    after k new tokens attending prompt + k positions. Every step reads the weights once: static
    batches (the longest outputs together, fewer rows in the last) take their longest row's steps;
    with ``refill`` (continuous batching) a finished row's slot is refilled at once, so the rows'
    steps are packed ``batch_size`` a step. Either way the least an engine of that batch must do, not a
    batch size larger than its prompts."""
    unit = token_cost(model, dtype)
    rows = len(prompt_lengths)
    outputs = [new_tokens] * rows if isinstance(new_tokens, int) else list(new_tokens)
    if len(outputs) != rows:
        raise ValueError(f"{len(outputs)} output lengths for {rows} prompts")
    steps = [max(output - 1, 0) for output in outputs]
    # Positions attended over a row's decode steps: (prompt + 1) + ... + (prompt + steps).
    attended = sum(length * step + step * (step + 1) // 2 for length, step in zip(prompt_lengths, steps))
    if refill:
        decode_steps = max(-(-sum(steps) // batch_size), max(steps, default=0))
    else:
        longest_first = sorted(steps, reverse=True)
        decode_steps = sum(longest_first[::batch_size])  # each batch's longest row
    squares = sum(length * length for length in prompt_lengths)
    return PassCost(
        prefill_flops=unit.matmul_flops * sum(prompt_lengths) + unit.attention_flops * squares // 2,
        prefill_bytes=-(-rows // batch_size) * unit.weights_bytes,
        decode_flops=unit.matmul_flops * sum(steps) + unit.attention_flops * attended,
        decode_bytes=decode_steps * unit.weights_bytes + unit.kv_bytes_per_token * attended,
        decode_steps=decode_steps)


def pass_figures(cost: PassCost, output_tokens: int, seconds: float, bandwidth_gbs: float, peak_tflops_value: float,
                 ceilings: dict | None = None) -> dict:
    """A timed pass beside its roofline: ``roofline`` (the least time ``cost`` allows at the
    datasheet's peaks, and at this GPU's measured copy bandwidth and matmul where ``ceilings`` has
    them), ``fraction_of_roofline`` (that time over the pass's) and ``fraction_of_peak`` (the
    memory traffic and FLOP/s the pass averaged, over the datasheet's peaks). None where a peak is
    missing (the cpu profile)."""
    datasheet = cost.roofline_seconds(bandwidth_gbs, peak_tflops_value)
    measured = ceilings and cost.roofline_seconds(ceilings["copy_gb_per_second"], ceilings["matmul_tflops"])
    traffic = (cost.prefill_bytes + cost.decode_bytes) / seconds
    flops = (cost.prefill_flops + cost.decode_flops) / seconds
    return {
        "roofline": {
            "seconds": datasheet, "seconds_at_measured_ceilings": measured or None,
            "tokens_per_second": output_tokens / datasheet["total"] if datasheet else None,
            "how": "prefill and decode each at whichever peak binds it (prefill: compute; decode: the weights once a "
                   "step and every row's KV cache, at the bandwidth), no padding: the least time for the same tokens"},
        "fraction_of_roofline": {"datasheet": datasheet["total"] / seconds if datasheet else None,
                                 "measured_ceilings": measured["total"] / seconds if measured else None},
        "fraction_of_peak": {"bandwidth": traffic / (bandwidth_gbs * 1e9) if bandwidth_gbs else None,
                             "compute": flops / (peak_tflops_value * 1e12) if peak_tflops_value else None},
    }


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


def parse_int_list(text: str, key: str, auto: int | str | None = None) -> list[int | str]:
    """'1,8,32' -> [1, 8, 32]; 'auto' entries become ``auto`` where one is given (a number, or AUTO to be
    resolved later); an error names the key."""
    parts = [part for part in str(text).replace(" ", "").split(",") if part]
    try:
        values = [auto if part == AUTO and auto is not None else int(part) for part in parts]
    except ValueError:
        raise BenchError(f"{key} is {text!r}; expected comma-separated positive integers, e.g. '1,8,32'") from None
    if not values or any(isinstance(value, int) and value < 1 for value in values):
        raise BenchError(f"{key} is {text!r}; expected comma-separated positive integers, e.g. '1,8,32'")
    return values


def parse_strategies(text: str) -> list[str]:
    chosen = [part.strip() for part in str(text).split(",") if part.strip()]
    unknown = [name for name in chosen if name not in STRATEGIES]
    if unknown or not chosen:
        raise BenchError(f"bench_strategies is {text!r}; expected a comma-separated subset of {', '.join(STRATEGIES)}")
    return chosen


NOISY_SPREAD = 1.5  # runs of one point whose fastest is this many times its slowest: the machine was busy


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def noise_note(values: list[float]) -> str:
    """'' or a warning that ``values`` (one point's repeated runs or steps) spread too far to trust their
    median: another process had the machine, or a step stalled."""
    values = sorted(value for value in values if value)
    if len(values) >= 5:  # one stalled step (a garbage collection) among many is not a busy machine
        values = values[1:-1]
    if len(values) < 2 or values[-1] < NOISY_SPREAD * values[0]:
        return ""
    return f"noisy: its runs spread {values[-1] / values[0]:.1f}x (a busy machine?); rerun before comparing"


def run_dtype(dtype: str, device: torch.device) -> str:
    """The profile's ``dtype`` on a GPU; fp32 on CPU (bf16 matmuls there are emulated and slow)."""
    return dtype if device.type == "cuda" else "fp32"
