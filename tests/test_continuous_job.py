"""The continuous backend inside the generation job: several samples per prompt, the system prompt,
the forecast's ETA, and a clear refusal under tensor parallelism."""

import pytest

from test_generate import job_params, read_records, write_prompts
from workbook import arithmetic, cli, generation, models, params
from workbook.planner import profile
from workbook.planner.layout import LayoutError

SAMPLING = {"do_sample": True, "temperature": 1.0}


def keys(path):
    return [(r["metadata"]["example_id"], r["metadata"]["sample_index"]) for r in read_records(path)]


@pytest.mark.slow
def test_continuous_writes_every_id_and_sample_once_and_logs_the_forecasts_eta(tmp_path, tiny_model_path):
    records = arithmetic.sample_records()[:6]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    lines = []
    summary = generation.run_job(job_params(prompts, output, backend="continuous", samples_per_prompt=3, batch_size=4,
                                            log_every_batches=1, **SAMPLING), output, show_progress=False,
                                 log=lines.append)
    assert summary["backend"] == "continuous" and summary["candidates"] == summary["in_output"] == 18
    assert summary["attention_implementation"] == "sdpa"  # what transformers' manager ran (no flash on CPU)
    assert summary["unaccounted"] == 0 and keys(output) == [(r["id"], s) for r in records for s in range(3)]
    assert any("ETA" in line for line in lines), "the stream's progress lines should carry the forecast's ETA"

    # A fourth sample later adds only the missing candidates: (id, sample) is what a resume counts.
    more = generation.run_job(job_params(prompts, output, backend="continuous", samples_per_prompt=4, batch_size=4,
                                         **SAMPLING), output, show_progress=False, log=lambda line: None)
    assert more["generated"] == 6 and keys(output) == [(r["id"], s) for r in records for s in range(4)]


def test_continuous_sends_the_system_prompt_as_static_does(tmp_path, tiny_model_path):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:5])
    runs = {}
    for backend in ("static", "continuous"):
        output = tmp_path / f"{backend}.jsonl"
        generation.run_job(job_params(prompts, output, backend=backend, batch_size=3, system_prompt="You add numbers."),
                           output, show_progress=False, log=lambda line: None)
        runs[backend] = [(r["output"], r["metadata"]["prompt_tokens"], r["metadata"]["system_prompt"]["sha256"])
                         for r in read_records(output)]
    assert runs["continuous"] == runs["static"]  # greedy: the same tokens from the same (system + user) prompt


def test_continuous_under_tensor_parallelism_is_refused_before_a_model_loads(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(models, "load_model", no_loading)
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:2])
    output = tmp_path / "out.jsonl"
    code = cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}", f"output_path={output}",
                     "backend=continuous", "tensor_parallel_size=2"])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and "Traceback" not in error
    assert "cannot run under tensor parallelism" in error and "backend static" in error and not output.exists()


def test_under_tensor_parallelism_auto_picks_static_and_the_planner_keeps_continuous_unsharded():
    values = params.load(params.profile_path("cpu"))
    chosen, why = generation.resolve_backend({**values, "backend": "auto", "tensor_parallel_size": 2})
    assert chosen == "static" and "tensor_parallel_size 2" in why
    gpus = {**params.load(params.profile_path("h100x8")), "model": "Llama-3.1-8B"}  # 8 key/value heads
    with pytest.raises(LayoutError, match="cannot run under tensor parallelism"):
        profile.plan(gpus, mode="generate", batch_size=1, backend="continuous", tensor_parallel_size=2)
    # tensor_parallel_size auto with continuous: one whole copy per GPU, the paged plan.
    plan = profile.plan({**gpus, "tensor_parallel_size": "auto"}, mode="generate", batch_size=1, backend="continuous")
    assert plan.tensor_parallel_size == 1 and plan.settings["backend"] == "continuous"
