"""What the device at hand can really do, measured: the copy bandwidth (a large device-to-device copy,
bytes read + written over its time) and the dense matmul throughput (bf16 on a GPU, fp32 on a CPU),
each the best of a few timed repeats after a warm-up, beside the datasheet figures of a profile.

Datasheet peaks are never reached (an H100's 3.35 TB/s copies at roughly 85-90%), so a roofline
fraction over the datasheet mixes the engine's waste with the hardware's; over the measured
ceiling it is the engine's alone. The benchmarks state both::

    workbook ceilings --profile h100 --out outputs/reference/h100   # ceilings.json + .md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from workbook import gpu, runtime
from workbook import params as params_module
from workbook.hardware import Hardware

RESULT_FILE = "ceilings.json"
# Sizes: large enough that launch overheads and caches do not count (a GPU's L2 is tens of MiB),
# small enough for any GPU of the profiles; a CPU gets sizes that take a fraction of a second.
GPU_COPY_BYTES, GPU_MATMUL_SIZE = 2 * 2 ** 30, 8192
GPU_RUNS_PER_SAMPLE = 10  # a GPU sample times this many runs back to back (each ~1.5 ms)
CPU_COPY_BYTES, CPU_MATMUL_SIZE = 128 * 2 ** 20, 2048


@dataclasses.dataclass
class Ceilings:
    copy_bytes_per_second: float  # bytes read + written per second
    matmul_flops_per_second: float
    matmul_dtype: str
    copy_bytes: int  # the size of the copied tensor (the traffic is twice that)
    matmul_size: int  # n of the n x n x n matmul
    repeats: int
    device: str
    runs_per_sample: int = 1  # back to back between two synchronizations: a GPU's launch and sync left out

    @property
    def how(self) -> str:
        each = f" of {self.runs_per_sample} back-to-back runs" if self.runs_per_sample > 1 else ""
        return (f"measured on {self.device}: a {self.copy_bytes / 2 ** 20:,.0f} MiB device-to-device copy "
                f"(read + write) and a {self.matmul_size}^3 {self.matmul_dtype} matmul, best of {self.repeats}"
                f"{each}")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "copy_gb_per_second": self.copy_bytes_per_second / 1e9,
                "matmul_tflops": self.matmul_flops_per_second / 1e12, "how": self.how}


def measure(device: torch.device | str | None = None, *, dtype: torch.dtype | None = None,
            copy_bytes: int | None = None, matmul_size: int | None = None, repeats: int = 5) -> Ceilings:
    """The device's copy bandwidth and matmul throughput (defaults: bf16 and the GPU sizes on CUDA,
    fp32 and the CPU sizes elsewhere)."""
    device = torch.device(device) if device is not None else runtime.default_device()
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    copy_bytes = copy_bytes or (GPU_COPY_BYTES if cuda else CPU_COPY_BYTES)
    size = matmul_size or (GPU_MATMUL_SIZE if cuda else CPU_MATMUL_SIZE)
    source = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    # A GPU copies 2 GiB or multiplies 8192^3 in ~1.5 ms, where a launch and a synchronization cost tens of
    # microseconds: each sample times several runs back to back. A CPU's take seconds: one.
    runs = GPU_RUNS_PER_SAMPLE if cuda else 1
    copy_seconds = _best_seconds(lambda: target.copy_(source), device, repeats, runs)
    del source, target
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    matmul_seconds = _best_seconds(lambda: a @ b, device, repeats, runs)
    del a, b
    if cuda:  # hand the blocks back: a later peak-memory reading must not count them
        torch.cuda.empty_cache()
    return Ceilings(copy_bytes_per_second=2 * copy_bytes / copy_seconds,
                    matmul_flops_per_second=2 * size ** 3 / matmul_seconds,
                    matmul_dtype=str(dtype).removeprefix("torch."), copy_bytes=copy_bytes, matmul_size=size,
                    repeats=repeats, device=runtime.device_description(device), runs_per_sample=runs)


def _best_seconds(work, device: torch.device, repeats: int, runs: int = 1) -> float:
    """Seconds of one run of ``work``: the fastest of ``repeats`` samples, each ``runs`` runs back to
    back, after one untimed run (allocator, kernel selection, clocks ramping up)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        runtime.synchronize(device)
        began = time.perf_counter()
        for _ in range(runs):
            work()
        runtime.synchronize(device)
        best = min(best, (time.perf_counter() - began) / runs)
    return best


def against_datasheet(ceilings: Ceilings, hardware: Hardware) -> dict:
    """Each measured ceiling as a share of the profile's datasheet figure (None where the profile
    states none, as the cpu profile does)."""
    bandwidth = hardware.memory_bandwidth_gbs or 0
    tflops = gpu.dense_peak_tflops(hardware, ceilings.matmul_dtype)
    return {"profile": hardware.profile, "datasheet_bandwidth_gbs": bandwidth or None,
            "datasheet_tflops": tflops or None,
            "copy_share_of_datasheet": ceilings.copy_bytes_per_second / 1e9 / bandwidth if bandwidth else None,
            "matmul_share_of_datasheet": ceilings.matmul_flops_per_second / 1e12 / tflops if tflops else None}


def load(folder: str | Path) -> dict | None:
    """The ceilings recorded in ``folder`` (``ceilings.json``), or None."""
    path = Path(folder) / RESULT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def markdown(record: dict) -> str:
    measured, sheet = record["measured"], record["datasheet"]

    def share(value):
        return "n/a (the profile states no figure)" if value is None else f"{value:.1%}"

    return "\n".join([
        f"`{record['command']}`", "", f"{measured['how']}.", "",
        "| ceiling | measured | datasheet | measured / datasheet |", "|---|---|---|---|",
        f"| copy bandwidth (read + write) | {measured['copy_gb_per_second']:,.0f} GB/s | "
        f"{sheet['datasheet_bandwidth_gbs'] or 'n/a'} GB/s | {share(sheet['copy_share_of_datasheet'])} |",
        f"| dense matmul ({measured['matmul_dtype']}) | {measured['matmul_tflops']:,.1f} TFLOP/s | "
        f"{sheet['datasheet_tflops'] or 'n/a'} TFLOP/s | {share(sheet['matmul_share_of_datasheet'])} |", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbook ceilings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the profile whose datasheet figures go beside, e.g. h100")
    parser.add_argument("--out", required=True, help="output folder, e.g. outputs/reference/h100")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copy-mib", type=int, help="size of the copied tensor (default: 2048 on a GPU, 128 on a CPU)")
    parser.add_argument("--matmul-size", type=int, help="n of the n^3 matmul (default: 8192 on a GPU, 2048 on a CPU)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    hardware = Hardware.from_params(params_module.load(params_module.profile_path(args.profile)))
    ceilings = measure(repeats=args.repeats, copy_bytes=args.copy_mib and args.copy_mib * 2 ** 20,
                       matmul_size=args.matmul_size)
    record = {"what": "the device's measured copy bandwidth and dense matmul throughput beside the profile's "
                      "datasheet figures", "command": "workbook ceilings " + " ".join(argv),
              "measured": ceilings.to_dict(), "datasheet": against_datasheet(ceilings, hardware),
              "hardware": gpu.detect(), "versions": gpu.software_versions()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    (out / "ceilings.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
