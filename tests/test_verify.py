"""Verification: built-in and user verifiers on hand-made records, the accepted set, and the trainer
reading it as it is."""

import json
import textwrap

import pytest

from workbook import arithmetic, cli, generation, params, training
from workbook.generation import records as output_records
from workbook.paths import PARAMS_DIR
from test_generate import ONE_GREEDY_OUTPUT
from workbook.training.config import resolve_data_path
from workbook.generation.verify import (
    VerifyError, exact_match, final_number_matches, load_verifier, select, verify_output,
)


def candidate(example_id, output, reference=None, sample_index=0, prompt="What is 2 + 2?", **fields):
    """An output record as the job writes it (seed 000's format), one candidate of one prompt."""
    source = {"id": example_id, "question": prompt, **fields}
    if reference is not None:
        source["output"] = reference
    example = output_records.Example(example_id, 1, prompt, source)
    record = output_records.output_record(
        example, output=output, prompt_field="question", teacher_model="tiny",
        generation_params={"do_sample": True}, prompt_tokens=3, output_tokens=3, finish_reason="eos",
        settings_fingerprint="test")
    record["metadata"]["sample_index"] = sample_index
    return record


def write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_final_number_reads_gsm8k_answers_and_what_models_write():
    gsm8k = candidate("g1", "She pays 3 x $24 = $72, so the answer is 72.", answer="3 * 24 = <<3*24=72>>72\n#### 72")
    assert final_number_matches(gsm8k)
    assert final_number_matches(candidate("a", "The total is 1,234.", reference="#### 1234"))
    assert final_number_matches(candidate("b", " 4", reference="4"))
    assert not final_number_matches(candidate("c", "4, no wait: 5", reference="4"))  # the last number counts
    assert not final_number_matches(candidate("d", "I do not know", reference="4"))
    with pytest.raises(VerifyError, match="no reference answer"):
        final_number_matches(candidate("e", "4"))


def test_exact_match_ignores_case_space_and_surrounding_punctuation_only():
    assert exact_match(candidate("a", "  Paris.", reference="paris"))
    assert exact_match(candidate("b", "New   York", reference="new york"))
    assert not exact_match(candidate("c", "Paris, France", reference="Paris"))


