"""The notebooks: committed clean, and executed headless on the cpu profile as a user would run them."""

import json
import re
import subprocess
import sys

import nbformat
import pytest

from workbook import arithmetic, bench, notebook, params, runner
from workbook.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_and_literate(path):
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), \
        f"{path.name} has outputs or execution counts: clear them before committing"
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state"
    assert nb.cells[0].cell_type == "markdown" and "papermill" in nb.cells[0].source
    assert "parameters" in nb.cells[1].metadata.get("tags", []), "cell 2 must be the parameters cell"
    assert nb.metadata.kernelspec.name == "python3"


def test_start_rejects_a_parameter_papermill_injected_with_a_typo(tmp_path):
    namespace = {"profile": "cpu", "dtype": "fp32", "dtyp": "bf16", "run_dir": str(tmp_path),
                 "In": ["", "profile = 'cpu'", "# Parameters\ndtyp = \"bf16\"\nrun_dir = \"x\"\n"]}
    with pytest.raises(params.ParamsError, match=r"unknown parameter 'dtyp'. Did you mean 'dtype'"):
        notebook.start(namespace, "00_test")
    del namespace["In"]
    session = notebook.start(namespace, "00_test")
    # Nothing injected (a notebook opened in JupyterLab): the profile its cell names, whole.
    assert session.run_dir == tmp_path and session.params == params.load(PARAMS_DIR / "cpu.yaml")


def parameters_cell_namespace(path, injected: dict) -> dict:
    """A notebook's namespace as papermill leaves it: its parameters cell run, then the cell papermill
    injects (its `# Parameters` header and literals, as papermill writes them) run over it."""
    from papermill.translators import PythonTranslator
    cell = nbformat.read(path, as_version=4).cells[1].source
    injected_cell = "# Parameters\n" + PythonTranslator.codify(injected)
    namespace = {"In": ["", cell, injected_cell]}
    exec(cell, namespace)
    exec(injected_cell, namespace)
    return namespace


