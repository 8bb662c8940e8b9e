"""What other projects published about the same measurement, set beside the workbook's own: each figure
with its source and what it measured, and any fraction derived from it computed here, by the same
counting as the workbook's (``formulas.token_cost``, the GPU spec table), never typed in.

vLLM's team published two figures for an 8B Llama decoding on one H100 (the shape of the GPU
reference's generation runs), from which its fraction of the bandwidth roofline follows:
- v0.5.x serving, light load: "Llama3 8B can generate 1 token every 13 ms", and of the engine's time
  only 38% was GPU execution (the API server took 33%, scheduling 29%);
- V1: "execution time on the GPU is as low as ~5ms" per step, the GPU work alone.
"""

from __future__ import annotations

from workbook import gpu
from workbook.planner.formulas import token_cost

VLLM_MODEL = "Llama-3.1-8B"  # the preset with Llama 3 8B's shape (only the rotary scaling differs)
VLLM_GPU = "NVIDIA H100 80GB HBM3"  # the H100 SXM; the posts say H100
VLLM_FIGURES = (
    (0.013, "vLLM v0.5.x serving at light load, one token every 13 ms (38% of its time GPU execution)",
     "https://blog.vllm.ai/2024/09/05/perf-update.html"),
    (0.005, "vLLM V1, the GPU execution of a step, ~5 ms",
     "https://blog.vllm.ai/2025/01/27/v1-alpha-release.html (vLLM V1: A Major Upgrade to vLLM's Core Architecture)"),
)


def vllm_decode_fractions() -> list[dict]:
    """Each published step time as a fraction of the bandwidth roofline at batch 1: the time to read the
    8B model's bf16 weights once at the H100's datasheet bandwidth, over the published time."""
    weights = token_cost(VLLM_MODEL, "bf16").weights_bytes
    bandwidth = gpu.spec_for_name(VLLM_GPU).memory_bandwidth_gbs * 1e9
    floor = weights / bandwidth
    return [{"what": what, "source": source, "step_seconds": seconds, "roofline_seconds": floor,
             "fraction": floor / seconds} for seconds, what, source in VLLM_FIGURES]


def vllm_line() -> str:
    """One sentence for a report: vLLM's published figures as fractions of the decode roofline."""
    figures = vllm_decode_fractions()
    parts = [f"{figure['what']}: {figure['fraction']:.0%} ({figure['source']})" for figure in figures]
    floor = figures[0]["roofline_seconds"]
    return (f"Beside vLLM's published figures for an 8B Llama decoding on one H100, as fractions of the decode "
            f"steps' bandwidth roofline (batch 1: {VLLM_MODEL}'s bf16 weights read once a step at the H100 SXM's "
            f"datasheet bandwidth, {floor * 1e3:.2f} ms): " + "; ".join(parts) + ". Those are step times at light load (a batch "
            "of one or a few), not throughput at a large batch.")
