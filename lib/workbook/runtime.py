"""The process and its device: launcher detection, a free port, synchronizing, and peak memory.

One rule each, so generation, training, the batch finder and the benchmarks agree on what
"launched", "the device" and "peak memory" mean.
"""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass

import torch


def inside_launcher() -> bool:
    """True in a process started by torchrun, accelerate launch or notebook_launcher: each sets
    LOCAL_RANK (and WORLD_SIZE) for the processes it starts."""
    return "LOCAL_RANK" in os.environ


def launched_processes() -> int:
    """How many processes the launcher started (1 outside a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if inside_launcher() else 1


def free_port() -> int:
    """A port no one listens on, so two jobs on one machine do not collide on accelerate's 29500."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read next measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Free what earlier work left cached, then start a new high-water mark (no-op on CPU)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class PeakMemory:
    """Device memory at its peak since the last reset, in bytes, as the planner counts it."""

    reserved_bytes: int  # torch.cuda.max_memory_reserved: the caching allocator's peak
    allocated_bytes: int  # torch.cuda.max_memory_allocated: live tensors at the peak
    # Used outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN workspaces, NCCL, and any other
    # process on the same GPU): total - free - memory_reserved, read now.
    non_pytorch_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.non_pytorch_bytes


NOT_MEASURED_ON_CPU = "not measured: no GPU (CPU memory has no resettable high-water mark)"


def peak_memory(device: torch.device) -> PeakMemory | None:
    """The peak since the last ``reset_peak_memory``; None on CPU (no resettable high-water mark:
    not measured, never guessed)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return PeakMemory(torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device),
                      total - free - torch.cuda.memory_reserved(device))
