"""The shell commands on a bare GPU image: rented machines (and our H200) often have torch,
transformers, accelerate, matplotlib, pyyaml and tqdm but not the notebook stack or NVML's
bindings. `python -m workbook plan/gpu/bench` must work there, with `PYTHONPATH=lib` alone."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbook.paths import REPO_ROOT

# Packages a bare GPU image lacks; importing any of them in the child fails as if not installed.
ABSENT = ("papermill", "nbclient", "nbformat", "ipywidgets", "IPython", "ipykernel", "jupyterlab", "pynvml",
          "playwright")
BLOCKER = f"""
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not on a bare GPU image)")
sys.meta_path.insert(0, _Absent())
sys.argv = ["workbook"] + sys.argv[1:]
import runpy
runpy.run_module("workbook", run_name="__main__")
"""


def bare_workbook(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_gpu_and_plan_run_without_the_notebook_stack_or_nvml():
    detected = bare_workbook("gpu", "--json")
    assert detected.returncode == 0, detected.stderr
    assert json.loads(detected.stdout)["profile"]["name"] == "cpu"
    planned = bare_workbook("plan", "--model", "llama-3.1-8b", "--profile", "h200", "--mode", "generate",
                            "--prompt-len", "512", "--new-tokens", "2048", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["params"] == 8_030_261_248 and plan["kv_cache_bytes_per_token"] == 131_072


@pytest.mark.notebook
def test_bench_runs_without_the_notebook_stack_and_writes_its_report(tiny_model_path):
    done = bare_workbook("bench", "--params", "cpu", "--set", "bench_strategies=seed-before,static-sorted",
                         "bench_batch_sizes=8", "bench_examples=8", "bench_repeats=1", "bench_train_steps=0")
    assert done.returncode == 0, done.stderr
    run_dir = Path(re.search(r"wrote (\S+)/benchmark\.json", done.stdout).group(1))
    try:
        report = json.loads((run_dir / "benchmark.json").read_text())
        sorted_point = next(p for p in report["generation"]["points"] if p["strategy"] == "static-sorted")
        assert sorted_point["identical_to_one_at_a_time"] == 8 and report["training"] is None
        assert "NVML unavailable" in sorted_point["nvml"]["reason"]
        assert (run_dir / "bench_throughput.png").stat().st_size > 10_000
        assert report["command"].startswith("workbook bench --params cpu --set")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
