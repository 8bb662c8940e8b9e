"""Tensor parallelism (issue 12): the planner plans T x D layouts the engine runs, and the engine
shards a model over T processes with transformers' own tensor parallelism (gloo on CPU)."""

import json
import os
import subprocess
import sys
import types

import pytest

from workbook import cli, params
from workbook.paths import PARAMS_DIR, REPO_ROOT
from workbook.planner import layout, profile
from workbook.planner.formulas import weights_bytes
from workbook.presets import load_config


def h100x8(**changes):
    values = params.load(PARAMS_DIR / "h100x8.yaml")
    values.update(changes)
    return values


def weights_term(plan) -> int:
    return next(term.bytes for term in plan.terms if term.name == "weights")


def test_a_70b_teacher_on_8_h100s_is_sharded_with_each_gpu_holding_a_share_of_the_weights():
    plan = profile.plan(h100x8(tensor_parallel_size="auto"), mode="generate", model="llama-3.1-70b")
    tensor, data = plan.tensor_parallel_size, plan.data_parallel_size
    assert tensor >= 2 and tensor * data == 8 and plan.fits
    # Every projection and the embedding of Llama-3.1-70B divide evenly; the norms (replicated) are
    # the only parameters not split, a rounding error at this size: the plan counts them whole.
    total = weights_bytes(load_config("llama-3.1-70b"), "bf16")
    assert weights_term(plan) == pytest.approx(total / tensor, rel=1e-4) and weights_term(plan) > total // tensor
    assert any(note.startswith(f"layout T={tensor} x D={data}") for note in plan.notes)


def test_an_8b_teacher_on_8_h100s_stays_whole_on_each_gpu():
    plan = profile.plan(h100x8(tensor_parallel_size="auto"), mode="generate", model="llama-3.1-8b")
    assert (plan.tensor_parallel_size, plan.data_parallel_size) == (1, 8)
    assert weights_term(plan) == weights_bytes(load_config("llama-3.1-8b"), "bf16")


def test_a_larger_tensor_parallel_size_fits_a_larger_batch_per_gpu():
    batches = [profile.plan(h100x8(tensor_parallel_size=size), mode="generate", model="llama-3.1-70b",
                            batch_size=1).max_batch_size for size in (1, 2, 4, 8)]
    assert batches[0] == 0 and batches == sorted(batches) and batches[-1] > batches[1]


def test_auto_takes_the_smallest_t_whose_batch_per_gpu_reaches_the_useful_batch():
    useful = layout.USEFUL_BATCH_SIZE

    def choose(batches: dict, key_value_heads=8, gpu_count=8):
        def make(size):
            if batches[size] is None:
                raise layout.LayoutError("experts sharded in a style the planner does not model")
            return types.SimpleNamespace(max_batch_size=batches[size])
        return layout.choose_tensor_parallel_size(make, key_value_heads, gpu_count)

    # The boundary: a batch of exactly the useful size is enough, one less is not.
    assert choose({1: useful, 2: 99})[0] == 1
    chosen, why = choose({1: useful - 1, 2: useful, 4: 99})
    assert chosen == 2 and why.startswith("layout T=2 x D=4 (tensor_parallel_size auto): the smallest T")
    assert f"T=1: largest batch {useful - 1}; T=2: largest batch {useful}" in why and "T=4" not in why
    # T divides the key/value heads as well as the GPUs: 2 heads on 8 GPUs never tries T=4.
    chosen, why = choose({1: 1, 2: 3, 4: 99}, key_value_heads=2)
    assert chosen == 2 and "no T planned reaches" in why and "T=4:" not in why
    # None reaches it: the largest batch wins, not the largest T.
    assert choose({1: 0, 2: 5, 4: 4, 8: 3})[0] == 2
    chosen, why = choose({1: 0, 2: 0, 4: 0, 8: 0})
    assert chosen == 1 and "no T planned fits even batch 1" in why
    # A T the planner cannot model stops the search and is said to be unplanned, not too small.
    chosen, why = choose({1: 0, 2: 3, 4: None, 8: 99})
    assert chosen == 2 and "cannot plan T >= 4" in why and "T=4: not planned" in why
    # One GPU or none: T=1 whatever it holds.
    assert choose({1: 0}, gpu_count=0)[0] == choose({1: 0}, gpu_count=1)[0] == 1