def test_a_users_verifier_is_loaded_by_module_and_function_and_one_that_raises_fails_only_its_record(
        tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(textwrap.dedent("""
        def short_enough(record):
            if record["output"] == "boom":
                raise RuntimeError("cannot judge this one")
            return 1.0 if len(record["output"]) <= 3 else 0.0
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    verifier = load_verifier("my_checks:short_enough")
    selection = select([candidate("a", "ok"), candidate("b", "boom"), candidate("c", "too long")], verifier)
    assert [r["metadata"]["example_id"] for r in selection.accepted] == ["a"]
    assert selection.errors == [{"example_id": "b", "sample_index": 0, "stage": "verify",
                                 "error": "RuntimeError: cannot judge this one"}]
    for bad, message in (("my_checks", "expected one of"), ("nowhere:f", "cannot import 'nowhere'"),
                         ("my_checks:missing", "has no function 'missing'")):
        with pytest.raises(VerifyError, match=message):
            load_verifier(bad)
    assert load_verifier("") is None


def test_identical_outputs_are_kept_once_and_the_cap_holds_per_prompt():
    candidates = [candidate("p", " 4", "4", i) for i in range(3)]  # the same right answer three times
    candidates += [candidate("p", " 4.", "4", 3), candidate("p", " 04", "4", 4), candidate("p", " 5", "4", 5)]
    candidates += [candidate("q", " 4", "4", 0)]
    capped = select(candidates, final_number_matches, max_accepted_per_prompt=2)
    assert [r["output"] for r in capped.accepted] == [" 4", " 4.", " 4"]  # p: two distinct outputs; q: one
    assert (capped.duplicates, capped.capped) == (2, 1)
    summary = capped.summary()
    assert summary["pass_rate_per_prompt"] == {"p": 5 / 6, "q": 1.0}
    assert summary["prompts_with_an_accepted_sample"] == 2 and summary["accepted_candidates"] == 6
    assert len(select(candidates, final_number_matches).accepted) == 4  # no cap: every distinct output


def test_verify_output_writes_the_accepted_file_the_trainer_reads_as_it_is(tmp_path, tiny_model_path):
    output = write(tmp_path / "teacher.jsonl", [
        candidate("a", " 4", "4", 0), candidate("a", " 5", "4", 1),
        candidate("b", " 7", "7", 0, prompt="What is 3 + 4?"), candidate("c", " 9", "8", 0, prompt="What is 4 + 4?")])
    summary = verify_output(output, "final_number")
    accepted = tmp_path / "teacher.accepted.jsonl"
    assert summary["accepted_path"] == str(accepted) and summary["written"] == 2
    assert [json.loads(line)["metadata"]["example_id"] for line in accepted.read_text().splitlines()] == ["a", "b"]
    assert summary["pass_rate_per_prompt"] == {"a": 0.5, "b": 1.0, "c": 0.0}
    config = training.TrainConfig(model=str(tiny_model_path), data_path=str(accepted), data_description="accepted",
                                  output_dir=str(tmp_path / "train"), input_field="input", output_field="output",
                                  validation_fraction=0.0, use_chat_template=False)
    prepared = training.prepare_data(config)
    assert len(prepared.train) == 2 and prepared.tokenize_report["skipped"] == 0
    with pytest.raises(VerifyError, match="no such output"):
        verify_output(tmp_path / "missing.jsonl", "final_number")


def cpu_job(prompts_path, output_path, **changes):
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(prompts_path=str(prompts_path), output_path=str(output_path), log_every_batches=0,
                  **{**ONE_GREEDY_OUTPUT, **changes})  # one greedy answer per question: accepted = right
    return values


def test_the_job_verifies_after_generating_and_a_mistyped_verifier_stops_it_first(tmp_path, tiny_model_path):
    prompts = write(tmp_path / "prompts.jsonl", arithmetic.sample_records()[:12])
    output = tmp_path / "teacher.jsonl"
    summary = generation.run_job(cpu_job(prompts, output, verifier="final_number"), output, show_progress=False)
    right = round(generation.task_accuracy(generation.read_outputs(output))["accuracy"] * 12)
    assert summary["verification"]["accepted_candidates"] == right == summary["verification"]["written"]
    assert len((tmp_path / "teacher.accepted.jsonl").read_text().splitlines()) == right
    other = tmp_path / "other.jsonl"
    with pytest.raises(generation.GenerationError, match="verifier 'final_numbr'"):
        generation.run_job(cpu_job(prompts, other, verifier="final_numbr"), other, show_progress=False)
    assert not other.exists()  # stopped before generating anything


def test_workbook_verify_checks_an_existing_output_again(tmp_path, capsys):
    output = write(tmp_path / "teacher.jsonl", [candidate("a", " 4", "4"), candidate("b", " 5", "4")])
    assert cli.main(["verify", "--params", "cpu", "--set", f"output_path={output}", "verifier=exact_match"]) == 0
    assert "1 of 2 outputs accepted (50.0%); 1 of 2 prompts have at least one" in capsys.readouterr().out
    assert cli.main(["verify", "--params", "cpu", "--set", f"output_path={output}", "verifier=nowhere:f"]) == 2
    assert "cannot import 'nowhere'" in capsys.readouterr().err
    assert cli.main(["verify", "--params", "cpu"]) == 2
    assert "output_path is ''" in capsys.readouterr().err


def test_training_takes_the_accepted_outputs_when_notebook_02_verified(tmp_path):
    write(tmp_path / "generations.jsonl", [candidate("a", " 4", "4"), candidate("b", " 5", "4")])
    assert resolve_data_path("", "", tmp_path)[0] == str(tmp_path / "generations.jsonl")
    assert resolve_data_path("", "", tmp_path, verified=True)[0] == str(tmp_path / "generations.jsonl")  # none yet
    verify_output(tmp_path / "generations.jsonl", "final_number")
    path, description = resolve_data_path("", "", tmp_path, verified=True)
    assert path == str(tmp_path / "generations.accepted.jsonl") and "verifier accepted" in description


def test_final_number_keeps_the_sign_and_the_decimals_and_exact_match_the_punctuation():
    # A wrong-sign or wrong-decimal answer accepted would become training data.
    assert not final_number_matches(candidate("n", " 5", reference="-5"))
    assert final_number_matches(candidate("m", "so the answer is -5.", reference="#### -5"))
    assert not final_number_matches(candidate("x", " 2.5", reference="3.5"))
    assert final_number_matches(candidate("y", " 0.50", reference="0.5"))
    assert exact_match(candidate("d", ' "Paris!"', reference="Paris"))


def test_a_verifier_that_returns_neither_a_bool_nor_a_number_is_an_error_not_a_rejection():
    # A user's verifier that forgets its return would otherwise reject every output, silently.
    with pytest.raises(VerifyError, match="must return True/False or a number, got NoneType"):
        select([candidate("a", " 4", "4")], lambda record: None)


def test_a_verifier_module_in_the_working_directory_is_found_without_it_on_the_path(tmp_path, monkeypatch):
    # The `workbook` console script does not put the working directory on sys.path; the loader must.
    import sys
    (tmp_path / "cwd_checks.py").write_text("def ok(record):\n    return True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_checks", raising=False)
    assert load_verifier("cwd_checks:ok")({}) is True


def test_verifying_again_replaces_the_accepted_records_and_clears_the_errors_of_the_last_verify(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text("".join(json.dumps(r) + "\n" for r in [candidate("a", " 4", "4"), candidate("b", "boom", "4")]))

    def raises_on_boom(record):
        if record["output"] == "boom":
            raise RuntimeError("cannot judge this one")
        return True

    first = verify_output(output, "test", verifier=raises_on_boom)
    errors = tmp_path / "out.verify_errors.jsonl"
    assert first["verify_errors_path"] == str(errors) and errors.read_text().count("\n") == 1
    second = verify_output(output, "final_number")
    assert second["verify_errors_path"] is None and not errors.exists()  # no stale errors beside a clean verify
    assert [json.loads(line)["metadata"]["example_id"] for line in (tmp_path / "out.accepted.jsonl").open()] == ["a"]
