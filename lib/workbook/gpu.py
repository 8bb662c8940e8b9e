"""GPU detection, the GPU spec table, and choosing the params profile that matches the machine.

Readings come from NVML first: it reads names, memory and compute capability without creating a
CUDA context, so the runner can pick a profile without holding ~0.5 GB on every GPU while the
notebooks run, and without initializing CUDA before accelerate's `notebook_launcher`. torch is
the fallback when NVML is missing (e.g. a container without the NVML library).
"""

from __future__ import annotations

import os
import platform
import re
import socket
import sys
from dataclasses import asdict, dataclass
from importlib import metadata

from workbook.units import GiB


@dataclass(frozen=True)
class GpuSpec:
    """Vendor figures for one GPU model. Peaks are dense (no 2:4 sparsity), per GPU."""
    name: str
    name_pattern: str  # regex matched against the name the driver reports
    memory_gib: float  # as the driver reports it (nvidia-smi MiB / 1024)
    peak_bf16_tflops: float  # 0: no bf16 tensor cores
    peak_fp16_tflops: float
    memory_bandwidth_gbs: float  # GB/s, 1e9 bytes per second
    supports_bf16: bool
    supports_tf32: bool
    source: str


# The one spec table. Datasheets quote tensor TFLOPS "with sparsity"; dense is half of that.
# Patterns are tried in order, so the specific variants (NVL, PCIe) come before the generic ones.
GPU_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("H200 NVL", r"H200.*NVL", 140.4, 835.5, 835.5, 4800, True, True,
            "NVIDIA H200 datasheet (H200 NVL column: 1,671 TFLOPS bf16 with sparsity, 4.8 TB/s)"),
    GpuSpec("H200 SXM", r"H200", 140.4, 989.5, 989.5, 4800, True, True,
            "NVIDIA H200 datasheet (H200 SXM: 1,979 TFLOPS bf16 with sparsity, 141 GB HBM3e, 4.8 TB/s); "
            "the driver reports 143,771 MiB"),
    GpuSpec("H100 NVL", r"H100.*NVL", 93.6, 835.5, 835.5, 3900, True, True,
            "NVIDIA H100 datasheet (H100 NVL: 1,671 TFLOPS bf16 with sparsity, 94 GB, 3.9 TB/s)"),
    GpuSpec("H100 PCIe", r"H100.*PCIe", 79.6, 756.5, 756.5, 2000, True, True,
            "NVIDIA H100 datasheet (H100 PCIe: 1,513 TFLOPS bf16 with sparsity, 80 GB HBM2e, 2.0 TB/s)"),
    GpuSpec("H100 SXM", r"H100", 79.6, 989.5, 989.5, 3350, True, True,
            "NVIDIA H100 datasheet (H100 SXM: 1,979 TFLOPS bf16 with sparsity, 80 GB HBM3, 3.35 TB/s); "
            "the driver reports 81,559 MiB"),
    GpuSpec("A100 80GB PCIe", r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", 80.0, 312, 312, 1935, True, True,
            "NVIDIA A100 datasheet (A100 80GB PCIe: 312 TFLOPS bf16 dense, 1,935 GB/s)"),
    GpuSpec("A100 SXM4 80GB", r"A100.*80GB", 80.0, 312, 312, 2039, True, True,
            "NVIDIA A100 datasheet (A100 80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s)"),
    GpuSpec("A100 40GB", r"A100", 40.0, 312, 312, 1555, True, True,
            "NVIDIA A100 datasheet (A100 40GB: 312 TFLOPS bf16 dense, 1,555 GB/s)"),
    GpuSpec("L40S", r"L40S", 45.0, 362.05, 362.05, 864, True, True,
            "NVIDIA L40S datasheet (733 TFLOPS bf16 with sparsity, 48 GB GDDR6, 864 GB/s)"),
    GpuSpec("RTX A6000", r"RTX A6000", 48.0, 154.8, 154.8, 768, True, True,
            "NVIDIA RTX A6000 datasheet (309.7 tensor TFLOPS with sparsity, 48 GB GDDR6, 768 GB/s)"),
    GpuSpec("RTX 4090", r"RTX 4090", 24.0, 165.2, 165.2, 1008, True, True,
            "NVIDIA Ada Lovelace architecture whitepaper, appendix A (RTX 4090: 165.2 TFLOPS "
            "bf16/fp16 with fp32 accumulate, dense; 24 GB GDDR6X, 1,008 GB/s)"),
    GpuSpec("V100", r"V100", 31.7, 0, 125, 900, False, False,
            "NVIDIA V100 datasheet (V100 SXM2: 125 TFLOPS fp16 tensor, 900 GB/s; no bf16, no TF32; "
            "PCIe variant: 112 TFLOPS)"),
)


