"""An NVML sampler: every GPU's utilization, memory, power and SM clock on a thread while a point runs.

NVML's utilization is the share of time some kernel ran, not how much of the chip it used: it is
reported under that name, and efficiency is judged by the roofline fractions instead.
"""

from __future__ import annotations

import statistics
import threading
import time

NVML_INTERVAL_SECONDS = 0.1
# Each reading alone: one a GPU does not support (power or utilization under MIG, say) is left out of
# every sample and named in the summary, and the others go on.
READINGS = {
    "kernel_time_percent": lambda nvml, handle: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
    "memory_used_bytes": lambda nvml, handle: nvml.nvmlDeviceGetMemoryInfo(handle).used,
    "power_watts": lambda nvml, handle: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
    "sm_clock_mhz": lambda nvml, handle: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
}


class NvmlSampler:
    """Samples every GPU's utilization (share of time a kernel ran), memory used, power and SM
    clock on a thread while a point runs. ``nvml``: the pynvml module (tests pass a fake); on a
    machine without NVML ``summary()`` says it is unavailable and why."""

    def __init__(self, nvml=None, interval_seconds: float = NVML_INTERVAL_SECONDS):
        self.interval_seconds = interval_seconds
        self.samples: list[dict] = []
        self.reason: str | None = None
        self.unsupported: dict[str, str] = {}  # a reading that failed: why, and it is not read again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list = []
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            self.nvml = nvml
            if not self._handles:
                self.reason = "NVML reports no GPU"
        except Exception as error:  # ImportError, NVMLError_LibraryNotFound, driver not loaded
            self.nvml, self.reason = None, f"NVML unavailable ({type(error).__name__}: {error})".strip()

    @property
    def available(self) -> bool:
        return self.nvml is not None and bool(self._handles)

    def sample_once(self) -> None:
        now = time.perf_counter()
        for index, handle in enumerate(self._handles):
            sample = {"t": now, "gpu": index}
            for key, read in READINGS.items():
                sample[key] = None
                if key in self.unsupported:
                    continue
                try:
                    sample[key] = read(self.nvml, handle)
                except Exception as error:  # NVMLError_NotSupported (power, utilization under MIG), ...
                    self.unsupported[key] = f"{type(error).__name__}: {error}"
            self.samples.append(sample)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as error:  # a reading failed mid-run: keep what was sampled
                self.reason = f"sampling stopped: {type(error).__name__}: {error}"
                return
            self._stop.wait(self.interval_seconds)

    def __enter__(self) -> "NvmlSampler":
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.available:
            return {"available": False, "reason": self.reason, "samples": 0}

        def stats(key):
            values = [s[key] for s in self.samples if s[key] is not None]
            return {"mean": statistics.fmean(values), "max": max(values)} if values else None

        return {"available": True, "samples": len(self.samples), "interval_seconds": self.interval_seconds,
                **{key: stats(key) for key in READINGS}, "unsupported": self.unsupported, "reason": self.reason,
                "what": "NVML 'utilization.gpu': share of time at least one kernel ran; not efficiency "
                        "(see the roofline fractions)"}
