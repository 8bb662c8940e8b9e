"""The runner: notebook selection, failure reporting, exit codes."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from workbook import cli, params, runner
from workbook.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT


def make_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('run_dir = ""')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, path)


def test_only_accepts_number_stem_or_file_name_and_rejects_unknown():
    first = runner.list_notebooks(NOTEBOOKS_DIR)[0]
    for name in (first.stem[:2], first.stem, first.name):
        assert runner.select_notebooks([name], NOTEBOOKS_DIR) == [first]
    with pytest.raises(runner.RunError, match=r"--only 99_nope: no such notebook. Notebooks: 00_gpu_detection"):
        runner.select_notebooks(["99_nope"], NOTEBOOKS_DIR)


@pytest.mark.notebook
def test_a_failing_notebook_stops_the_run_and_points_at_the_cell(tmp_path, monkeypatch, capsys):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    make_notebook(notebooks / "00_fine.ipynb", "import pathlib; pathlib.Path(run_dir, 'fine.txt').write_text('ok')")
    make_notebook(notebooks / "01_broken.ipynb", "x = 1", "raise ValueError('the data file is empty')")
    make_notebook(notebooks / "02_never.ipynb", "print('must not run')")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["run", "--params", "cpu"]) == 1

    out = capsys.readouterr().out
    run_dir = next((tmp_path / "outputs").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert [(e["name"], e["status"]) for e in manifest["notebooks"]] == [("00_fine", "ok"), ("01_broken", "failed")]
    failed = manifest["notebooks"][1]
    assert failed["error"] == "ValueError: the data file is empty" and failed["cell"] == 4
    assert (run_dir / "01_broken.ipynb").exists() and (run_dir / "fine.txt").read_text() == "ok"
    assert "FAILED: 01_broken at cell In [4]: ValueError: the data file is empty" in out
    assert str(run_dir / "01_broken.ipynb") in out


@pytest.mark.notebook
def test_a_kernel_killed_mid_cell_is_reported_at_that_cell(tmp_path, monkeypatch, capsys):
    """As when the system kills the kernel for memory: no cell error comes back, the cell is found anyway."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    make_notebook(notebooks / "00_killed.ipynb", "x = 1", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["run", "--params", "cpu"]) == 1

    out = capsys.readouterr().out
    failed = json.loads((next((tmp_path / "outputs").iterdir()) / "manifest.json").read_text())["notebooks"][0]
    assert failed["cell_index"] == 3 and "os.kill" in failed["cell_source"]  # after papermill's injected cell
    assert "FAILED: 00_killed at cell 4 (papermill's 'Executing Cell 4'): DeadKernelError" in out
    assert "out of memory" in out


def test_bad_params_exit_non_zero_with_a_message(capsys):
    assert cli.main(["run", "--params", "cpu", "--set", "gpu_count=-2"]) == 2
    assert "'gpu_count' is -2; expected an integer >= 0" in capsys.readouterr().err
    assert cli.main(["run", "--params", "params/nope.yaml"]) == 2
    assert "no such parameter file" in capsys.readouterr().err


def test_a_command_run_folder_records_its_start_end_and_resumption(tmp_path):
    # `workbook generate|train|bench` write the manifest `workbook run` writes, so notebook 05 lists them.
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    run_dir = tmp_path / "20261121-000000-cpu"
    run_dir.mkdir()
    run = runner.start_job(run_dir, "generate", cpu, "params/cpu.yaml", ["seed=1", "max_examples=2"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "running" and manifest["pid"] == os.getpid() and manifest["job"] == "generate"
    assert manifest["command"] == "workbook generate --params params/cpu.yaml --set seed=1 max_examples=2"
    assert manifest["params"]["seed"] == 0 and manifest["git"]["commit"]
    (run_dir / "generations.jsonl").write_text("")
    assert runner.finish_job(run, 1) == 1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "incomplete" and manifest["finished_at"] and manifest["hardware"]["cpu"]
    assert runner.job_folder(run_dir / "generations.jsonl", "generate") == run_dir
    assert runner.job_folder(run_dir / "generations.jsonl", "train") is None
    assert runner.job_folder(tmp_path / "elsewhere" / "out.jsonl", "generate") is None

    again = runner.start_job(run_dir, "generate", cpu, "params/cpu.yaml", [])  # the same command, resumed
    runner.finish_job(again, 2, "disk full")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["started_at"] == run.manifest["started_at"] and len(manifest["resumed_at"]) == 1
    assert manifest["status"] == "failed" and manifest["error"] == "disk full"


def test_a_command_that_fails_before_writing_anything_leaves_no_folder(tmp_path):
    (tmp_path / "run").mkdir()
    run = runner.start_job(tmp_path / "run", "bench", params.load(PARAMS_DIR / "cpu.yaml"), "cpu", [])
    assert runner.finish_job(run, 2, "bad prompts file") == 2
    assert not (tmp_path / "run").exists()
    assert runner.finish_job(None, 0) == 0  # no run folder (output_path given): nothing to record


def test_notebooks_run_their_kernel_over_unix_sockets_where_the_path_fits(monkeypatch, tmp_path):
    # TCP on localhost is plain text any local user can reach, and ipykernel warns so in every run's log.
    import tempfile
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", tempfile.mkdtemp(prefix="rt-"))  # /tmp/rt-xxxxxxxx: short
    assert runner._ipc_kernel_manager()(kernel_name="python3").transport == "ipc"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / ("x" * 80)))  # a socket path past 108 bytes
    assert runner._ipc_kernel_manager()(kernel_name="python3").transport == "tcp"