def spec_for_name(gpu_name: str) -> GpuSpec | None:
    """The spec-table entry for a driver-reported GPU name, or None when the table lacks it."""
    for spec in GPU_SPECS:
        if re.search(spec.name_pattern, gpu_name, re.IGNORECASE):
            return spec
    return None


# The spec table and the profiles state dense 16-bit tensor-core peaks only: an fp32 (or TF32)
# matmul has no figure beside it, so MFU and rooflines of fp32 work are n/a, not measured against
# a peak it cannot reach.
_PEAK_KEYS = {"bf16": "peak_bf16_tflops", "bfloat16": "peak_bf16_tflops", "fp16": "peak_fp16_tflops",
              "float16": "peak_fp16_tflops"}


def dense_peak_tflops(figures, dtype: str) -> float:
    """Dense peak per GPU for ``dtype`` ('bf16'/'fp16', or torch's 'bfloat16'/'float16'), TFLOP/s,
    from a profile (a mapping) or anything with peak_*_tflops attributes (GpuSpec, TrainConfig);
    0 when there is none (fp32, or the cpu profile's zeros)."""
    key = _PEAK_KEYS.get(dtype)
    if key is None:
        return 0.0
    value = figures.get(key) if hasattr(figures, "get") else getattr(figures, key, None)
    return float(value or 0)


