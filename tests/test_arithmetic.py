"""The arithmetic task: the shipped sample file, held-out split, difficulty rule and scoring."""

import pytest

from workbook import arithmetic
from workbook.arithmetic import Problem


def test_shipped_sample_file_matches_the_generator(tmp_path):
    written = arithmetic.write_sample_prompts(tmp_path / "prompts.jsonl")
    assert written.read_bytes() == arithmetic.SAMPLE_PROMPTS_PATH.read_bytes(), (
        "lib/workbook/data/arithmetic_prompts.jsonl is stale; regenerate it with "
        "python -c 'from workbook import arithmetic; arithmetic.write_sample_prompts()'"
    )
    assert arithmetic.load_prompts() == arithmetic.sample_records()


def test_shipped_rejection_sampling_files_match_the_generator_and_are_disjoint(tmp_path):
    pool_path, held_out_path = arithmetic.write_variant_task(tmp_path / "pool.jsonl", tmp_path / "held.jsonl")
    assert pool_path.read_bytes() == arithmetic.VARIANT_POOL_PATH.read_bytes(), (
        "the shipped rejection-sampling files are stale; regenerate them with "
        "python -c 'from workbook import arithmetic; arithmetic.write_variant_task()'")
    assert held_out_path.read_bytes() == arithmetic.VARIANT_HELD_OUT_PATH.read_bytes()
    pool, held_out = (arithmetic.load_prompts(path) for path in (pool_path, held_out_path))
    problems = [{arithmetic.parse_question(record["input"]) for record in records} for records in (pool, held_out)]
    assert [len(found) for found in problems] == [arithmetic.VARIANT_POOL_SIZE, arithmetic.VARIANT_HELD_OUT_SIZE]
    assert not problems[0] & problems[1] and not (problems[0] | problems[1]) & set(arithmetic.sample_problems())
    assert all(record["input"].startswith("What's ") for record in pool + held_out)  # words the tiny model never saw


def test_sample_prompts_are_held_out_from_training():
    training_questions = {problem.question for problem in arithmetic.training_problems()}
    sample_questions = {record["input"] for record in arithmetic.load_prompts()}
    assert len(sample_questions) == arithmetic.SAMPLE_SIZE  # no duplicates
    assert not sample_questions & training_questions
    all_questions = {problem.question for problem in arithmetic.all_problems()}
    assert sample_questions | training_questions == all_questions


def test_records_use_the_seed_format_and_their_output_is_the_true_answer():
    records = arithmetic.load_prompts()
    assert len({record["id"] for record in records}) == len(records)
    for record in records:
        assert set(record) == {"id", "input", "output", "difficulty", "domain"}
        assert record["domain"] == "arithmetic"
        assert record["difficulty"] in {"easy", "hard"}
        left, plus, right = record["input"].removeprefix("What is ").removesuffix("?").split()
        assert plus == "+"
        assert record["output"] == str(int(left) + int(right))
    difficulties = [record["difficulty"] for record in records]
    assert 0.2 < difficulties.count("hard") / len(records) < 0.8  # both levels well represented


@pytest.mark.parametrize(
    "problem, difficulty",
    [
        (Problem(23, 45), "easy"),
        (Problem(3, 4), "easy"),
        (Problem(50, 60), "easy"),  # a three-digit answer, but no carry to propagate
        (Problem(27, 45), "hard"),  # ones column carries into the tens
        (Problem(95, 5), "hard"),
    ],
)
def test_difficulty_is_hard_when_the_ones_column_carries(problem, difficulty):
    assert problem.difficulty == difficulty


def test_question_and_completion_formats():
    assert Problem(23, 45).question == "What is 23 + 45?"
    assert arithmetic.completion_text(arithmetic.answer_text(68)) == " 68"


@pytest.mark.parametrize(
    "generated, parsed",
    [
        (" 68", 68),
        ("68</s>", 68),
        (" 68. Then 70", 68),
        ("-3", -3),
        ("the answer", None),
        ("", None),
    ],
)
def test_parse_answer_takes_the_first_integer(generated, parsed):
    assert arithmetic.parse_answer(generated) == parsed


def test_score_compares_the_first_integer_with_the_reference():
    record = {"id": "x", "input": "What is 23 + 45?", "output": "68"}
    assert arithmetic.score(record, " 68")
    assert not arithmetic.score(record, " 67")
    assert not arithmetic.score(record, " 6 8")
    assert not arithmetic.score(record, "")


def test_score_names_the_record_whose_output_is_not_an_integer():
    with pytest.raises(ValueError, match="'essay-7'.*not an integer"):
        arithmetic.score({"id": "essay-7", "output": "a poem"}, "42")


def test_accuracy_is_the_fraction_scored_correct():
    records = arithmetic.sample_records()[:4]
    texts = [" " + records[0]["output"], " -1", records[2]["output"] + "</s>", ""]
    assert arithmetic.accuracy(records, texts) == 0.5
    with pytest.raises(ValueError, match="4 records but 3 generated texts"):
        arithmetic.accuracy(records, texts[:3])


def test_load_prompts_names_the_bad_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": 1}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: not valid JSON"):
        arithmetic.load_prompts(path)


def test_the_contraction_variant_asks_the_same_problems_in_other_words():
    held_out = set(arithmetic.sample_problems())
    records = arithmetic.variant_records("contraction", 50, seed=7, exclude=held_out)
    assert len({r["id"] for r in records}) == 50 and all(r["input"].startswith("What's ") for r in records)
    for record in records:
        problem = arithmetic.parse_question(record["input"])
        assert problem not in held_out and arithmetic.answer_text(problem.answer) == record["output"]
    assert arithmetic.parse_question("What is 3 + 4?") == Problem(3, 4)
    assert arithmetic.parse_question("What is 300 + 4?") is None  # outside the task's operands
    assert arithmetic.parse_question("What is 3 plus 4?") is None