def test_plan_cli_prints_and_records_the_layout(capsys):
    code = cli.main(["plan", "--model", "llama-3.1-70b", "--profile", "h100x8", "--mode", "generate",
                     "--tensor-parallel-size", "4", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and (record["tensor_parallel_size"], record["data_parallel_size"]) == (4, 2)
    cli.main(["plan", "--model", "llama-3.1-70b", "--profile", "h100x8", "--mode", "generate"])
    assert "tensor parallel 4 x data parallel 2" in capsys.readouterr().out


@pytest.mark.parametrize("profile_name, size, message", [
    ("h100x8", "3", "tensor_parallel_size 3 does not divide the 8 key/value heads of meta-llama/Llama-3.1-70B: each GPU must "
               "hold whole heads; use one of 1, 2, 4, 8."),
    ("h100", "2", "1 GPU(s) (processes) are not a multiple of tensor_parallel_size 2"),
])
def test_plan_cli_refuses_a_tensor_parallel_size_the_engine_cannot_run(capsys, profile_name, size, message):
    code = cli.main(["plan", "--model", "llama-3.1-70b", "--profile", profile_name, "--mode", "generate",
                     "--tensor-parallel-size", size])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error.startswith("error: ") and message in error


def test_sharded_parameters_split_projections_and_embedding_and_keep_norms_whole():
    config = load_config("llama-3.1-8b")
    hidden, layers = config.hidden_size, config.num_hidden_layers
    norms = (2 * layers + 1) * hidden
    whole = layout.sharded_parameters(config, 1)
    assert layout.sharded_parameters(config, 8) == (whole - norms) // 8 + norms


# ----------------------------------------------------------------------------------------------
# The engine: the tiny model sharded over processes on CPU (gloo, float32).

def torchrun(processes: int, *arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            *arguments]


ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib"), "OMP_NUM_THREADS": "1"}


@pytest.mark.multiprocess
def test_two_way_tensor_parallel_gives_the_tokens_and_logits_of_one_process_and_the_planned_bytes(tmp_path):
    result_path = tmp_path / "result.json"
    done = subprocess.run(torchrun(2, str(REPO_ROOT / "tests" / "tensor_parallel_worker.py"), str(result_path), "2"),
                          cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["sharded_tokens"] == result["whole_tokens"]  # a left-padded batch of mixed lengths
    assert result["max_logit_difference"] < 1e-4
    # What one rank holds, measured on the sharded model, is what the planner predicts, byte for byte.
    assert result["parameter_bytes"] == result["planned_weights"] < result["whole_parameter_bytes"]
    assert result["cache_bytes"] == result["planned_kv_cache"]


def generation_command(processes: int, prompts, output, *settings: str) -> list[str]:
    return torchrun(processes, "-m", "workbook.generation", "--params", "cpu", "--set", f"prompts_path={prompts}",
                    f"output_path={output}", "log_every_batches=0", "interactive=false", "verifier=", "batch_size=2",
                    "max_new_tokens=6", "do_sample=false", "samples_per_prompt=1", *settings)


def one_process_output(tmp_path, prompts, tiny_model_path):
    from workbook import generation
    from test_generate import job_params
    single = tmp_path / "single.jsonl"
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    generation.run_job(job_params(prompts, single, batch_size=2, max_new_tokens=6), single, model=model,
                       tokenizer=tokenizer, log=lambda line: None, show_progress=False)
    return single.read_text()


@pytest.mark.multiprocess
def test_tensor_times_data_parallel_writes_every_id_once_as_one_process_does(tmp_path, tiny_model_path):
    from workbook import arithmetic
    from test_generate import write_prompts
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:10])
    expected = one_process_output(tmp_path, prompts, tiny_model_path)
    output = tmp_path / "out.jsonl"
    done = subprocess.run(generation_command(4, prompts, output, "tensor_parallel_size=2"), cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert output.read_text() == expected  # each id once, in input order, the same tokens
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["processes"] == 4 and summary["in_output"] == 10 and summary["unaccounted"] == 0
    assert [share["rank"] for share in summary["per_process"]] == [0, 2]  # one writer per group of 2
    assert sum(share["generated"] for share in summary["per_process"]) == 10


@pytest.mark.multiprocess
def test_kill_9_during_a_tensor_parallel_run_then_resume_loses_nothing(tmp_path, tiny_model_path):
    import signal
    import time
    from workbook import arithmetic
    from test_generate import complete_lines, write_prompts
    records = arithmetic.sample_records()[:40]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    command = generation_command(2, prompts, output, "tensor_parallel_size=2")
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 240
    while complete_lines(output) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before it could be killed"
    import psutil
    launcher = psutil.Process(process.pid)
    for each in [launcher, *launcher.children(recursive=True)]:  # torchrun starts its ranks in their own sessions
        each.send_signal(signal.SIGKILL)
    process.communicate()
    assert 0 < complete_lines(output) < len(records)
    done = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert output.read_text() == one_process_output(tmp_path, prompts, tiny_model_path)  # each id once, in order


@pytest.fixture
def no_model_loading(monkeypatch):
    from workbook.generation import job

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the problem was found")
    monkeypatch.setattr(job, "load_model", refuse)


@pytest.mark.parametrize("settings, message", [
    (["tensor_parallel_size=2"], "error: tensor_parallel_size 2 needs 2 processes, one per GPU, and this is a single "
                                 "process: run `torchrun --nproc_per_node 2 -m workbook.generation"),
    (["tensor_parallel_size=4", "data_parallel_processes=4"],
     "error: tensor_parallel_size 4 does not divide the 2 key/value heads of tiny: each GPU must hold whole heads; "
     "use one of 1, 2."),
    (["tensor_parallel_size=2", "data_parallel_processes=3"],
     "error: 3 GPU(s) (processes) are not a multiple of tensor_parallel_size 2"),
])
def test_a_tensor_parallel_size_the_job_cannot_run_is_refused_before_any_model_loads(
        tmp_path, capsys, no_model_loading, settings, message):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "input": "What is 1 + 1?"}\n')
    code = cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}",
                     f"output_path={tmp_path / 'out.jsonl'}", *settings])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and error.startswith(message)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written, nothing started


