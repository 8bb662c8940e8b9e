"""The typed hardware object a job builds once from its profile."""

import pytest

from workbook import gpu, params
from workbook.hardware import Hardware


def test_hardware_holds_the_profile_gpu_facts_from_the_spec_row():
    hardware = Hardware.from_params(params.load("params/h100.yaml"))
    assert hardware.gpu_count == 1 and hardware.has_gpu
    assert hardware.gpu_memory_gib == params.load("params/h100.yaml")["gpu_memory_gib"]
    assert gpu.dense_peak_tflops(hardware, "bf16") > 0 and hardware.memory_bandwidth_gbs > 0


def test_cpu_profile_has_no_gpu():
    hardware = Hardware.from_params(params.load("params/cpu.yaml"))
    assert not hardware.has_gpu and hardware.gpu_count == 0


def test_settings_of_names_a_key_the_params_lack():
    stated = dict(params.load("params/cpu.yaml"))
    del stated["usd_per_gpu_hour"]
    with pytest.raises(params.ParamsError, match="usd_per_gpu_hour"):
        Hardware.from_params(stated)
