"""JSON-lines handling: bad lines by policy, stable ids, the output format, torn lines, merges."""

import json
import re

import pytest

from workbook import jsonl, params
from workbook.generation import records


def write_lines(path, *lines):
    path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))  # latin-1: lets a test write bad UTF-8
    return path


def test_ids_are_the_given_id_or_the_line_number_and_other_fields_are_kept(tmp_path):
    path = write_lines(tmp_path / "in.jsonl",
                       '{"id": "a", "input": "What is 1 + 1?", "domain": "arithmetic"}',
                       "",
                       '{"question": "Why?", "source": "web"}',
                       '{"id": 7, "prompt": "Hi"}')
    examples, bad = records.load_examples(path)
    assert bad == []
    assert [(e.example_id, e.line, e.prompt) for e in examples] == [("a", 1, "What is 1 + 1?"), (3, 3, "Why?"),
                                                                      (7, 4, "Hi")]
    assert examples[1].record["source"] == "web"
    named, _ = records.load_examples(path, prompt_field="prompt", on_bad_line="skip")
    assert [e.example_id for e in named] == [7]


BAD_LINES = [
    ('{"input": "What is 1 + 1?"', "not valid JSON"),
    ('["a list"]', "a JSON list, not an object"),
    ('{"text": "no prompt here"}', "no prompt field (input or prompt or question)"),
    ('{"input": "   "}', "'input' is empty"),
    ('{"input": 42}', "'input' is a int, not text"),
    ('{"id": {"x": 1}, "input": "a"}', "expected a string or an integer"),
    ('{"id": "dup", "input": "again"}', "id 'dup' already appeared on line 1"),
    ('{"input": "caf\xe9"}', "not UTF-8 text (byte 15)"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_a_bad_line_fails_with_file_and_line_or_is_skipped_and_reported(tmp_path, line, reason):
    path = write_lines(tmp_path / "in.jsonl", '{"id": "dup", "input": "first"}', line, '{"input": "last"}')
    with pytest.raises(jsonl.DataError, match=rf"in.jsonl:2: .*{re.escape(reason)}.*set on_bad_line: skip"):
        records.load_examples(path)
    examples, bad = records.load_examples(path, on_bad_line="skip")
    assert [e.line for e in examples] == [1, 3]
    assert len(bad) == 1 and bad[0].line == 2 and reason in bad[0].reason


def test_max_examples_stops_reading_before_later_bad_lines(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", '{"input": "a"}', '{"input": "b"}', "{broken")
    examples, _ = records.load_examples(path, max_examples=2)
    assert [e.prompt for e in examples] == ["a", "b"]
    with pytest.raises(jsonl.DataError, match="no such file"):
        records.load_examples(tmp_path / "missing.jsonl")


def test_policies_match_the_params_schema():
    assert params.SCHEMA["on_bad_line"].choices == jsonl.BAD_LINE_POLICIES
    assert params.SCHEMA["on_long_prompt"].choices == jsonl.BAD_LINE_POLICIES


def test_output_record_has_seed_format_and_audit_fields():
    example = records.Example("q1", 4, "What is 2 + 3?", {"id": "q1", "input": "What is 2 + 3?", "output": "5",
                                                       "difficulty": "easy", "domain": "arithmetic",
                                                       "source": "book", "metadata": {"page": 3}})
    record = records.output_record(example, output=" 5", prompt_field="auto", teacher_model="tiny",
                                generation_params={"temperature": None, "top_p": None, "max_new_tokens": 8},
                                prompt_tokens=15, output_tokens=3, finish_reason="eos")
    assert list(record)[:5] == ["input", "output", "difficulty", "domain", "metadata"]
    assert record["input"] == "What is 2 + 3?" and record["output"] == " 5"
    assert record["metadata"] == {
        "original_output": "5", "example_id": "q1", "teacher_model": "tiny",
        "generation_params": {"temperature": None, "top_p": None, "max_new_tokens": 8},
        "prompt_tokens": 15, "output_tokens": 3, "finish_reason": "eos", "source_fields": {"metadata": {"page": 3}}}
    assert record["source"] == "book" and record["id"] == "q1"
    assert records.output_record_id(json.loads(json.dumps(record))) == "q1"


def test_appender_writes_whole_lines_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "out.jsonl"
    with jsonl.LineAppender(path) as appender:
        appender.write([{"n": 1}, {"n": 2}])
    with path.open("a") as handle:
        handle.write('{"n": 3, "text": "cut off by kill -')  # what a killed write leaves
    assert jsonl.scan_ids([path], lambda r: r["n"]) == {1, 2}  # readers ignore the torn line
    with jsonl.LineAppender(path) as appender:
        assert appender.repaired_bytes == len('{"n": 3, "text": "cut off by kill -')
        appender.write([{"n": 3}])
    assert path.read_text() == '{"n": 1}\n{"n": 2}\n{"n": 3}\n'


def test_a_torn_line_longer_than_the_read_chunk_and_a_file_with_only_a_torn_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"n": 1}\n' + "x" * (3 * jsonl.TAIL_CHUNK_BYTES))
    assert jsonl.repair_torn_tail(path) == 3 * jsonl.TAIL_CHUNK_BYTES
    assert path.read_text() == '{"n": 1}\n'
    path.write_text('{"n": 1')
    assert jsonl.repair_torn_tail(path) == 7 and path.read_text() == ""
    assert jsonl.repair_torn_tail(tmp_path / "absent.jsonl") == 0


def test_a_damaged_complete_line_is_an_error_naming_the_line(tmp_path):
    path = write_lines(tmp_path / "out.jsonl", '{"n": 1}', "garbage", '{"n": 3}')
    with pytest.raises(jsonl.DataError, match=r"out.jsonl:2: not a JSON object.*Remove that line"):
        jsonl.scan_ids([path], lambda r: r["n"])


def test_merge_orders_deduplicates_excludes_and_removes_parts(tmp_path):
    target = write_lines(tmp_path / "out.jsonl", '{"id": "c", "v": 1}')
    part0 = write_lines(tmp_path / "out.part-0.jsonl", '{"id": "a", "v": 1}', '{"id": "zz", "v": 1}')
    part1 = write_lines(tmp_path / "out.part-1.jsonl", '{"id": "b", "v": 1}', '{"id": "a", "v": 2}')
    with part1.open("a") as handle:
        handle.write('{"id": "d"')  # torn: not merged
    count = jsonl.merge_parts(target, [part0, part1], id_of=lambda r: r["id"], order={"a": 0, "b": 1, "c": 2, "d": 3})
    assert count == 4 and not part0.exists() and not part1.exists()
    assert [json.loads(line) for line in target.read_text().splitlines()] == [
        {"id": "a", "v": 1}, {"id": "b", "v": 1}, {"id": "c", "v": 1}, {"id": "zz", "v": 1}]
    last = write_lines(tmp_path / "f.jsonl", '{"id": "a", "v": 1}', '{"id": "a", "v": 2}', '{"id": "b", "v": 1}')
    assert jsonl.merge_parts(last, [], id_of=lambda r: r["id"], order={}, keep="last", exclude={"b"}) == 1
    assert json.loads(last.read_text()) == {"id": "a", "v": 2}
    assert jsonl.merge_parts(last, [], id_of=lambda r: r["id"], order={}, exclude={"a"}) == 0
    assert not last.exists()  # an empty result leaves no empty file behind
