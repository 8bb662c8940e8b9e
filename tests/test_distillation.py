"""Prompt distillation: the teacher sees a system prompt, the records and the student's input do not."""

import pytest

from test_generate import job_params, read_records, write_prompts
from workbook import arithmetic, generation, models, training
from workbook.training.examples import IGNORE_INDEX

SYSTEM_PROMPT = "You add numbers."


def test_the_teacher_sees_the_system_prompt_and_the_training_input_does_not(tmp_path, tiny_model_path):
    tokenizer = models.load_tokenizer(str(tiny_model_path))
    question = "What is 2 + 3?"
    plain, = generation.tokenize_prompts(tokenizer, [question], use_chat_template=True)
    taught, = generation.tokenize_prompts(tokenizer, [question], use_chat_template=True, system_prompt=SYSTEM_PROMPT)
    assert SYSTEM_PROMPT in tokenizer.decode(taught) and SYSTEM_PROMPT not in tokenizer.decode(plain)

    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:4])
    (tmp_path / "system.txt").write_text(SYSTEM_PROMPT + "\n")
    runs = {}
    for name, value in (("without", ""), ("inline", SYSTEM_PROMPT), ("file", f"@{tmp_path / 'system.txt'}")):
        output = tmp_path / f"{name}.jsonl"
        generation.run_job(job_params(prompts, output, system_prompt=value), output, show_progress=False,
                           log=lambda line: None)
        runs[name] = read_records(output)
    for name in ("inline", "file"):
        for taught_record, plain_record in zip(runs[name], runs["without"]):
            assert taught_record["input"] == plain_record["input"]  # the prompt as read, never the system prompt
            recorded = taught_record["metadata"]["system_prompt"]
            assert recorded["characters"] == len(SYSTEM_PROMPT) and len(recorded["sha256"]) == 16
            # The teacher's prompt held the system turn: its header, its text and its end of turn.
            with_turn, = generation.tokenize_prompts(tokenizer, [plain_record["input"]], use_chat_template=True,
                                                     system_prompt=SYSTEM_PROMPT)
            assert taught_record["metadata"]["prompt_tokens"] == len(with_turn) > plain_record["metadata"]["prompt_tokens"]
    digests = {name: runs[name][0]["metadata"]["system_prompt"]["sha256"] for name in ("inline", "file")}
    assert digests["inline"] == digests["file"]  # the same text, whichever way it was given
    assert runs["file"][0]["metadata"]["system_prompt"]["source"].startswith("@")
    assert "system_prompt" not in runs["without"][0]["metadata"]

    config = training.TrainConfig(model=str(tiny_model_path), data_path=str(tmp_path / "inline.jsonl"),
                                  data_description="distilled", output_dir=str(tmp_path / "train"),
                                  use_chat_template=True, validation_fraction=0.0)
    prepared = training.prepare_data(config, tokenizer)
    assert all(SYSTEM_PROMPT not in tokenizer.decode(example.input_ids) for example in prepared.train)


def test_a_system_prompt_file_that_is_missing_stops_the_job_before_it_generates(tmp_path):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:2])
    output = tmp_path / "out.jsonl"
    with pytest.raises(generation.GenerationError, match=r"system_prompt '@.*nowhere.txt': no such file"):
        generation.run_job(job_params(prompts, output, system_prompt=f"@{tmp_path / 'nowhere.txt'}"), output,
                           show_progress=False, log=lambda line: None)
    assert not output.exists()


def test_a_system_prompt_file_that_is_a_folder_or_not_utf8_is_named(tmp_path):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:2])
    output = tmp_path / "out.jsonl"
    (tmp_path / "latin1.txt").write_bytes("Réponds en français.".encode("latin-1"))
    for name, message in (("latin1.txt", r"latin1.txt is not UTF-8 text \(at byte offset 1: invalid continuation byte\)"),
                          (".", r"is a folder, not a file")):
        with pytest.raises(generation.GenerationError, match=message):
            generation.run_job(job_params(prompts, output, system_prompt=f"@{tmp_path / name}"), output,
                               show_progress=False, log=lambda line: None)
    assert not output.exists()


@pytest.mark.parametrize("use_chat_template", [True, False])
def test_the_student_trains_on_the_prompt_tokens_the_teacher_was_given(tmp_path, tiny_model_path, use_chat_template):
    # One formatting for both jobs: a student trained on other prompt tokens than it is asked with
    # at inference learns replies to a prompt it never sees.
    tokenizer = models.load_tokenizer(str(tiny_model_path))
    records = arithmetic.sample_records()[:6]
    data = write_prompts(tmp_path / "train.jsonl", records)
    config = training.TrainConfig(model=str(tiny_model_path), data_path=str(data), data_description="t",
                                  output_dir=str(tmp_path / "train"), use_chat_template=use_chat_template,
                                  validation_fraction=0.0)
    trained = training.prepare_data(config, tokenizer).train
    teacher = generation.tokenize_prompts(tokenizer, [r["input"] for r in records], use_chat_template)
    by_tokens = {tuple(example.input_ids): example for example in trained}
    for prompt in teacher:
        example = next(e for ids, e in by_tokens.items() if ids[:len(prompt)] == tuple(prompt))
        masked = example.labels[:len(prompt)]
        assert all(label == IGNORE_INDEX for label in masked)  # the prompt is not learned
        assert example.labels[len(prompt)] != IGNORE_INDEX  # the reply starts right after it


def test_a_chat_template_asked_of_a_tokenizer_without_one_names_the_key_in_both_jobs(tmp_path, tiny_model_path):
    from workbook.jsonl import DataError
    tokenizer = models.load_tokenizer(str(tiny_model_path))
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="use_chat_template is true but the tokenizer .* has no chat template; set "
                                        "use_chat_template: false"):
        generation.tokenize_prompts(tokenizer, ["What is 2 + 3?"], use_chat_template=True)
    data = write_prompts(tmp_path / "train.jsonl", arithmetic.sample_records()[:2])
    config = training.TrainConfig(model=str(tiny_model_path), data_path=str(data), data_description="t",
                                  output_dir=str(tmp_path / "train"), use_chat_template=True, validation_fraction=0.0)
    with pytest.raises(DataError, match="has no chat template; set use_chat_template: false"):
        training.prepare_data(config, tokenizer)
