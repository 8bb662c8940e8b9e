"""The hardware a profile describes, as one typed object: its GPUs' facts (from the GPU spec table's
row, or stated by the profile), how many, their price and the memory the planner keeps back. Built
once from validated params at a job's entry; the planner, the forecast, the benchmarks and the GPU
check read its fields, never the params::

    hardware = Hardware.from_params(params)
    hardware.gpu_count, hardware.memory_bandwidth_gbs, hardware.usd_per_gpu_hour
    gpu.dense_peak_tflops(hardware, "bf16")     # the peak for a dtype: the GPU table's one rule
"""

from __future__ import annotations

from dataclasses import dataclass

from workbook.params import default as _default, settings_of


@dataclass(frozen=True)
class Hardware:
    """One profile's machine; each field is the params key of the same name."""

    profile: str = _default("profile")
    gpu_spec: str = _default("gpu_spec")
    gpu_name_pattern: str = _default("gpu_name_pattern")
    gpu_count: int = _default("gpu_count")  # per node; 0 is the cpu profile
    num_nodes: int = _default("num_nodes")
    gpu_memory_gib: float = _default("gpu_memory_gib")
    peak_bf16_tflops: float = _default("peak_bf16_tflops")
    peak_fp16_tflops: float = _default("peak_fp16_tflops")
    memory_bandwidth_gbs: float = _default("memory_bandwidth_gbs")
    supports_bf16: bool = _default("supports_bf16")
    supports_tf32: bool = _default("supports_tf32")
    usd_per_gpu_hour: float = _default("usd_per_gpu_hour")
    cuda_overhead_gib: float = _default("cuda_overhead_gib")
    safety_margin: float = _default("safety_margin")

    @classmethod
    def from_params(cls, params) -> "Hardware":
        return settings_of(cls, params)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0