def test_only_runs_notebooks_in_their_own_order_whatever_the_order_typed():
    first, second = runner.list_notebooks(NOTEBOOKS_DIR)[:2]
    assert runner.select_notebooks([second.stem[:2], first.stem[:2]], NOTEBOOKS_DIR) == [first, second]


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path):
    from workbook import notebook
    first, second = notebook.new_run_dir("cpu", tmp_path), notebook.new_run_dir("cpu", tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


def test_a_resumed_run_keeps_every_start_and_its_folder_even_when_it_fails_before_writing(tmp_path, monkeypatch):
    from workbook import gpu
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": []})
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    folder = tmp_path / "resumed"
    folder.mkdir()
    assert runner.finish_job(runner.start_job(folder, "generate", cpu, "cpu", []), 0) == 0
    for _ in range(2):
        resumed = runner.start_job(folder, "generate", cpu, "cpu", ["seed=1"])
    assert runner.finish_job(resumed, 2, "stopped before writing") == 2
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["resumed_at"]) == 2 and manifest["status"] == "failed"
    assert manifest["error"] == "stopped before writing"


@pytest.mark.notebook
def test_a_run_that_passes_records_ok_per_notebook_with_its_seconds_and_the_sets_it_ran_with(
        tmp_path, monkeypatch, capsys):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    make_notebook(notebooks / "00_first.ipynb", "x = 1")
    make_notebook(notebooks / "01_second.ipynb", "y = 2")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["run", "--params", "cpu", "--set", "seed=3"]) == 0

    run_dir = next((tmp_path / "outputs").iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    # Notebook 05 tells a finished run from one still running (or dead) by this status.
    assert manifest["status"] == "ok" and manifest["finished_at"]
    assert [(e["name"], e["status"]) for e in manifest["notebooks"]] == [("00_first", "ok"), ("01_second", "ok")]
    for entry in manifest["notebooks"]:
        assert entry["seconds"] >= 0 and entry["executed_notebook"] == str(run_dir / f"{entry['name']}.ipynb")
    # The record says how to reproduce the run: the --set given and the values it produced.
    assert manifest["overrides"] == ["seed=3"] and manifest["params"]["seed"] == 3
    assert "done: 2 notebook(s)" in capsys.readouterr().out


def test_a_notebook_that_fails_before_any_cell_runs_is_reported_so_with_its_seconds(tmp_path, monkeypatch, capsys):
    # A notebook file that is not JSON fails before its kernel starts: no cell to name.
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    (notebooks / "00_unreadable.ipynb").write_text("not a notebook")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["run", "--params", "cpu"]) == 1

    run_dir = next((tmp_path / "outputs").iterdir())
    [entry] = json.loads((run_dir / "manifest.json").read_text())["notebooks"]
    assert entry["status"] == "failed" and entry["seconds"] >= 0
    assert entry["executed_notebook"] == str(run_dir / "00_unreadable.ipynb")
    out = capsys.readouterr().out
    assert "FAILED: 00_unreadable before any cell ran: " in out and "NotJSONError" in out


def test_only_with_a_partial_number_names_no_notebook():
    # '--only 0' must not quietly run every notebook numbered 0x.
    with pytest.raises(runner.RunError, match=r"--only 0: no such notebook"):
        runner.select_notebooks(["0"], NOTEBOOKS_DIR)


def test_a_job_that_ends_ok_or_incomplete_keeps_its_folder_even_with_only_its_manifest(tmp_path, monkeypatch):
    # Only a job that failed outright leaves no folder; an incomplete one says where its work failed.
    from workbook import gpu
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": []})
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    for code, status in ((0, "ok"), (1, "incomplete")):
        folder = tmp_path / status
        folder.mkdir()
        assert runner.finish_job(runner.start_job(folder, "generate", cpu, "cpu", []), code) == code
        assert json.loads((folder / "manifest.json").read_text())["status"] == status