def mfu(flops: float, seconds: float, peak_tflops: float, gpus: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over ``gpus`` GPUs' dense peak; None without a peak or time."""
    if not (peak_tflops and seconds > 0 and flops):
        return None
    return flops / seconds / 1e12 / (peak_tflops * gpus)


def _decode(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml_gpus(nvml) -> tuple[list[dict], dict]:
    """Per-GPU readings through NVML (the `pynvml` module or a stand-in with its API).

    Returns (gpus, driver facts). Raises whatever nvml raises when the library or driver is
    missing; `detect` treats that as "no NVML".
    """
    nvml.nvmlInit()
    try:
        driver = {
            "driver_version": _decode(nvml.nvmlSystemGetDriverVersion()),
            # Encoded as 1000 * major + 10 * minor, e.g. 12040 -> "12.4".
            "cuda_driver_version": "{}.{}".format(*divmod(nvml.nvmlSystemGetCudaDriverVersion() // 10, 100)),
        }
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(_gpu_record(index, _decode(nvml.nvmlDeviceGetName(handle)), int(memory.total),
                                    int(memory.free), (major, minor), "nvml"))
        return gpus, driver
    finally:
        nvml.nvmlShutdown()


def read_torch_gpus(cuda) -> list[dict]:
    """Per-GPU readings through `torch.cuda` (or a stand-in). Creates a CUDA context per GPU."""
    if not cuda.is_available():
        return []
    gpus = []
    for index in range(cuda.device_count()):
        props = cuda.get_device_properties(index)
        free, total = cuda.mem_get_info(index)
        gpus.append(_gpu_record(index, props.name, int(total), int(free), (props.major, props.minor), "torch"))
    return gpus


def _gpu_record(index: int, name: str, total: int, free: int, capability: tuple[int, int], source: str) -> dict:
    spec = spec_for_name(name)
    return {
        "index": index,
        "name": name,
        "memory_total_bytes": total,
        "memory_free_bytes": free,
        "compute_capability": f"{capability[0]}.{capability[1]}",
        # bf16 and TF32 tensor cores arrived with Ampere (compute capability 8.0).
        "supports_bf16": capability >= (8, 0),
        "supports_tf32": capability >= (8, 0),
        "spec": asdict(spec) if spec else None,
        "read_by": source,
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict:
    import torch  # local: importing torch costs seconds, and only detection needs it here
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        # Whether transformers' continuous batching can run flash attention (it switches to it where
        # installed; without it, sdpa over one dense mask of every request in flight).
        "flash-attn": _version("flash-attn") or "not installed",
        "workbook": _version("workbook"),
    }


def cpu_facts() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    return {"model": model, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "ram_bytes": ram}


def detect(nvml=None, cuda=None) -> dict:
    """Everything the workbook needs to know about this machine, as a JSON-ready dict.

    `nvml` and `cuda` default to the real `pynvml` and `torch.cuda`; tests pass stand-ins.
    """
    gpus, driver, notes = [], {"driver_version": None, "cuda_driver_version": None}, []
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            notes.append("nvidia-ml-py is not installed; readings come from torch")
    if nvml is not None:
        try:
            gpus, driver = read_nvml_gpus(nvml)
        except Exception as error:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without a GPU
            notes.append(f"NVML unavailable ({type(error).__name__}: {error})")
    if not gpus:
        if cuda is None:
            import torch
            cuda = torch.cuda
        gpus = read_torch_gpus(cuda)
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "gpus": gpus,
        "gpu_count": len(gpus),
        **driver,
        "cpu": cpu_facts(),
        "versions": software_versions(),
        "python_executable": sys.executable,
        "notes": notes,
    }


def machine_tables(detection: dict) -> list[tuple[str, list[dict]]]:
    """(title, rows) of what ``detect`` read: software, CPU and GPUs (notebook 00 and ``workbook gpu``)."""
    cpu = detection["cpu"]
    tables = [
        ("Software (read from the installed packages)",
         [{"package": name, "version": version} for name, version in detection["versions"].items()]),
        ("CPU (os / /proc/cpuinfo)",
         [{"CPU": cpu["model"], "usable cores": cpu["usable_cores"],
           "RAM (GiB)": f"{cpu['ram_bytes'] / GiB:.1f}" if cpu["ram_bytes"] else "unknown"}]),
    ]
    if detection["gpus"]:
        tables.append((
            f"GPUs (driver {detection['driver_version']}, CUDA driver {detection['cuda_driver_version']})",
            [{"#": g["index"], "name": g["name"], "total GiB": f"{g['memory_total_bytes'] / GiB:.1f}",
              "free GiB": f"{g['memory_free_bytes'] / GiB:.1f}", "compute capability": g["compute_capability"],
              "bf16": g["supports_bf16"], "TF32": g["supports_tf32"], "read by": g["read_by"]}
             for g in detection["gpus"]]))
    return tables


def spec_rows(detection: dict) -> list[dict]:
    """The GPU spec table, the detected GPU marked."""
    detected = {g["spec"]["name"] for g in detection["gpus"] if g["spec"]}
    return [{"GPU": s.name + (" ← detected" if s.name in detected else ""), "memory GiB (as the driver reports it)": s.memory_gib,
             "dense bf16 TFLOP/s": s.peak_bf16_tflops or "none", "dense fp16 TFLOP/s": s.peak_fp16_tflops,
             "bandwidth GB/s": s.memory_bandwidth_gbs, "source": s.source} for s in GPU_SPECS]


def memory_devices(detection: dict) -> tuple[list[dict], str]:
    """(devices, where the readings came from) for the memory overview: every GPU, or the CPU's RAM."""
    if detection["gpus"]:
        return ([{"label": f"GPU {g['index']}: {g['name']}", "total_bytes": g["memory_total_bytes"],
                  "free_bytes": g["memory_free_bytes"]} for g in detection["gpus"]], "NVML/torch readings")
    import psutil  # a dependency of accelerate
    ram = psutil.virtual_memory()
    devices = [{"label": "CPU RAM", "total_bytes": ram.total, "free_bytes": ram.available}]
    return devices, "psutil readings of system RAM"


@dataclass(frozen=True)
class ProfileChoice:
    profile: str
    exact: bool  # False: the nearest profile; the reason says what differs
    reason: str


def select_profile(gpus: list[dict], profiles: dict) -> ProfileChoice:
    """Pick the params profile for the detected GPUs.

    Exact: the name matches the profile's pattern, memory is within 10% and the count is equal.
    Otherwise the nearest GPU profile (no more memory than the GPU has, then the nearest compute peak
    in the spec table, then memory, name and count), with a reason that says what differs. No GPU: `cpu`.
    """
    if not gpus:
        return ProfileChoice("cpu", True, "no GPU detected: profile 'cpu'")
    name, count = gpus[0]["name"], len(gpus)
    memory_gib = gpus[0]["memory_total_bytes"] / GiB
    candidates = [p for p in profiles.values() if p["gpu_count"] > 0]

    def name_matches(p) -> bool:
        return bool(p["gpu_name_pattern"]) and re.search(p["gpu_name_pattern"], name, re.IGNORECASE) is not None

    def memory_matches(p) -> bool:
        return abs(p["gpu_memory_gib"] - memory_gib) <= 0.1 * p["gpu_memory_gib"]

    detected = f"{count} x {name} ({memory_gib:.1f} GiB each)"
    for p in candidates:
        if name_matches(p) and memory_matches(p) and p["gpu_count"] == count:
            return ProfileChoice(p["profile"], True, f"{detected} matches profile '{p['profile']}'")
    if not candidates:
        return ProfileChoice("cpu", False, f"{detected}, but there is no GPU profile in params/")
    spec = spec_for_name(name)

    def nearness(p):
        # First no more memory than the GPU has (a plan must not count memory that is not there), then the
        # nearest compute peak (MFU is measured against it: an H100 NVL is nearer an A100 80GB by memory,
        # whose peak is 37% of its own), then memory, name and count.
        over = max(0.0, p["gpu_memory_gib"] - 1.1 * memory_gib)
        peak_gap = abs(p["peak_bf16_tflops"] - spec.peak_bf16_tflops) if spec else 0.0
        return over, peak_gap, abs(p["gpu_memory_gib"] - memory_gib), not name_matches(p), abs(p["gpu_count"] - count)

    nearest = min(candidates, key=nearness)
    differences = []
    if not name_matches(nearest):
        differences.append(f"its pattern {nearest['gpu_name_pattern']!r} does not match the GPU name")
    if not memory_matches(nearest):
        differences.append(f"it expects {nearest['gpu_memory_gib']:g} GiB per GPU")
    if nearest["gpu_count"] != count:
        differences.append(f"it expects {nearest['gpu_count']} GPU(s)")
    return ProfileChoice(nearest["profile"], False,
                         f"NO EXACT PROFILE for {detected}: using the nearest, "
                         f"'{nearest['profile']}', but {'; '.join(differences)}. Its run settings and "
                         f"price apply; add params/<your-gpu>.yaml to choose them for this GPU.")


def hardware_overrides(gpus: list[dict]) -> tuple[dict, str]:
    """The detected GPUs' own hardware facts as params keys, and where each came from.

    Laid over the nearest profile when none matches exactly: an H100 PCIe run under 'h100' must
    measure MFU and the roofline against its own 756 TFLOP/s and 2.0 TB/s, not the SXM's. Count,
    memory and bf16/TF32 support are the driver's readings; peaks and bandwidth come from the spec
    table; where the table lacks the GPU they are 0 ("not measured against": MFU and roofline figures
    read n/a) rather than another GPU's, and the description says which keys to set.
    """
    first = gpus[0]
    overrides = {"gpu_count": len(gpus), "gpu_memory_gib": round(first["memory_total_bytes"] / GiB, 1),
                 "supports_bf16": first["supports_bf16"], "supports_tf32": first["supports_tf32"]}
    spec = first["spec"] or {}
    for key in ("peak_bf16_tflops", "peak_fp16_tflops", "memory_bandwidth_gbs"):
        overrides[key] = spec.get(key, 0.0)
    if spec:
        return overrides, f"the driver (count, memory, bf16/TF32) and the spec table for {spec['name']} ({spec['source']})"
    return overrides, (f"the driver (count, memory, bf16/TF32); {first['name']} is not in the spec table, so its peaks "
                       "are unknown (0: MFU and roofline n/a): --set peak_bf16_tflops=, peak_fp16_tflops=, "
                       "memory_bandwidth_gbs= from its datasheet")


def profile_mismatches(hardware, gpus: list[dict], dtype: str) -> list[str]:
    """Where the profile's hardware facts (``hardware``: its ``workbook.hardware.Hardware``) disagree with
    the detected GPU and the spec table, and whether the GPU runs ``dtype``."""
    if not gpus:
        return [] if hardware.gpu_count == 0 else [
            f"profile '{hardware.profile}' expects {hardware.gpu_count} GPU(s) but none was detected"]
    problems = []
    if hardware.gpu_count != len(gpus):
        problems.append(f"profile expects {hardware.gpu_count} GPU(s), detected {len(gpus)}")
    gpu = gpus[0]
    memory_gib = gpu["memory_total_bytes"] / GiB
    if abs(hardware.gpu_memory_gib - memory_gib) > 0.1 * max(hardware.gpu_memory_gib, 1e-9):
        problems.append(f"profile says {hardware.gpu_memory_gib:g} GiB per GPU, detected {memory_gib:.1f} GiB")
    spec = gpu["spec"]
    if spec:
        for key in ("peak_bf16_tflops", "peak_fp16_tflops", "memory_bandwidth_gbs"):
            stated = getattr(hardware, key)
            if abs(stated - spec[key]) > 0.01 * max(spec[key], 1e-9):
                problems.append(f"profile says {key}={stated:g}, the spec table says {spec[key]:g} "
                                f"for {spec['name']} ({spec['source']}); override with --set {key}={spec[key]:g}")
    if dtype == "bf16" and not gpu["supports_bf16"]:
        problems.append(f"dtype bf16 requested but {gpu['name']} (compute capability "
                        f"{gpu['compute_capability']}) has no bf16; use --set dtype=fp16")
    return problems
