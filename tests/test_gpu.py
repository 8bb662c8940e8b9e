"""GPU detection, the spec table and profile selection.

Without a GPU, the GPU code paths run against FAKE NVML / torch.cuda objects (marked as such):
they prove the parsing and selection logic, not the readings of a real device.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from workbook import gpu, params
from workbook.hardware import Hardware
from workbook.paths import PARAMS_DIR

GIB = 2**30


class FakeNvml:
    """FAKE stand-in for pynvml with the calls gpu.read_nvml_gpus makes."""

    def __init__(self, name, count, memory_mib, capability=(9, 0)):
        self.name, self.count, self.memory_mib, self.capability = name, count, memory_mib, capability
        self.shut_down = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut_down = True
    def nvmlSystemGetDriverVersion(self): return b"550.54.15"
    def nvmlSystemGetCudaDriverVersion(self): return 12040
    def nvmlDeviceGetCount(self): return self.count
    def nvmlDeviceGetHandleByIndex(self, index): return index
    def nvmlDeviceGetName(self, handle): return self.name
    def nvmlDeviceGetCudaComputeCapability(self, handle): return self.capability

    def nvmlDeviceGetMemoryInfo(self, handle):
        total = self.memory_mib * 2**20
        return SimpleNamespace(total=total, free=total - 600 * 2**20, used=600 * 2**20)


class FakeCuda:
    """FAKE stand-in for torch.cuda."""

    def __init__(self, name, count, total_bytes, capability=(8, 0)):
        self.name, self.count, self.total, self.capability = name, count, total_bytes, capability

    def is_available(self): return self.count > 0
    def device_count(self): return self.count

    def get_device_properties(self, index):
        return SimpleNamespace(name=self.name, major=self.capability[0], minor=self.capability[1])

    def mem_get_info(self, index): return (self.total // 2, self.total)


def fake_gpus(name, count, memory_mib, capability=(9, 0)):
    return gpu.read_nvml_gpus(FakeNvml(name, count, memory_mib, capability))[0]


def test_detect_without_gpu_reports_cpu_facts_and_versions():
    info = gpu.detect()
    if info["gpus"]:
        pytest.skip("a GPU is present: the CPU-only path does not apply")
    assert info["gpu_count"] == 0
    assert info["cpu"]["logical_cores"] >= 1 and info["cpu"]["ram_bytes"] > 2**30
    assert info["versions"]["torch"] and info["versions"]["transformers"].startswith("5.")
    assert info["versions"]["flash-attn"] == "not installed"  # not on this CPU image: continuous runs sdpa
    assert gpu.select_profile(info["gpus"], params.load_all()).profile == "cpu"


def test_fake_nvml_readings_are_parsed():
    nvml = FakeNvml("NVIDIA H200", 2, 143771, (9, 0))
    gpus, driver = gpu.read_nvml_gpus(nvml)
    assert nvml.shut_down and driver == {"driver_version": "550.54.15", "cuda_driver_version": "12.4"}
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["memory_total_bytes"] == 143771 * 2**20
    assert gpus[0]["compute_capability"] == "9.0" and gpus[0]["supports_bf16"] and gpus[0]["supports_tf32"]
    assert gpus[0]["spec"]["name"] == "H200 SXM"
    detected = gpu.detect(nvml=FakeNvml("Tesla V100-SXM2-32GB", 1, 32510, (7, 0)))
    assert detected["gpus"][0]["supports_bf16"] is False and detected["driver_version"] == "550.54.15"


def test_fake_torch_cuda_is_the_fallback_when_nvml_is_missing():
    class NoNvml:
        def nvmlInit(self): raise OSError("NVML Shared Library Not Found")
    info = gpu.detect(nvml=NoNvml(), cuda=FakeCuda("NVIDIA A100-SXM4-40GB", 1, 40960 * 2**20))
    assert info["gpus"][0]["read_by"] == "torch" and info["gpus"][0]["supports_bf16"]
    assert any("NVML unavailable" in note for note in info["notes"])


# Driver names as nvidia-smi prints them, and the memory it reports (MiB).
DRIVER_NAMES = {
    "h200": ("NVIDIA H200", 1, 143771),
    "h100": ("NVIDIA H100 80GB HBM3", 1, 81559),
    "h100x8": ("NVIDIA H100 80GB HBM3", 8, 81559),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 1, 81920),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 1, 40960),
    "a6000": ("NVIDIA RTX A6000", 1, 49140),
    "v100": ("Tesla V100-SXM2-32GB", 1, 32510),
}


@pytest.mark.parametrize("profile", sorted(DRIVER_NAMES))
def test_each_gpu_profile_is_chosen_exactly_for_its_gpu_and_agrees_with_the_spec_table(profile):
    name, count, memory_mib = DRIVER_NAMES[profile]
    capability = (7, 0) if "V100" in name else (8, 0)
    gpus = fake_gpus(name, count, memory_mib, capability)
    choice = gpu.select_profile(gpus, params.load_all())
    assert (choice.profile, choice.exact) == (profile, True), choice.reason
    loaded = params.load(PARAMS_DIR / f"{profile}.yaml")
    assert gpu.profile_mismatches(Hardware.from_params(loaded), gpus, loaded["dtype"]) == []


def test_gpus_without_an_exact_profile_get_the_nearest_loudly():
    profiles = params.load_all()
    four = gpu.select_profile(fake_gpus("NVIDIA H100 80GB HBM3", 4, 81559), profiles)
    assert four.profile == "h100" and not four.exact and "expects 1 GPU(s)" in four.reason
    pcie_gpus = fake_gpus("NVIDIA H100 PCIe", 1, 81559)
    pcie = gpu.select_profile(pcie_gpus, profiles)
    assert pcie.profile == "h100" and not pcie.exact and "NO EXACT PROFILE" in pcie.reason
    problems = gpu.profile_mismatches(Hardware.from_params(profiles["h100"]), pcie_gpus, profiles["h100"]["dtype"])
    assert any("memory_bandwidth_gbs=2000" in p for p in problems)
    unknown = gpu.select_profile(fake_gpus("NVIDIA B200", 1, 183359), profiles)
    assert unknown.profile == "h200" and not unknown.exact
    # An H100 NVL (94 GB) is nearer the A100 80GB by memory, whose peak (MFU's yardstick) is 37% of its own.
    nvl = gpu.select_profile(fake_gpus("NVIDIA H100 NVL", 1, 95830), profiles)
    assert nvl.profile == "h100" and not nvl.exact
    # Never a profile with more memory than the GPU when a smaller one exists: a plan must fit.
    small = gpu.select_profile(fake_gpus("NVIDIA GeForce RTX 4090", 1, 24564), profiles)
    assert profiles[small.profile]["gpu_memory_gib"] == min(p["gpu_memory_gib"] for p in profiles.values()
                                                            if p["gpu_count"])


def test_auto_runs_the_nearest_profile_with_the_detected_gpus_own_figures(monkeypatch):
    # An H100 PCIe under 'h100' used to measure MFU and the roofline against the SXM's 989 TFLOP/s and
    # 3.35 TB/s: its own are 756.5 and 2.0 (a third off both). The profile's run settings stay; --set wins.
    from workbook import runner
    gpus = fake_gpus("NVIDIA H100 PCIe", 2, 81559)
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": gpus})
    said = []
    loaded, path, _ = runner.resolve_params("auto", ["memory_bandwidth_gbs=1900"], log=said.append)
    assert path.endswith("h100.yaml") and loaded["profile"] == "h100"
    assert (loaded["peak_bf16_tflops"], loaded["peak_fp16_tflops"], loaded["gpu_count"]) == (756.5, 756.5, 2)
    assert loaded["memory_bandwidth_gbs"] == 1900 and loaded["gpu_memory_gib"] == 79.6
    assert loaded["max_new_tokens"] == params.load(PARAMS_DIR / "h100.yaml")["max_new_tokens"]
    assert any("spec table for H100 PCIe" in line for line in said)
    assert gpu.profile_mismatches(Hardware.from_params({**loaded, "memory_bandwidth_gbs": 2000}), gpus,
                                  loaded["dtype"]) == []

    # Not in the spec table: count and memory are the driver's; no other GPU's peaks stand in for its own.
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": fake_gpus("NVIDIA B200", 1, 183359)})
    said.clear()
    loaded = runner.resolve_params("auto", ["peak_fp16_tflops=2250"], log=said.append)[0]
    assert loaded["profile"] == "h200" and loaded["gpu_memory_gib"] == 179.1
    assert (loaded["peak_bf16_tflops"], loaded["memory_bandwidth_gbs"], loaded["peak_fp16_tflops"]) == (0, 0, 2250)
    assert any("not in the spec table" in line and "--set peak_bf16_tflops=" in line for line in said)

    # An exact match keeps its profile untouched.
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": fake_gpus("NVIDIA H100 80GB HBM3", 1, 81559)})
    assert runner.resolve_params("auto", [], log=said.append)[0] == params.load(PARAMS_DIR / "h100.yaml")


def test_a_gpu_without_bf16_under_a_bf16_profile_runs_fp16(monkeypatch):
    from workbook import runner
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": fake_gpus("Tesla T4", 1, 15360, capability=(7, 5))})
    said = []
    loaded = runner.resolve_params("auto", [], log=said.append)[0]
    assert loaded["gpu_count"] == 1 and not loaded["supports_bf16"]
    assert loaded["dtype"] in ("fp16", "fp32") and "NO EXACT PROFILE" in said[0]


def test_spec_table_covers_the_common_rental_gpus_with_sources():
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB",
                 "NVIDIA A100-SXM4-80GB", "NVIDIA RTX A6000", "NVIDIA L40S", "Tesla V100-SXM2-32GB",
                 "NVIDIA GeForce RTX 4090"):
        spec = gpu.spec_for_name(name)
        assert spec is not None and spec.source and spec.memory_bandwidth_gbs > 0, name
    assert gpu.spec_for_name("NVIDIA H100 PCIe").memory_bandwidth_gbs == 2000
    assert gpu.spec_for_name("NVIDIA A100 80GB PCIe").memory_bandwidth_gbs == 1935


@pytest.mark.slow
def test_cli_gpu_json():
    result = subprocess.run([sys.executable, "-m", "workbook", "gpu", "--json"], capture_output=True,
                            text=True, check=True)
    info = json.loads(result.stdout)
    assert {"gpus", "cpu", "versions", "profile", "driver_version"} <= set(info)
    assert info["profile"]["name"] in params.profile_names()


def test_tf32_is_set_and_read_through_the_api_transformers_uses_without_mixing_the_two():
    # transformers' Trainer sets TF32 through torch's fp32_precision; after that the legacy allow_tf32 flag
    # raises when read. The workbook's switch and its reading must work after either (settable on CPU too).
    import torch
    from workbook import runtime
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # as the Trainer does with tf32=True
        assert runtime.tf32_enabled()
        runtime.set_tf32(False)
        assert not runtime.tf32_enabled() and torch.backends.cudnn.conv.fp32_precision == "ieee"
        runtime.set_tf32(True)
        assert runtime.tf32_enabled()
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_a_turing_gpu_under_auto_takes_the_nearest_profile_in_fp16(monkeypatch):
    # A Quadro RTX 8000 (48 GB, no bf16) lands on the a6000 profile, which runs bf16: auto switches to fp16.
    from workbook import runner
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": fake_gpus("Quadro RTX 8000", 1, 48000, capability=(7, 5))})
    loaded = runner.resolve_params("auto", [], log=lambda line: None)[0]
    assert loaded["profile"] == "a6000" and loaded["dtype"] == "fp16" and not loaded["supports_bf16"]


def test_an_exact_match_runs_its_profile_as_written_even_when_the_driver_reads_a_little_less_memory(monkeypatch):
    # Within 10% is the same GPU (drivers and ECC report a little less); the profile's figures are the reference.
    from workbook import runner
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": fake_gpus("NVIDIA H100 80GB HBM3", 1, 78000)})
    said = []
    loaded = runner.resolve_params("auto", [], log=said.append)[0]
    assert loaded == params.load(PARAMS_DIR / "h100.yaml")
    assert said[0].startswith("profile: ") and not any("hardware figures" in line for line in said)
