"""JSON-lines handling: bad lines by policy, stable ids, the output format, torn lines, merges."""

import json
import re

import pytest

from workbook import jsonl, params
from workbook.generation import files as generation_files, records


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
    ('{"input": 42}', "'input' is 42 (JSON number), not text"),
    ('{"input": null}', "'input' is null (JSON null), not text"),
    ('{"id": {"x": 1}, "input": "a"}', "expected a string or an integer"),
    ('{"id": "dup", "input": "again"}', "id 'dup' already appeared on line 1"),
    ('{"input": "caf\xe9"}', "not UTF-8 text (byte 15)"),
    ('{"input": "half a pair \\ud83d"}', "field 'input' holds an unpaired surrogate escape"),
    ('{"input": "ok", "source": {"tags": ["a", "\\udc80"]}}', "field 'source.tags[1]' holds an unpaired surrogate"),
    ('{"input": "ok", "\\ud800": 1}', "the key '\\ud800' holds an unpaired surrogate"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_a_bad_line_fails_with_file_and_line_or_is_skipped_and_reported(tmp_path, line, reason):
    path = write_lines(tmp_path / "in.jsonl", '{"id": "dup", "input": "first"}', line, '{"input": "last"}')
    with pytest.raises(jsonl.DataError, match=rf"in.jsonl:2: .*{re.escape(reason)}.*set on_bad_line: skip"):
        records.load_examples(path)
    examples, bad = records.load_examples(path, on_bad_line="skip")
    assert [e.line for e in examples] == [1, 3]
    assert len(bad) == 1 and bad[0].line == 2 and reason in bad[0].reason


def test_an_explicit_id_equal_to_another_lines_line_number_is_refused_with_both_lines(tmp_path):
    # Line 3 has no id, so it is known as 3: the explicit integer id 3 on line 1 would collide with it.
    path = write_lines(tmp_path / "in.jsonl", '{"id": 3, "input": "a"}', '{"input": "b"}', '{"input": "c"}')
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:3: this line has no 'id', so its id is its line number, "
                                              r"3, but line 1 gives 'id': 3; .*give this line an 'id' of its own"):
        records.load_examples(path)
    path = write_lines(tmp_path / "in.jsonl", '{"input": "a"}', '{"id": 1, "input": "b"}')
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:2: id 1 is already the id of line 1, which has no 'id' and "
                                              r"so is known by its line number; .*give line 1 an 'id'"):
        records.load_examples(path)
    examples, bad = records.load_examples(path, on_bad_line="skip")
    assert [e.example_id for e in examples] == [1] and [b.line for b in bad] == [2]


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
                                prompt_tokens=15, output_tokens=3, finish_reason="eos",
                                settings_fingerprint="0123abcd")
    assert list(record)[:5] == ["input", "output", "difficulty", "domain", "metadata"]
    assert record["input"] == "What is 2 + 3?" and record["output"] == " 5"
    assert record["metadata"] == {
        "original_output": "5", "example_id": "q1", "teacher_model": "tiny",
        "generation_params": {"temperature": None, "top_p": None, "max_new_tokens": 8},
        "prompt_tokens": 15, "output_tokens": 3, "finish_reason": "eos", "settings_fingerprint": "0123abcd",
        "source_fields": {"metadata": {"page": 3}}}
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