@pytest.mark.parametrize("profile", ["cpu", "h100", "h100x8", "v100"])
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if "05_" not in p.name], ids=lambda p: p.stem)
def test_plain_papermill_with_a_profile_runs_with_what_workbook_run_gives_the_notebook(path, profile, tmp_path):
    # `papermill nb.ipynb out.ipynb -f params/<profile>.yaml` injects only what the file states; the
    # runner injects every key the notebook declares, resolved. Both must build the same params.
    import papermill
    import yaml
    file_values = yaml.safe_load((PARAMS_DIR / f"{profile}.yaml").read_text())
    by_papermill = notebook.notebook_params(parameters_cell_namespace(path, file_values), list(file_values), "t")
    resolved, _, _ = runner.resolve_params(profile, [])
    given = runner.notebook_parameters(path, resolved, tmp_path)
    by_runner = notebook.notebook_params(parameters_cell_namespace(path, given), list(given), "t")
    declared = set(papermill.inspect_notebook(str(path))) - {notebook.RUN_DIR_PARAMETER}
    assert {key: by_papermill[key] for key in declared} == {key: by_runner[key] for key in declared} \
        == {key: resolved[key] for key in declared}
    # What the file states beyond the notebook's keys comes as the file loads it (papermill injects it all).
    loaded = params.load(PARAMS_DIR / f"{profile}.yaml")
    assert by_papermill == {key: loaded[key] for key in declared | set(file_values)}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One full `workbook run --params cpu` into a temporary outputs folder, shared by the checks below."""
    return runner.run("cpu", outputs_root=tmp_path_factory.mktemp("outputs"))


@pytest.mark.notebook
def test_full_run_on_cpu_profile_leaves_a_complete_run_folder(cpu_run):
    assert cpu_run.ok, json.dumps(cpu_run.manifest["notebooks"], indent=2)
    manifest = json.loads((cpu_run.run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["profile"] == "cpu"
    assert [entry["name"] for entry in manifest["notebooks"]] == [p.stem for p in NOTEBOOKS]
    assert all(entry["seconds"] > 0 for entry in manifest["notebooks"])
    # `workbook run`'s line per notebook carries its headline figure, read from the metrics it wrote.
    assert not [entry for entry in manifest["notebooks"] if entry["headline"].startswith("ok")], manifest["notebooks"]
    assert manifest["git"]["commit"] and manifest["versions"]["torch"] and manifest["params"]["dtype"] == "fp32"
    assert manifest["started_at"] <= manifest["finished_at"]
    for path in NOTEBOOKS:
        executed = nbformat.read(cpu_run.run_dir / path.name, as_version=4)
        assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
        # Headless: no library progress widget saved at its first frame, reading as a stalled step.
        for cell in (c for c in executed.cells if c.cell_type == "code"):
            text = "".join(output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
                           for output in cell.outputs)
            stalled = [bar for bar in re.findall(r"([\w ]+):\s+0%\|", text) if f"{bar}: 100%|" not in text]
            assert not stalled, (path.name, stalled)


@pytest.mark.notebook
def test_gpu_detection_notebook_writes_gpu_json_and_plot(cpu_run):
    data = json.loads((cpu_run.run_dir / "gpu.json").read_text())
    assert data["run_profile"] == "cpu"
    assert data["profile_choice"]["profile"] in params.profile_names()
    assert data["detection"]["cpu"]["logical_cores"] >= 1
    assert data["model"]["parameters"] > 0 and data["model"]["weights_bytes"] == 4 * data["model"]["parameters"]
    assert (cpu_run.run_dir / "memory_overview.png").stat().st_size > 5000


def papermill(*args, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, "-m", "papermill", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


@pytest.mark.notebook
def test_plain_papermill_with_a_params_file_works_as_a_user_runs_it(tmp_path):
    result = papermill(NOTEBOOKS_DIR / "00_gpu_detection.ipynb", tmp_path / "out.ipynb",
                       "-f", PARAMS_DIR / "cpu.yaml", "-p", "run_dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "gpu.json").read_text())["run_profile"] == "cpu"


@pytest.mark.notebook
def test_plain_papermill_runs_a_notebook_with_exactly_the_params_workbook_run_gives_it(tmp_path):
    # papermill -f injects only what params/cpu.yaml states (the rest is the cell's, the schema's
    # defaults); the runner injects every key the notebook declares, resolved. Each run records what
    # the notebook ran with.
    path = NOTEBOOKS_DIR / "00_gpu_detection.ipynb"
    plain, ran = tmp_path / "plain", tmp_path / "run"
    ran.mkdir()
    result = papermill(path, tmp_path / "plain.ipynb", "-f", PARAMS_DIR / "cpu.yaml", "-p", "run_dir", plain)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved, _, _ = runner.resolve_params("cpu", [])
    runner.execute(path, ran, runner.notebook_parameters(path, resolved, ran))
    record = f"{path.stem}{notebook.PARAMS_RECORD_SUFFIX}"
    by_papermill, by_runner = (json.loads((folder / record).read_text()) for folder in (plain, ran))
    import papermill as papermill_module
    declared = set(papermill_module.inspect_notebook(str(path))) - {notebook.RUN_DIR_PARAMETER}
    assert set(by_runner) == declared and {key: by_papermill[key] for key in declared} == by_runner
    assert by_papermill["dtype"] == resolved["dtype"] == "fp32"  # the file's, not the cell's default (bf16)
    # What the file states beyond the notebook's keys (papermill injects it all) is as the profile loads it.
    assert {key: value for key, value in by_papermill.items() if key not in declared} == \
        {key: resolved[key] for key in by_papermill if key not in declared}


@pytest.mark.notebook
def test_a_notebook_of_a_run_reruns_alone_from_its_parameters_file_without_warnings(cpu_run, tmp_path):
    assert all((cpu_run.run_dir / f"{path.stem}.parameters.yaml").is_file() for path in NOTEBOOKS)
    result = papermill(NOTEBOOKS_DIR / "00_gpu_detection.ipynb", tmp_path / "out.ipynb",
                       "-f", cpu_run.run_dir / "00_gpu_detection.parameters.yaml", "-p", "run_dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Passed unknown parameter" not in result.stderr and (tmp_path / "gpu.json").is_file()


@pytest.mark.notebook
def test_a_typo_passed_to_papermill_fails_loudly_instead_of_doing_nothing(tmp_path):
    result = papermill(NOTEBOOKS_DIR / "00_gpu_detection.ipynb", tmp_path / "out.ipynb",
                       "-f", PARAMS_DIR / "cpu.yaml", "-p", "dtyp", "bf16", "-p", "run_dir", tmp_path)
    assert result.returncode != 0
    assert "unknown parameter 'dtyp'" in result.stderr and "Did you mean 'dtype'" in result.stderr


@pytest.mark.notebook
def test_memory_planning_notebook_writes_plans_tables_and_the_proof(cpu_run):
    data = json.loads((cpu_run.run_dir / "memory_plan.json").read_text())
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    assert set(data["plans"]) == {"generate", "train"}
    generate = data["plans"]["generate"]
    assert generate["batch_size"] == cpu.batch_size and generate["fits"]
    assert sum(term["bytes"] for term in generate["breakdown"]) == generate["total_bytes"]
    beside = data["accelerate_estimate_memory"]  # the command users know, beside each plan
    assert beside["generate"]["planner_bytes"] == generate["total_bytes"]
    assert beside["train"]["bytes"] == beside["train"]["training_bytes"] > beside["generate"]["bytes"]
    rows = data["max_batch_tables"]["generate"]
    assert {"Llama-3.1-8B", "Qwen2.5-0.5B"} <= {row["model"] for row in rows}
    assert all(set(row) >= {"h200", "h100", "a100-40gb", "v100"} for row in rows)
    for mode, batch in (("generate", cpu.batch_size), ("train", cpu.micro_batch_size)):
        proof = data["worst_case_probe"][mode]
        assert proof["device"] == "cpu" and proof["batch_size"] == batch
        assert proof["predicted_bytes"] == data["plans"][mode]["total_bytes"]
    assert data["worst_case_probe"]["generate"]["measurement"]["generated_tokens"] == cpu.max_new_tokens
    for name in ("plan_generate.png", "plan_train.png", "memory_vs_batch_generate.png", "memory_vs_batch_train.png"):
        assert (cpu_run.run_dir / name).stat().st_size > 10_000, name


@pytest.mark.notebook
def test_batched_generation_notebook_generates_every_prompt_and_reports_throughput_and_accuracy(cpu_run):
    data = json.loads((cpu_run.run_dir / "generation.json").read_text())
    summary = data["summary"]
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    assert summary["output_path"] == str(cpu_run.run_dir / "generations.jsonl")
    # The cpu profile samples several answers per question: every (id, sample) is one line.
    assert summary["samples_per_prompt"] == cpu.samples_per_prompt > 1
    assert summary["examples"] * cpu.samples_per_prompt == summary["candidates"] == summary["in_output"] == summary["generated"]
    assert summary["unaccounted"] == 0 and summary["in_failures"] == 0
    assert summary["backend"] == cpu.backend and summary["batch_size"] == cpu.batch_size
    assert summary["examples_per_minute"] > 0 and 0 <= summary["padding_waste"] < 1
    assert len(summary["batch_list"]) == summary["batches"]
    lines = (cpu_run.run_dir / "generations.jsonl").read_text().splitlines()
    assert len(lines) == summary["candidates"]
    assert data["accuracy"]["task"] == "arithmetic" and data["accuracy"]["scored"] == summary["candidates"]
    assert 0 <= data["accuracy"]["accuracy"] <= 1
    assert data["sample"][0]["metadata"]["teacher_model"] == cpu.model
    assert (cpu_run.run_dir / "generation_timeline.png").stat().st_size > 10_000
    # The cpu profile verifies (final_number): every right answer is accepted, and the accepted file
    # keeps one of them per question that has one (max_accepted_per_prompt: 1).
    verification = data["verification"]
    assert verification["candidates"] == summary["candidates"] and verification["verifier_errors"] == 0
    assert verification["accepted_candidates"] == round(data["accuracy"]["accuracy"] * summary["candidates"])
    accepted = [json.loads(line) for line in (cpu_run.run_dir / "generations.accepted.jsonl").read_text().splitlines()]
    assert len(accepted) == verification["written"] == verification["prompts_with_an_accepted_sample"] > 0
    assert len({record["metadata"]["example_id"] for record in accepted}) == len(accepted)
    assert (cpu_run.run_dir / "verification_pass_rates.png").stat().st_size > 10_000


@pytest.mark.notebook
def test_training_notebook_fine_tunes_on_the_run_and_reports_what_it_measured(cpu_run):
    data = json.loads((cpu_run.run_dir / "training_metrics.json").read_text())
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    assert data["status"] == "finished" and data["steps"]["reached"] == data["steps"]["total"] > 0
    # The teacher outputs notebook 02's verifier accepted, in the same run folder, are the default training data.
    assert data["data"]["source"].startswith(str(cpu_run.run_dir / "generations.accepted.jsonl"))
    lengths = data["data"]["token_lengths"]
    assert data["data"]["max_seq_length"] % 64 == 0 and lengths["max"] <= data["data"]["max_seq_length"]
    assert data["data"]["truncation"]["truncated"] == 0 and 0 <= data["plan"]["padding_fraction"] < 0.5
    assert len(data["history"]) == data["steps"]["total"] and data["plan"]["micro_batch_size"] == cpu.micro_batch_size
    # The tiny model already answers ~97% right, so its own teacher outputs are nearly its argmax:
    # the training loss falls (it sharpens on them); the validation loss on 30 examples is reported
    # but moves by noise around ~0.01, so it is only checked to be finite.
    assert data["loss"]["epoch_means"][-1] < data["loss"]["epoch_means"][0]
    assert 0 <= data["loss"]["eval_before"] < 1 and 0 <= data["loss"]["eval_after"] < 1
    assert data["throughput"]["tokens_per_second"] > 0
    assert data["throughput"]["mfu"] is None and data["throughput"]["mfu_note"].startswith("n/a")  # CPU: no peak
    assert data["memory"]["measured"]["peak_bytes"] is None and data["memory"]["predicted_peak_bytes"] > 0
    # One round of rejection-sampling fine-tuning: the held-out questions (disjoint from the sampled
    # pool), scored before and after against their true answers; how much they rise is a benchmark
    # figure (outputs/reference/cpu/rejection_sampling.md), not asserted here.
    held_out = arithmetic.load_prompts(arithmetic.VARIANT_HELD_OUT_PATH)
    assert cpu.eval_prompts_path == "lib/workbook/data/arithmetic_contraction_held_out.jsonl"
    for moment in ("before", "after"):
        assert data["accuracy"][moment]["records"] == len(held_out) == arithmetic.VARIANT_HELD_OUT_SIZE
        assert data["accuracy"][moment]["of"].startswith("held-out prompts of ")
        assert 0 <= data["accuracy"][moment]["accuracy"] <= 1
    assert data["settings"]["torch_compile"] is False and data["settings"]["tf32"] == {"requested": False, "applied": False}
    final = cpu_run.run_dir / "training" / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    for name in ("training_lengths.png", "training_curves.png"):
        assert (cpu_run.run_dir / name).stat().st_size > 10_000, name


@pytest.mark.notebook
def test_benchmarking_notebook_writes_every_point_against_the_limits_and_the_review_lists_the_run(cpu_run):
    data = json.loads((cpu_run.run_dir / "benchmark.json").read_text())
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    assert data["profile"] == "cpu" and data["params"]["bench_examples"] == cpu.bench_examples
    assert data["versions"]["torch"] and data["hardware"]["cpu"]["logical_cores"] >= 1
    points = {(p["strategy"], p["batch_size"]): p for p in data["generation"]["points"]}
    assert ("seed-before", 1) in points and ("seed-after", 32) in points
    # Each point was on disk as soon as it was measured: a notebook stopped part way keeps them.
    streamed = (cpu_run.run_dir / "points.jsonl").read_text().splitlines()
    assert len(streamed) == len(data["generation"]["points"]) + len(data["training"]["points"]) + len(
        data["training"]["baselines"])
    assert all("skipped on CPU" in p["skipped"] for (s, _), p in points.items() if s == "static-compiled")
    assert not bench.failed_points(data)  # every point ran or says why not: none raised
    timed = [p for p in points.values() if "seconds" in p]
    for p in timed:
        assert p["examples"] == cpu.bench_examples and p["failed"] == 0
        assert p["output_tokens"] <= cpu.bench_examples * cpu.bench_max_new_tokens
        # The continuous manager's start is inside the pass (a job pays it once) and recorded beside it.
        assert (p["manager_start_seconds"] > 0) if p["strategy"] == "continuous" else p["manager_start_seconds"] is None
        if p["strategy"] != "continuous":  # static generate honours min_new_tokens: every output full length
            assert p["full_length_outputs"] == cpu.bench_examples
            assert p["output_tokens"] == cpu.bench_examples * cpu.bench_max_new_tokens
        # Greedy on the tiny model in fp32: every strategy gives one-at-a-time generation's tokens.
        assert p["identical_to_one_at_a_time"] == cpu.bench_examples, (p["strategy"], p["batch_size"])
        assert len(p["output_tokens_per_second"]["runs"]) == cpu.bench_repeats
        assert p["output_tokens_per_second"]["min"] <= p["output_tokens_per_second"]["median"] > 0
        # CPU: no peaks, no price, no peak memory: n/a and "not measured", never a made-up number.
        assert p["fraction_of_peak"] == {"bandwidth": None, "compute": None}
        assert p["fraction_of_roofline"] == {"datasheet": None, "measured_ceilings": None}
        assert p["rows_per_batch"] == min(p["batch_size"], cpu.bench_examples)
        assert p["peak_memory_bytes"] is None and p["peak_memory_note"].startswith("not measured")
        assert p["predicted_peak_bytes"] > 0 and p["cost"]["usd_per_1000_examples"] is None
        assert p["nvml"]["available"] is False
    assert points[("seed-after", 32)]["speedup_over_seed_after"] == 1.0
    # 'auto': the planner's batch (RAM on the cpu profile: thousands) capped at the sweep's prompts, and said so.
    planner = data["generation"]["planner_batch"]
    assert planner["planned"] > cpu.bench_examples == planner["batch_size"] and "capped" in planner["note"]
    assert points[("static-sorted", cpu.bench_examples)]["planner_batch"] == planner["note"]
    goals = {row["goal"]: row for row in data["goals"]}
    assert goals[bench.GOALS[0]]["met"] == "n/a" and "no bandwidth peak" in goals[bench.GOALS[0]]["measured"]
    assert f"; {planner['note']})" in goals[bench.GOALS[1]]["measured"]  # then a noise note, where its runs spread
    assert goals[bench.GOALS[1]]["met"] == "n/a: a GPU goal, measured here on a CPU"
    trained = [p for p in data["training"]["points"] if "tokens_per_second" in p]
    assert trained and all(p["tokens_per_second"] > 0 and p["mfu"] is None for p in trained)
    assert len(data["claims"]) >= 8 and all(row["measured"] for row in data["claims"])
    for name in ("bench_throughput.png", "bench_memory.png", "bench_mfu.png", "bench_speedup.png"):
        assert (cpu_run.run_dir / name).stat().st_size > 10_000, name
    # Notebook 05 ran while this run was still going: it is listed as this run (running), not a problem.
    review = json.loads((cpu_run.run_dir / "review.json").read_text())
    mine = [row for row in review["runs"] if row["run"] == f"{cpu_run.run_dir.name} (this run)"]
    assert mine and mine[0]["status"].startswith("running (its last notebook") and "benchmark" in mine[0]["metrics"]
    assert mine[0]["problems"] == ""
    assert any(series["label"].startswith(cpu_run.run_dir.name) for series in review["throughput"])
    assert (cpu_run.run_dir / "review_throughput.png").stat().st_size > 10_000
    # Its generation kept the plan its ETA used, so the review checks that ETA against the time left.
    checked = json.loads((cpu_run.run_dir / "review_eta.json").read_text())["runs"]
    assert any(row["run"].startswith(cpu_run.run_dir.name) for row in checked)


def test_a_column_na_in_every_row_is_named_under_the_table_instead_of_filling_it():
    rows = [{"strategy": "static", "of roofline": "n/a", "tok/s": "10"},
            {"strategy": "continuous", "of roofline": "n/a", "tok/s": "n/a"}, {"strategy": "skipped"}]
    text = notebook.markdown_table(rows)
    assert text.splitlines()[0] == "| strategy | tok/s |" and "| skipped |  |" in text
    assert text.endswith("n/a or empty in every row, so not shown: of roofline")
    assert "of roofline" in notebook.markdown_table(rows[:1])  # one row: its n/a is the answer
    # A cell's own '|' or newline (a message, a command) stays in its cell.
    piped = notebook.markdown_table([{"command": "a | b", "note": "two\nlines"}])
    assert piped.splitlines()[2] == "| a \\| b | two lines |"
