"""The `workbook` command as a user meets it: every --set counts, each job's --help lists the keys
it reads, output into a closed pipe ends quietly; and the shell commands on a bare GPU image:
rented machines (and our H200) often have torch, transformers, accelerate, matplotlib, pyyaml and
tqdm but not the notebook stack or NVML's bindings. `python -m workbook plan/gpu/bench` must work
there, with `PYTHONPATH=lib` alone."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbook import cli, notebook, params, runner
from workbook.bench import review
from workbook.generation import cli as generation_cli
from workbook.paths import REPO_ROOT
from test_generate import GREEDY_SET

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


@pytest.mark.slow
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
        manifest = json.loads((run_dir / "manifest.json").read_text())  # notebook 05 lists it like any run
        assert (manifest["status"], manifest["job"], manifest["profile"]) == ("ok", "bench", "cpu")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


NEW_RUN_DIR = notebook.new_run_dir  # the real one, for the monkeypatched stand-in below


class Resolved(Exception):
    """Raised by the spy below once the job has resolved its params: nothing else needs to run."""


@pytest.mark.parametrize("command", [["run", "--only", "00"], ["generate"], ["train"], ["bench"]], ids=lambda c: c[0])
def test_every_repeated_set_counts(command, monkeypatch):
    # `--set a=1 --set b=2` used to keep only the last --set: the job ran with the wrong data and exited 0.
    seen = {}
    resolve = runner.resolve_params

    def spy(params_arg, overrides, log=print):
        seen["params"] = resolve(params_arg, overrides, log)[0]
        raise Resolved

    monkeypatch.setattr(runner, "resolve_params", spy)
    with pytest.raises(Resolved):
        cli.main([command[0], "--params", "cpu", *command[1:],
                  "--set", "seed=7", "--set", "max_examples=3", "max_steps=4", "--set", "top_p=0.5"])
    assert {key: seen["params"][key] for key in ("seed", "max_examples", "max_steps", "top_p")} == \
        {"seed": 7, "max_examples": 3, "max_steps": 4, "top_p": 0.5}


def test_every_repeated_set_counts_in_python_m_workbook_generation(monkeypatch):
    seen = {}
    monkeypatch.setattr(generation_cli, "cli_main", lambda params_arg, overrides: seen.setdefault("set", overrides))
    generation_cli.main(["--params", "cpu", "--set", "seed=7", "--set", "max_examples=3", "top_p=0.5"])
    assert seen["set"] == ["seed=7", "max_examples=3", "top_p=0.5"]


def test_generate_uses_every_set_and_records_its_run_folder_for_notebook_05(tiny_model_path, tmp_path, monkeypatch):
    outputs = tmp_path / "outputs"
    monkeypatch.setattr(notebook, "new_run_dir", lambda profile: NEW_RUN_DIR(profile, outputs))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "input": f"What is {i} + 1?"}) + "\n" for i in range(4)))
    sets = ["--set", f"prompts_path={prompts}", "--set", "max_examples=2", "--set", "max_new_tokens=4",
            "--set", *GREEDY_SET]
    assert cli.main(["generate", "--params", "cpu", *sets]) == 0
    [run_dir] = outputs.iterdir()
    output = run_dir / "generations.jsonl"
    assert sorted(json.loads(line)["metadata"]["example_id"] for line in output.read_text().splitlines()) == ["q0", "q1"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["job"] == "generate" and manifest["params"]["max_examples"] == 2
    # Resuming into the same folder (the command it printed) continues that run's record.
    assert cli.main(["generate", "--params", "cpu", *sets, "--set", f"output_path={output}"]) == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and len(manifest["resumed_at"]) == 1
    [run] = review.load_runs(outputs)
    assert (run.status, run.profile, run.problems) == ("ok", "cpu", [])


JOB_MODULES = {"generate": "workbook.generation", "train": "workbook.training", "bench": "workbook.bench",
               "forecast": "workbook.forecast.pilot", "verify": "workbook.generation.verify"}


@pytest.mark.parametrize("job", JOB_MODULES)
def test_job_help_lists_every_key_the_job_reads_with_its_meaning(job, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([job, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for key in importlib.import_module(JOB_MODULES[job]).PARAMS_USED:
        meaning = params.SCHEMA[key].meaning.split()[0]
        assert re.search(rf"^  {key} +{re.escape(meaning)}", text, re.M), f"{job} --help lacks {key}"


def test_help_of_the_command_and_of_gpu_does_not_import_torch():
    # Listing a job's keys must not cost the seconds that importing the job (torch) takes.
    probe = ("import sys\nfrom workbook import cli\n"
             "for argv in (['--help'], ['gpu', '--help'], ['generate', '--help'], ['train', '--help']):\n"
             "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch imported:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch imported: False"


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["gpu", "--json"],
    ["plan", "--model", "llama-3.1-8b", "--profile", "h200", "--mode", "generate", "--json"],
], ids=lambda c: c[0])
def test_json_into_a_closed_pipe_ends_quietly(command):
    # `workbook gpu --json | head -1`: head exits after one line; the rest meets a closed pipe.
    # Closing the read end first makes that certain instead of a race with the pipe's buffer.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "workbook", *command], stdout=write_end, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1


@pytest.mark.slow
def test_head_of_the_json_gets_its_line():
    done = subprocess.run(f"{sys.executable} -m workbook gpu --json | head -1", shell=True, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}, timeout=300)
    assert done.stdout == "{\n" and "Traceback" not in done.stderr, done.stderr


def test_plan_refuses_a_safety_margin_of_nan(capsys):
    assert cli.main(["plan", "--profile", "h200", "--mode", "generate", "--safety-margin", "nan"]) == 2
    assert "error: --safety-margin: 'safety_margin' is nan; expected a finite number" in capsys.readouterr().err


TINY_LLAMA_CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("text, key", [
    ("", "empty"),
    ('{"model_type": "llama",', "not valid JSON"),
    (json.dumps({**TINY_LLAMA_CONFIG, "hidden_size": "64"}), "'hidden_size'"),
    (json.dumps({**TINY_LLAMA_CONFIG, "num_hidden_layers": 0}), "'num_hidden_layers'"),
    (json.dumps({**TINY_LLAMA_CONFIG, "intermediate_size": -1}), "'intermediate_size'"),
    (json.dumps({**TINY_LLAMA_CONFIG, "num_key_value_heads": 3}), "'num_key_value_heads' 3"),
])
def test_plan_refuses_a_bad_config_json_in_one_line_naming_file_and_key(tmp_path, capsys, text, key):
    (tmp_path / "config.json").write_text(text)
    assert cli.main(["plan", "--profile", "h100", "--mode", "generate", "--model", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"error: {tmp_path / 'config.json'}: ") and key in error


@pytest.mark.parametrize("mode", ["generate", "train"])
def test_plan_refuses_batch_size_0_and_plans_auto_as_the_largest_that_fits(capsys, mode):
    command = ["plan", "--profile", "h100", "--mode", mode, "--model", "llama-3.2-1b", "--json", "--batch-size"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(command + ["0"])
    assert stopped.value.code == 2 and "--batch-size: expected an integer >= 1 or 'auto', got '0'" in capsys.readouterr().err
    assert cli.main(command + ["auto"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["batch_size"] == auto["max_batch_size"] > 1
    assert cli.main(command + [str(auto["max_batch_size"] + 1)]) == 1  # one more does not fit


def test_plan_refusing_new_tokens_0_names_the_flag_the_user_typed(capsys):
    assert cli.main(["plan", "--profile", "h100", "--mode", "generate", "--new-tokens", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --new-tokens: 'max_new_tokens' is 0")


def test_plan_accepts_the_long_dtype_names(capsys):
    from workbook.planner.shape import DTYPE_ALIASES
    assert cli.PLAN_DTYPE_ALIASES == DTYPE_ALIASES  # the CLI's copy, kept so --help needs no torch
    assert cli.main(["plan", "--profile", "h100", "--mode", "generate", "--model", "llama-3.2-1b",
                     "--dtype", "bfloat16", "--batch-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bf16"


def test_plan_takes_the_memory_switches_and_lists_what_would_make_a_training_setting_fit(capsys):
    common = ["plan", "--profile", "h100", "--model", "llama-3.2-1b", "--mode", "train", "--seq-len", "2048",
              "--dtype", "bf16", "--batch-size", "12"]
    assert cli.main(common) == 1
    out = capsys.readouterr().out
    assert "changes that would make it fit" in out and "loss_chunk_tokens 1024       fits" in out
    assert cli.main(common + ["--loss-chunk-tokens", "1024", "--precision", "bf16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["settings"]["loss_chunk_tokens"] == 1024 and not plan["settings"]["mixed_precision"]
    assert plan["ways_to_fit"] == []
    assert cli.main(["plan", "--profile", "cpu", "--mode", "train", "--precision", "bf16"]) == 2
    assert capsys.readouterr().err.startswith("error: precision bf16 trains bf16 weights and needs dtype bf16")


def test_plan_auto_that_fits_nothing_lists_the_changes_at_batch_1(capsys):
    code = cli.main(["plan", "--profile", "h100", "--mode", "train", "--model", "llama-3.1-8b", "--batch-size", "auto",
                     "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 3 and result["max_batch_size"] == 0
    lora = next(option for option in result["ways_to_fit"] if option["change"] == "lora_rank 16")
    assert lora["fits"] and lora["max_batch_size"] >= 1


def test_a_key_the_job_does_not_read_is_noted_with_the_one_it_may_mean(capsys):
    # seq_len is notebook 01's: a valid key that workbook train never reads (max_steps=abc stops it first).
    assert cli.main(["train", "--params", "cpu", "--set", "seq_len=4096", "max_steps=abc"]) == 2
    err = capsys.readouterr().err
    assert "note: --set seq_len: `workbook train` does not read it, so it changes nothing here. Did you mean " \
           "'max_seq_length'?" in err and "max_steps" not in err.split("error:")[0]


def test_forecast_reads_every_training_key_it_pilots_with(capsys):
    # The forecast pilots training through the trainer's own config: none of the trainer's keys
    # (the lean-training switches included) may be noted as changing nothing.
    cli.note_keys_not_read("forecast", ["precision=bf16", "loss_chunk_tokens=512", "offload_activations=true",
                                        "report_to=tensorboard", "lora_targets=all", "system_prompt=x"])
    assert capsys.readouterr().err == ""
    cli.note_keys_not_read("verify", ["batch_size=8"])
    assert "`workbook verify` does not read it" in capsys.readouterr().err


def test_an_output_lost_between_engine_and_file_is_reported_by_id_and_fails_the_job(tmp_path, monkeypatch, capsys):
    # The audit after the merge is the net under every other guarantee: here a writer that silently
    # drops one record (a bug of ours it must catch) leaves an id in neither file.
    from workbook import jsonl
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "input": f"What is {i} + 1?"}) + "\n" for i in range(4)))
    write_encodable = jsonl.LineAppender.write_encodable

    def dropping_q2(self, records):
        return write_encodable(self, [r for r in records if r["metadata"]["example_id"] != "q2"])

    monkeypatch.setattr(jsonl.LineAppender, "write_encodable", dropping_q2)
    code = cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}", f"output_path={output}",
                     "max_new_tokens=4", *GREEDY_SET])
    printed = capsys.readouterr().out
    assert code == 1
    assert "ERROR: 1 examples are neither in the output nor in the failures file, e.g. ['q2']" in printed
    summary = json.loads(output.with_suffix(".summary.json").read_text())
    assert summary["unaccounted"] == 1 and summary["unaccounted_ids"] == ["q2"] and summary["in_output"] == 3


def test_a_notebook_that_lacks_a_key_its_job_reads_is_told_which_and_where_to_declare_it(tmp_path):
    from workbook import generation, training
    from workbook.generation.settings import GenerationSettings
    cpu = dict(params.load(REPO_ROOT / "params" / "cpu.yaml"))
    with pytest.raises(generation.GenerationError, match=r"workbook generate needs the parameter\(s\) seed; .*"
                                                         r"notebooks/02_batched_generation"):
        GenerationSettings.from_params({key: value for key, value in cpu.items() if key != "seed"})
    with pytest.raises(training.TrainError, match=r"workbook train needs the parameter\(s\) epochs, precision; .*"
                                                  r"notebooks/03_training"):
        training.config_from_params({k: v for k, v in cpu.items() if k not in ("epochs", "precision")}, tmp_path)


@pytest.mark.slow
def test_no_key_a_jobs_notebook_declares_is_noted_as_changing_nothing(capsys):
    # The notebook's parameters cell lists what the job reads: a --set of any of them counts.
    import papermill
    from workbook import job_keys
    for job, path in job_keys.NOTEBOOKS.items():
        declared = set(papermill.inspect_notebook(str(REPO_ROOT / f"{path}.ipynb"))) - {notebook.RUN_DIR_PARAMETER}
        cli.note_keys_not_read(job, [f"{key}=1" for key in declared])
        assert capsys.readouterr().err == "", job
    # verify caps the accepted outputs; forecast plans in plan_mode over num_nodes at the profile's bandwidth.
    cli.note_keys_not_read("verify", ["max_accepted_per_prompt=2", "verifier=exact_match"])
    cli.note_keys_not_read("forecast", ["plan_mode=train", "num_nodes=2", "memory_bandwidth_gbs=1", "seq_len=64"])
    assert capsys.readouterr().err == ""


def test_a_job_refuses_params_lacking_any_key_it_reads_and_names_it():
    from workbook import job_keys
    cpu = dict(params.load(REPO_ROOT / "params" / "cpu.yaml"))
    for job in job_keys.READ_BY:  # generate, train and bench (each a notebook's), forecast and verify
        assert job_keys.missing(cpu, job) is None, job
        for key in job_keys.READ_BY[job]:
            problem = job_keys.missing({k: v for k, v in cpu.items() if k != key}, job)
            assert problem and f"needs the parameter(s) {key};" in problem, (job, key)


def test_workbook_calibrate_offers_every_named_case_list_and_passes_it_on(monkeypatch):
    from workbook.planner import calibration
    seen = {}
    monkeypatch.setattr(calibration, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    for name in calibration.NAMED_CASES:
        assert cli.main(["calibrate", "--profile", "h100", "--cases", name]) == 0
        assert seen.pop("argv")[-2:] == ["--cases", name]