def test_a_resumed_run_keeps_its_first_start_time_and_lists_each_resumption(tmp_path, monkeypatch):
    # A clock that ticks on every reading: the first start must survive the later ones.
    from workbook import gpu
    monkeypatch.setattr(gpu, "detect", lambda: {"gpus": []})
    ticks = iter(f"2026-01-01T00:00:{second:02d}+00:00" for second in range(60))
    monkeypatch.setattr(runner, "now", lambda: next(ticks))
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    first = runner.start_job(tmp_path, "generate", cpu, "cpu", [])
    runner.finish_job(first, 1)
    runner.start_job(tmp_path, "generate", cpu, "cpu", [])
    runner.finish_job(runner.start_job(tmp_path, "generate", cpu, "cpu", []), 0)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["started_at"] == first.manifest["started_at"] == "2026-01-01T00:00:00+00:00"
    assert len(manifest["resumed_at"]) == 2 and first.manifest["started_at"] not in manifest["resumed_at"]


def write_metrics(run_dir, files):
    for name, data in files.items():
        (run_dir / name).write_text(json.dumps(data))


def test_each_notebook_gets_one_line_with_what_it_did_and_its_headline_figure(tmp_path):
    # Shaped like what each notebook's session.save_json writes (only the keys the line reads).
    write_metrics(tmp_path, {
        "gpu.json": {"detection": {"gpus": [{"name": "NVIDIA H200", "memory_total_bytes": 150 * 2**30}] * 8,
                                   "cpu": {"model": "Xeon", "usable_cores": 96}},
                     "run_profile": "h200", "profile_mismatches": []},
        "memory_plan.json": {"plans": {
            "generate": {"model": "llama", "params": 8030261248, "dtype": "bf16", "max_batch_size": 1234,
                         "budget_bytes": 140 * 2**30},
            "train": {"model": "llama", "params": 8030261248, "dtype": "bf16", "max_batch_size": 8,
                      "budget_bytes": 140 * 2**30}}},
        "generation.json": {"summary": {"generated": 5000, "output_tokens_per_second": 12345.6, "backend": "static",
                                        "batch_size": 256, "processes": 8}},
        "training_metrics.json": {"steps": {"reached": 60, "total": 60},
                                  "loss": {"epoch_means": [2.5, 1.23456]}, "throughput": {"tokens_per_second": 4321.0}},
        "benchmark.json": {
            "generation": {"points": [
                {"strategy": "seed-after", "batch_size": 32, "output_tokens_per_second": {"median": 900.0}},
                {"strategy": "static-sorted", "batch_size": 256, "output_tokens_per_second": {"median": 9000.4}},
                {"strategy": "static-compiled", "batch_size": 256, "skipped": "skipped on CPU"},
                {"strategy": "hf-pipeline", "batch_size": 256, "output_tokens_per_second": {"median": 99999.0}}]},
            "training": {"points": [
                {"micro_batch_size": 8, "padding": "packing", "grad_checkpointing": True, "tokens_per_second": 17000.2},
                {"micro_batch_size": 16, "padding": "packing", "tokens_per_second": 12000.0},
                {"micro_batch_size": 8, "padding": "packing", "torch_compile": True, "tokens_per_second": None}]}},
        "review.json": {"runs": [{"run": "a"}, {"run": "b"}, {"run": "c"}]},
    })
    lines = {name: runner.headline(name, tmp_path) for name in runner.HEADLINES}
    assert lines == {
        "00_gpu_detection": "detected 8 x NVIDIA H200 (150.0 GiB each): profile h200",
        "01_memory_planning": "planned llama with 8,030,261,248 parameters (bf16) per GPU: largest batch 1,234 to "
                              "generate, 8 to train (budget 140.0 GiB)",
        "02_batched_generation": "generated 5,000 examples: 12,346 output tokens/s (static, batch 256, 8 process(es))",
        "03_training": "trained 60 of 60 steps: final loss 1.2346 (mean of the last epoch), 4,321 tokens/s",
        # The HF pipeline is the baseline beside the workbook's strategies, never its best point.
        "04_benchmarking": "benchmarked: best generation static-sorted at batch 256: 9,000 output tokens/s; "
                           "best training micro-batch 8 (packing, checkpointing): 17,000 tokens/s",
        "05_review_runs": "reviewed 3 run(s) side by side",
    }
    assert runner.notebook_line("03_training", 75.25, lines["03_training"], width=22) == \
        "03_training                75.2 s  trained 60 of 60 steps: final loss 1.2346 (mean of the last epoch), 4,321 tokens/s"


