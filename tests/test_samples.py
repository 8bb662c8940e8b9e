"""Several samples per prompt (rejection sampling): each candidate is its own record, written exactly
once per (id, sample) through kills, resumes and data parallel."""

import json
import os
import random
import signal
import time
from types import SimpleNamespace

import pytest

from test_generate import complete_lines, job_params, read_records, run_cli, write_prompts
from workbook import arithmetic, cli, generation

SAMPLING = {"do_sample": True, "temperature": 1.0}


def keys(path):
    return [(r["metadata"]["example_id"], r["metadata"]["sample_index"]) for r in read_records(path)]


def test_greedy_decoding_with_several_samples_is_refused(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:2])
    output = tmp_path / "out.jsonl"
    with pytest.raises(generation.GenerationError, match="samples_per_prompt is 3 but do_sample is false"):
        generation.run_job(job_params(prompts, output, samples_per_prompt=3), output, show_progress=False)
    assert cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}", f"output_path={output}",
                     "samples_per_prompt=3", "do_sample=false"]) == 2
    assert "do_sample is false" in capsys.readouterr().err and not output.exists()


def test_every_sample_is_its_own_record_and_a_batch_counts_sequences(tmp_path, tiny_model_path):
    records = arithmetic.sample_records()[:8]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    quiet = {"show_progress": False, "log": lambda line: None}
    summary = generation.run_job(job_params(prompts, output, samples_per_prompt=2, batch_size=6, **SAMPLING,
                                            verifier="final_number"), output, **quiet)
    assert summary["candidates"] == summary["in_output"] == 16 and summary["unaccounted"] == 0
    assert keys(output) == [(r["id"], s) for r in records for s in range(2)]  # input order, samples in order
    assert max(batch["examples"] for batch in summary["batch_list"]) == 6  # sequences, not prompts
    rates = summary["verification"]["pass_rate_per_prompt"]
    assert set(rates) == {r["id"] for r in records} and all(rate in (0, 0.5, 1) for rate in rates.values())

    # Asking for more samples later adds only the missing ones: (id, sample) is what a resume counts.
    more = generation.run_job(job_params(prompts, output, samples_per_prompt=3, batch_size=6, **SAMPLING), output,
                              **quiet)
    assert more["generated"] == 8 and keys(output) == [(r["id"], s) for r in records for s in range(3)]
    # Fewer than the output holds is refused by name: the audit and the verifier would count every sample.
    with pytest.raises(generation.GenerationError, match=r"holds sample\(s\) 2..2 .*samples_per_prompt: 3 to resume"):
        generation.run_job(job_params(prompts, output, samples_per_prompt=2, batch_size=6, **SAMPLING), output, **quiet)


@pytest.mark.slow
def test_kill_9_then_resume_writes_every_id_and_sample_exactly_once(tmp_path):
    rng = random.Random(20261123)
    records = arithmetic.sample_records()[:60]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    settings = (f"prompts_path={prompts}", f"output_path={output}", "batch_size=3", "samples_per_prompt=3",
                "do_sample=true", "temperature=1.0")
    for _ in range(2):
        target = complete_lines(output) + rng.randint(3, 15)
        process = run_cli(*settings)
        deadline = time.monotonic() + 120
        while complete_lines(output) < target and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert process.poll() is None, "the run ended before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
        process.communicate()
    assert 0 < complete_lines(output) < 3 * len(records)
    finished = run_cli(*settings)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err[-3000:]
    assert keys(output) == [(r["id"], s) for r in records for s in range(3)]  # each exactly once, in order
    assert f"{3 * len(records)} of {3 * len(records)} outputs: {len(records)} examples x 3 samples" in out


@pytest.mark.multiprocess
def test_two_processes_share_the_samples_and_merge_them_exactly_once(tmp_path):
    records = arithmetic.sample_records()[:12]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "two.jsonl"
    process = run_cli(f"prompts_path={prompts}", f"output_path={output}", "batch_size=4", "samples_per_prompt=2",
                      "do_sample=true", "data_parallel_processes=2")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert keys(output) == [(r["id"], s) for r in records for s in range(2)]
    summary = json.loads((tmp_path / "two.summary.json").read_text())
    assert summary["processes"] == 2 and [share["generated"] for share in summary["per_process"]] == [12, 12]


@pytest.mark.multiprocess
def test_a_killed_data_parallel_run_resumes_with_every_id_and_sample_exactly_once(tmp_path):
    records = arithmetic.sample_records()[:40]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "two.jsonl"
    settings = (f"prompts_path={prompts}", f"output_path={output}", "batch_size=2", "samples_per_prompt=2",
                "do_sample=true", "data_parallel_processes=2")
    process = run_cli(*settings, start_new_session=True)  # its own process group: the workers die with it

    def written() -> int:
        return sum(complete_lines(part) for part in tmp_path.glob("two.part-*.jsonl"))

    deadline = time.monotonic() + 180
    while written() < 12 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    assert 0 < written() < 2 * len(records)
    finished = run_cli(*settings)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err[-3000:]
    assert keys(output) == [(r["id"], s) for r in records for s in range(2)]
    assert not list(tmp_path.glob("two.part-*"))  # merged away


def test_the_planners_batch_counts_sequences_so_n_samples_fill_it_like_n_times_the_prompts(tmp_path,
                                                                                         tiny_model_path, monkeypatch):
    # 6 MiB of "RAM": the planner's batch (about 11 sequences of the tiny model) splits 32 sequences in several.
    import psutil
    small = SimpleNamespace(total=6 * 2**20, available=6 * 2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: small)
    quiet = {"show_progress": False, "log": lambda line: None}
    records = arithmetic.sample_records()[:32]
    few = write_prompts(tmp_path / "few.jsonl", records[:8])
    many = write_prompts(tmp_path / "many.jsonl", records)
    sampled = generation.run_job(job_params(few, tmp_path / "a.jsonl", batch_size="auto", samples_per_prompt=4,
                                            **SAMPLING), tmp_path / "a.jsonl", **quiet)
    single = generation.run_job(job_params(many, tmp_path / "b.jsonl", batch_size="auto"), tmp_path / "b.jsonl",
                                **quiet)
    assert sampled["batch_size"] == single["batch_size"]  # the planner's answer, in sequences
    assert 1 < single["batch_size"] < 16 and len(single["batch_list"]) >= 3
    assert [b["examples"] for b in sampled["batch_list"]] == [b["examples"] for b in single["batch_list"]]