def test_auto_runs_a_model_that_fits_one_gpu_as_plain_data_parallel():
    from workbook.generation import tensor_parallel
    from workbook.generation.settings import GenerationSettings
    settings = GenerationSettings.from_params({**params.load(PARAMS_DIR / "h100x8.yaml"), "model": "tiny"})
    assert settings.tensor_parallel_size == "auto"
    assert tensor_parallel.resolve_layout(settings, 8, launched=True) == tensor_parallel.Layout(1, 8)


@pytest.mark.multiprocess
def test_notebook_02s_launcher_starts_a_tensor_parallel_job_that_writes_the_one_process_output(tmp_path,
                                                                                             tiny_model_path):
    # launch() (notebook 02, `workbook generate`) forks data_parallel_processes with notebook_launcher.
    from workbook import arithmetic
    from test_generate import write_prompts
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:6])
    expected = one_process_output(tmp_path, prompts, tiny_model_path)
    output = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "workbook.generation", "--params", "cpu", "--set", f"prompts_path={prompts}",
               f"output_path={output}", "log_every_batches=0", "interactive=false", "verifier=", "batch_size=2",
               "max_new_tokens=6", "tensor_parallel_size=2", "data_parallel_processes=2",
               "do_sample=false", "samples_per_prompt=1"]  # one greedy output per prompt
    done = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor parallel 2 x data parallel 1" in done.stdout
    assert output.read_text() == expected


def test_auto_keeps_a_model_whose_sharding_the_planner_does_not_model_on_one_gpu_and_says_why():
    # Mixtral's experts are sharded in transformers' 'moe_tp_experts' style, which the planner does not
    # model: 'auto' must not crash (notebook 01's layout table plans every preset) but stay at T=1.
    chosen = profile.plan(params.load_all()["h100x8"], mode="generate", model="Mixtral-8x7B-v0.1", batch_size=1,
                          tensor_parallel_size="auto")
    assert chosen.tensor_parallel_size == 1 and chosen.data_parallel_size == 8
    assert "T=2: not planned (" in chosen.notes[-1] and "moe_tp_experts" in chosen.notes[-1]
    # 87 GiB of weights do not fit one H100; a larger T might: the verdict says the planner could not plan it,
    # not that no T fits.
    assert chosen.max_batch_size == 0 and "no T fits" not in chosen.notes[-1]
    assert "the planner cannot plan T >= 2 for this model, where it may fit" in chosen.notes[-1]


@pytest.mark.multiprocess
def test_out_of_memory_under_tensor_parallel_splits_the_batch_on_every_rank_and_loses_nothing(tmp_path,
                                                                                            tiny_model_path):
    from workbook import arithmetic
    from test_generate import write_prompts
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:12])
    output = tmp_path / "out.jsonl"
    worker = str(REPO_ROOT / "tests" / "tensor_parallel_oom_worker.py")
    done = subprocess.run(torchrun(2, worker, str(prompts), str(output), str(tmp_path / "sizes"), "3"),
                          cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Both ranks of the copy met the error on the same batch and split it alike (8 -> 4 -> 2), so
    # their collectives stayed in step; the output is the one-process output, every id once.
    sizes = [json.loads((tmp_path / f"sizes.rank{index}.json").read_text()) for index in (0, 1)]
    assert sizes[0] == sizes[1] and sizes[0][:4] == [8, 4, 2, 2]
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["in_output"] == 12 and summary["failed"] == 0 and summary["oom_or_error_splits"] > 0
    single = tmp_path / "single.jsonl"
    from workbook import generation
    from test_generate import job_params
    model, tokenizer = generation.load_model(str(tiny_model_path), "fp32", "cpu")
    generation.run_job(job_params(prompts, single, batch_size=8, max_new_tokens=6), single, model=model,
                       tokenizer=tokenizer, log=lambda line: None, show_progress=False)
    assert output.read_text() == single.read_text()