def test_a_missing_or_unreadable_metrics_file_is_named_in_the_line_instead_of_failing_the_run(tmp_path):
    assert runner.headline("02_batched_generation", tmp_path) == "ok, but it wrote no generation.json"
    write_metrics(tmp_path, {"gpu.json": {"detection": {"gpus": []}}, "review.json": {"runs": None}})
    assert runner.headline("00_gpu_detection", tmp_path) == \
        "ok, but gpu.json has no headline figure (KeyError: 'cpu')"
    assert runner.headline("05_review_runs", tmp_path).startswith("ok, but review.json has no headline figure (TypeError")
    (tmp_path / "training_metrics.json").write_text("{cut short")
    assert runner.headline("03_training", tmp_path).startswith("ok, but training_metrics.json has no headline figure")
    assert runner.headline("06_my_own", tmp_path) == "ok"  # a notebook the workbook has no line for


def test_the_benchmark_line_leaves_out_the_same_baseline_the_benchmark_names():
    from workbook.bench import counting
    assert runner.HF_PIPELINE == counting.HF_PIPELINE


def test_a_run_says_one_line_per_notebook_with_its_seconds_and_ends_with_the_run_folder(tmp_path, monkeypatch, capsys):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    make_notebook(notebooks / "00_gpu_detection.ipynb", "print('a cell speaking')")
    make_notebook(notebooks / "01_mine.ipynb", "y = 2")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")
    executed = []

    def execute(path, run_dir, parameters, log_output=True):  # papermill's part, without a kernel
        executed.append((path.stem, log_output))
        if path.stem == "00_gpu_detection":
            write_metrics(run_dir, {"gpu.json": {"detection": {"gpus": [], "cpu": {"model": "EPYC", "usable_cores": 2}},
                                                 "run_profile": "cpu", "profile_mismatches": []}})
        return run_dir / path.name

    monkeypatch.setattr(runner, "execute", execute)
    assert cli.main(["run", "--params", "cpu"]) == 0

    run_dir = next((tmp_path / "outputs").iterdir())
    lines = capsys.readouterr().out.splitlines()
    assert executed == [("00_gpu_detection", False), ("01_mine", False)]  # cell output only in the notebooks
    assert lines[0] == (f"running 2 notebook(s) into {run_dir} (each cell's output is in its executed notebook "
                        "there; --verbose prints it here too)")
    assert re.fullmatch(r"00_gpu_detection +\d+\.\d s  detected no GPU \(EPYC, 2 cores\): profile cpu", lines[1])
    assert re.fullmatch(r"01_mine {10} +\d+\.\d s  ok", lines[2])
    assert re.fullmatch(r"done: 2 notebook\(s\) in \d+ s", lines[3]) and lines[4:] == [f"run folder: {run_dir}"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [entry["headline"] for entry in manifest["notebooks"]] == ["detected no GPU (EPYC, 2 cores): profile cpu", "ok"]

    executed.clear()
    assert cli.main(["run", "--params", "cpu", "--only", "01", "--verbose"]) == 0
    assert executed == [("01_mine", True)]
    assert "--- 01_mine.ipynb" in capsys.readouterr().out


@pytest.mark.notebook
def test_cell_output_stays_in_the_executed_notebook_unless_the_run_is_verbose(tmp_path, monkeypatch, capsys, caplog):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    make_notebook(notebooks / "00_speaks.ipynb", "print('a cell speaking')")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(runner, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["run", "--params", "cpu"]) == 0
    brief = capsys.readouterr()
    [run_dir] = (tmp_path / "outputs").iterdir()
    assert len(brief.out.splitlines()) == 4 and brief.out.splitlines()[-1] == f"run folder: {run_dir}"
    assert "a cell speaking" not in brief.out + brief.err + caplog.text
    assert "a cell speaking" in (run_dir / "00_speaks.ipynb").read_text()

    assert cli.main(["run", "--params", "cpu", "--verbose"]) == 0  # papermill logs each cell and its output
    assert "a cell speaking" in caplog.text and "Executing Cell 2" in caplog.text


def make_prints(*args: str) -> str:
    """The command a make target runs with this venv (`make -n`, the set-up step left out)."""
    venv = Path(sys.executable).parent.parent
    printed = subprocess.run(["make", "--no-print-directory", "-n", "-o", f"{venv}/.installed", *args, f"VENV={venv}"],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return printed.strip().splitlines()[-1]


def test_make_run_verbose_brings_the_cells_back_and_make_test_fast_leaves_out_every_slow_kind(pytestconfig):
    assert make_prints("run").endswith("/workbook run --params auto")
    assert make_prints("run", "VERBOSE=1").endswith("/workbook run --params auto --verbose")
    fast = shlex.split(make_prints("test-fast"))
    expression = fast[fast.index("-m", 2) + 1]
    left_out = re.findall(r"not (\w+)", expression)
    assert expression == " and ".join(f"not {marker}" for marker in left_out)
    assert set(left_out) == {"notebook", "multiprocess", "browser", "slow"}
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(left_out) <= registered  # an unregistered marker would select nothing, silently