def test_the_appender_syncs_every_write_or_by_count_and_time_and_always_on_close(tmp_path, monkeypatch):
    """What a power loss can take: nothing the batch path wrote (each write synced), at most
    fsync_every's lines or seconds of the continuous path's, and nothing once the appender is closed."""
    synced, clock = [], [0.0]
    monkeypatch.setattr(jsonl.os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(jsonl.time, "monotonic", lambda: clock[0])
    with jsonl.LineAppender(tmp_path / "batches.jsonl") as appender:
        appender.write([{"n": 1}, {"n": 2}])
        appender.write([{"n": 3}])
        assert len(synced) == 2  # one per write, before it returns
    assert len(synced) == 2  # nothing left unsynced to close with

    synced.clear()
    with jsonl.LineAppender(tmp_path / "lines.jsonl", fsync_every=(3, 10.0)) as appender:
        appender.write([{"n": 1}]); appender.write([{"n": 2}])
        assert synced == []  # 2 lines, 0 s: not yet due
        appender.write([{"n": 3}])
        assert len(synced) == 1  # the third line
        appender.write([{"n": 4}])
        clock[0] = 10.0
        appender.write([{"n": 5}])
        assert len(synced) == 2  # 2 lines, but 10 s since the last sync
        appender.write([{"n": 6}])
        assert len(synced) == 2
    assert len(synced) == 3  # closing syncs the line still unsynced
    assert [json.loads(line)["n"] for line in (tmp_path / "lines.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_whole_last_record_without_its_newline_is_kept_not_cut(tmp_path):
    # A hand edit or another tool's writer: the record is whole, so it counts and is never generated again.
    path = tmp_path / "out.jsonl"
    path.write_text('{"n": 1}\n{"n": 2}')
    assert jsonl.scan_ids([path], lambda r: r["n"]) == {1, 2}
    with jsonl.LineAppender(path) as appender:
        assert appender.repaired_bytes == 0
        appender.write([{"n": 3}])
    assert path.read_text() == '{"n": 1}\n{"n": 2}\n{"n": 3}\n'
    part = tmp_path / "out.part-0.jsonl"
    part.write_text('{"n": 4}')  # merged parts keep it too, on a line of its own
    jsonl.merge_parts(path, [part], id_of=lambda r: r["n"], order={})
    assert path.read_text() == '{"n": 1}\n{"n": 2}\n{"n": 3}\n{"n": 4}\n'


def test_a_record_that_cannot_be_encoded_is_rejected_alone_or_stops_a_strict_write(tmp_path):
    path = tmp_path / "out.jsonl"
    with jsonl.LineAppender(path) as appender:
        rejected = appender.write_encodable([{"n": 1}, {"n": 2, "text": "split \udc80"}, {"n": 3}])
        assert [position for position, _ in rejected] == [1] and "field 'text'" in rejected[0][1]
        with pytest.raises(ValueError, match=r"record 1 of the batch cannot be written: .*not valid Unicode"):
            appender.write([{"n": "\ud800"}, {"n": 4}])
    assert path.read_text() == '{"n": 1}\n{"n": 3}\n'  # the strict write wrote nothing


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


def test_a_merge_with_nothing_to_change_does_not_rewrite_and_clears_a_killed_merge(tmp_path):
    target = write_lines(tmp_path / "out.jsonl", '{"id": "a"}', '{"id": "b"}')
    (tmp_path / "out.jsonl.merging").write_text('{"id": "a"}\n')  # a merge killed mid-copy
    with target.open("a") as handle:
        handle.write('{"id": "c"')  # and a torn last line
    inode = target.stat().st_ino
    assert jsonl.merge_parts(target, [], id_of=lambda r: r["id"], order={"a": 0, "b": 1}) == 2
    assert target.stat().st_ino == inode and target.read_text() == '{"id": "a"}\n{"id": "b"}\n'  # cut, not copied
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_outputs_left_in_parts_are_read_with_the_output(tmp_path):
    write_lines(tmp_path / "out.jsonl", '{"n": 1}')
    write_lines(tmp_path / "out.part-1.jsonl", '{"n": 2}')
    write_lines(tmp_path / "out.failures.part-0.jsonl", '{"n": 3}')
    assert [r["n"] for r in generation_files.read_outputs(tmp_path / "out.jsonl")] == [1, 2]
    assert [r["n"] for r in generation_files.read_outputs(tmp_path / "out.failures.jsonl")] == [3]


def test_a_merge_that_cannot_replace_the_output_keeps_every_part(tmp_path, monkeypatch):
    # A full disk (or a kill) during the merge of a data-parallel run must lose none of the parts' records.
    import errno
    target, part = tmp_path / "out.jsonl", tmp_path / "out.part-0.jsonl"
    target.write_text('{"id": "b"}\n')
    part.write_text('{"id": "a"}\n')

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl, "_replace_atomically", full)
    with pytest.raises(OSError):
        jsonl.merge_parts(target, [part], id_of=lambda r: r["id"], order={"a": 0, "b": 1})
    assert part.read_text() == '{"id": "a"}\n' and target.read_text() == '{"id": "b"}\n'


def test_a_boolean_id_is_refused_by_line_not_read_as_1(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "x", "input": "a"}\n{"id": true, "input": "b"}\n')
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:2: 'id' is True; expected a string or an integer"):
        records.load_examples(path)
