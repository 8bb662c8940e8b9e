"""The process and its device: launcher detection, a free port, synchronizing, peak memory, and an
exclusive lock on a file.

One rule each, so generation, training, the batch finder and the benchmarks agree on what
"launched", "the device" and "peak memory" mean.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import gc
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from workbook import gpu


def inside_launcher() -> bool:
    """True in a process started by torchrun, accelerate launch or notebook_launcher: each sets
    LOCAL_RANK (and WORLD_SIZE) for the processes it starts."""
    return "LOCAL_RANK" in os.environ


def launched_processes() -> int:
    """How many processes the launcher started (1 outside a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if inside_launcher() else 1


def launched_nodes() -> int:
    """How many machines the launcher spans (1 outside a launcher): torchrun, and accelerate launch
    through it, set GROUP_WORLD_SIZE to the number of nodes (``--nnodes``, ``--num_machines``)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) if inside_launcher() else 1


def folder_shared_with_first(folder: str | Path, index: int, all_gather: Callable[[Any], list]) -> list[bool]:
    """For each process, whether its ``folder`` is the first process's (a shared filesystem) or one of
    the same name on its own node's disk. The first process (``index`` 0) makes the folder and a file of
    a random name in it; every process looks for that file. ``all_gather(value)`` returns every
    process's value in rank order (a collective: every process must call this, in the same order)."""
    folder = Path(folder)
    marker = None
    if index == 0:
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".shared-check-{secrets.token_hex(8)}"
        marker.touch()
    name = all_gather(marker.name if marker else None)[0]
    try:
        return [bool(seen) for seen in all_gather((folder / name).exists())]
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def free_port() -> int:
    """A port no one listens on, so two jobs on one machine do not collide on accelerate's 29500."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_age_seconds() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included), from
    /proc on Linux; None elsewhere. A job's wall time is measured from here, as a user's clock would."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def missing_gpu_warning(profile: str, gpu_count: int) -> str | None:
    """A warning when a GPU profile runs where torch sees no GPU (a laptop given --params h100): the job
    runs on the CPU with 'auto' batches planned for the GPU's memory. Counted through NVML
    (``device_count``): ``is_available`` starts the CUDA driver, and the processes notebook_launcher
    forks after it could not use CUDA."""
    if gpu_count > 0 and torch.cuda.device_count() == 0:
        return (f"warning: profile {profile} describes {gpu_count} GPU(s) and torch sees none here: this job runs on "
                "the CPU, with 'auto' batch sizes planned for that GPU's memory (use --params cpu on this machine)")
    return None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_description(device: torch.device) -> str:
    """What a measurement ran on, for its report: the GPU's name, or the CPU's model with the
    threads torch computes with (a CPU figure depends on them as much as on the chip)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    facts = gpu.cpu_facts()
    return (f"CPU: {facts.get('model', 'unknown')}, {torch.get_num_threads()} threads "
            f"({facts.get('usable_cores', '?')} usable of {facts.get('logical_cores', '?')} logical cores)")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read next measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of ``run()``, the device synchronized before and after: a GPU runs
    kernels asynchronously, so a clock read without the synchronize times their launch, not them."""
    synchronize(device)
    started = time.perf_counter()
    result = run()
    synchronize(device)
    return time.perf_counter() - started, result


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matmuls and cuDNN convolutions. Through torch's ``fp32_precision`` where it has it
    (2.9+): once anything (transformers' Trainer) has used that API, reading or setting the legacy
    ``allow_tf32`` flags raises ("mix of the legacy and new APIs")."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        precision = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> bool:
    """Whether float32 matmuls run in TF32 (``set_tf32``'s API: never the legacy flag after the new one)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        precision = torch.backends.cuda.matmul.fp32_precision
        return (torch.backends.fp32_precision if precision == "none" else precision) == "tf32"
    return torch.backends.cuda.matmul.allow_tf32


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


NOT_MEASURED_ON_CPU = "not measured: no GPU (torch keeps no peak of CPU tensor memory; resident memory also holds Python and its libraries)"


def peak_memory(device: torch.device) -> PeakMemory | None:
    """The peak since the last ``reset_peak_memory``; None on CPU (torch keeps no peak of CPU tensor
    memory: not measured, never guessed)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return PeakMemory(torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device),
                      total - free - torch.cuda.memory_reserved(device))


class LockHeldError(RuntimeError):
    """Another process holds the lock; ``holder`` says who, as that process wrote it."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


class ExclusiveLock:
    """An advisory, exclusive lock on a sidecar file (``flock``), held while the ``with`` block runs.

    flock rather than a pid file: the kernel releases it when its process dies, so a job killed
    with kill -9 leaves nothing that blocks the next one; it also holds over NFS (Linux emulates it
    with byte-range locks there). The file records the holder's pid, host and start time, so the
    refused process can name it. Children forked while it is held share it (same open file).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> "ExclusiveLock":
        """Take the lock, or raise LockHeldError at once (never waits)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise LockHeldError(self.path, holder) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder before us removes the file as it releases it; if that happened between our
            # open and our flock, we hold a file no one else opens: start again on the path.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        self._fd = fd
        note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
        try:
            os.ftruncate(fd, 0)
            os.write(fd, note.encode() + b"\n")
        except OSError:
            pass  # e.g. a full disk: the lock holds all the same, only the note naming us is missing
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Removed while still held: a process that opened it a moment ago finds, once it has the
        # lock, that the path is gone, and starts again on a new file (see acquire).
        if _same_file(self._fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "ExclusiveLock":
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_path, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (on_path.st_dev, on_path.st_ino) == (held.st_dev, held.st_ino)


def _read_holder(fd: int) -> str:
    try:
        note = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"process {note['pid']} on host {note['host']} (since {note['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has only just started (it has not written its pid yet)"
