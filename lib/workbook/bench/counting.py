"""Counting what the hardware must do: bytes and FLOPs per decode step, the rooflines they imply,
the profile's peaks, the cost, and the small parsers and statistics the sweeps share."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from workbook import presets
from workbook.params import AUTO
from workbook.planner import BITS_PER_PARAMETER, canonical_dtype, kv_cache_bytes_per_token, model_shape

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
    """Bytes and FLOPs of one decode step of ``batch_size`` sequences with ``context_tokens`` each.

    Bytes: every weight is read once per step (the input embedding only for the rows it gathers,
    so an untied embedding matrix is left out) plus each sequence's KV cache
    (``kv_cache_bytes_per_token`` x context). FLOPs per token: 2 per matmul weight (one
    multiply-add) plus 4 x layers x heads x head_dim x context for the scores and the weighted
    values. Norms, rotary embeddings and the softmax are left out (well under 1%).
    """
    config = presets.load_config(model) if isinstance(model, str) else model
    shape = model_shape(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    parameter_bytes = BITS_PER_PARAMETER[canonical_dtype(dtype)] // 8
    streamed = shape.parameters - (0 if tied else shape.vocab_size * shape.hidden_size)
    weights = streamed * parameter_bytes
    kv = batch_size * context_tokens * kv_cache_bytes_per_token(shape, dtype)
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
                      peak_tflops_value: float, measured_bandwidth_gbs: float | None = None) -> dict:
    """Achieved memory traffic / peak bandwidth (the datasheet's, and the measured copy bandwidth's
    where there is one) and achieved FLOP/s / peak; None where there is no peak."""
    if not tokens_per_second:
        return {"bandwidth": None, "bandwidth_measured": None, "compute": None}
    steps_per_second = tokens_per_second / batch_size
    traffic = steps_per_second * cost.bytes_read
    return {"bandwidth": traffic / (bandwidth_gbs * 1e9) if bandwidth_gbs else None,
            "bandwidth_measured": traffic / (measured_bandwidth_gbs * 1e9) if measured_bandwidth_gbs else None,
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


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run_dtype(params, device: torch.device) -> str:
    """The profile's dtype on a GPU; fp32 on CPU (bf16 matmuls there are emulated and slow)."""
    return params["dtype"] if device.type == "cuda" else "fp32"
