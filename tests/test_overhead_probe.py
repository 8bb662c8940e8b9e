"""The CUDA context probe: what it runs and reads (on CPU, with a stand-in reading), and how its constant
lands in the profile."""

import json
import shutil

import pytest
import torch

from workbook import params
from workbook.paths import PARAMS_DIR
from workbook.planner import overhead_probe
from workbook.units import GiB


def test_the_constant_is_the_largest_reading_after_each_stage_of_a_job():
    readings = iter([1 * GiB, 3 * GiB, 2 * GiB, 2 * GiB, 3 * GiB])  # a stage's modules load; the context never shrinks
    measured = overhead_probe.measure("tiny", torch.device("cpu"), read=lambda device: next(readings))
    assert list(measured["readings_bytes"]) == list(overhead_probe.STAGES)
    assert measured["overhead_bytes"] == 3 * GiB
    # Packed rows ran through the trainer's packed attention (document sdpa on CPU; flex attention on a GPU).
    assert measured["packed_attention"] == "document_sdpa" and "packed_attention_failed" not in measured
    assert measured["model"].startswith("tiny (2 layers at full width")


def test_apply_writes_the_measured_constant_into_its_profile_line_and_nothing_else(tmp_path):
    shutil.copy(PARAMS_DIR / "h100.yaml", tmp_path / "h100.yaml")
    before = (tmp_path / "h100.yaml").read_text().splitlines()
    result = {"profile": "h100", "overhead_bytes": int(0.73 * GiB), "hardware_name": "NVIDIA H100 80GB HBM3",
              "date": "2026-11-24", "torch": "2.11.0+cu130"}
    (tmp_path / "cuda_overhead.json").write_text(json.dumps(result))
    overhead_probe.apply(tmp_path / "cuda_overhead.json", params_dir=tmp_path)
    after = (tmp_path / "h100.yaml").read_text().splitlines()
    # The profile took the schema's prior: the measured constant becomes a line of its own, at the end.
    assert after[:-1] == before
    assert after[-1].startswith("cuda_overhead_gib: 0.73   # CUDA context + workspaces, measured on NVIDIA H100")
    assert params.load(tmp_path / "h100.yaml")["cuda_overhead_gib"] == 0.73
    # Measured again: that line is rewritten, nothing else.
    overhead_probe.apply(measured_result(tmp_path, int(0.61 * GiB)), params_dir=tmp_path)
    again = (tmp_path / "h100.yaml").read_text().splitlines()
    assert again[:-1] == before and again[-1].startswith("cuda_overhead_gib: 0.61   #")


def test_without_a_gpu_the_probe_says_where_to_run_it(tmp_path, capsys):
    assert overhead_probe.main(["--profile", "h100", "--out", str(tmp_path)]) == 2
    assert "run it on the GPU the profile describes" in capsys.readouterr().err
    assert not (tmp_path / overhead_probe.RESULT_FILE).exists()


@pytest.mark.slow
def test_the_constant_is_the_largest_reading_even_when_a_later_stage_reads_less():
    # A stage may free a workspace it held; the job still reaches the peak: the largest reading, not the last.
    readings = iter([1 * GiB, 2 * GiB, 4 * GiB, 3 * GiB, 3 * GiB])
    measured = overhead_probe.measure("tiny", torch.device("cpu"), read=lambda device: next(readings))
    assert measured["overhead_bytes"] == 4 * GiB


def measured_result(tmp_path, overhead_bytes):
    result = {"profile": "h100", "overhead_bytes": overhead_bytes, "hardware_name": "NVIDIA H100 80GB HBM3",
              "date": "2026-11-24", "torch": "2.11.0+cu130"}
    (tmp_path / "cuda_overhead.json").write_text(json.dumps(result))
    return tmp_path / "cuda_overhead.json"


def test_apply_refuses_a_profile_with_two_cuda_overhead_lines_and_leaves_it_as_it_was(tmp_path):
    # Which line would the planner read? Neither is rewritten; the error says why.
    text = (PARAMS_DIR / "h100.yaml").read_text() + "cuda_overhead_gib: 0.6\ncuda_overhead_gib: 0.7\n"
    (tmp_path / "h100.yaml").write_text(text)
    with pytest.raises(ValueError, match="expected one 'cuda_overhead_gib:' line, found 2"):
        overhead_probe.apply(measured_result(tmp_path, int(0.73 * GiB)), params_dir=tmp_path)
    assert (tmp_path / "h100.yaml").read_text() == text


def test_apply_names_the_profiles_line_when_the_constant_it_writes_is_invalid_and_keeps_the_old_one(tmp_path):
    # A probe's reading gone negative (a stand-in's bug, a corrupted file) is no CUDA overhead.
    shutil.copy(PARAMS_DIR / "h100.yaml", tmp_path / "h100.yaml")
    with pytest.raises(params.ParamsError, match=r"h100.yaml:\d+: 'cuda_overhead_gib' is -0.5"):
        overhead_probe.apply(measured_result(tmp_path, -GiB // 2), params_dir=tmp_path)
    # ... and leaves the profile as it was, so it still loads.
    assert (tmp_path / "h100.yaml").read_text() == (PARAMS_DIR / "h100.yaml").read_text()
