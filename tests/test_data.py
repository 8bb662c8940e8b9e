"""JSON-lines handling: bad lines by policy, stable ids, the output format, torn lines, merges."""

import json
import os
import re
from types import SimpleNamespace

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
    ('{"input": "What is 1 + 1?"', "not valid JSON (Expecting ',' delimiter at column 27)"),  # cut short: its end
    ('{"input": nope}', "not valid JSON (Expecting value at column 11)"),  # the column an editor shows
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


# ----------------------------------------------------------------------------------------------
# Mutation audit of the durability layer: what a kill, a merge or a damaged file must not lose.


def test_a_torn_line_exactly_one_read_chunk_long_is_cut_and_the_record_before_it_kept(tmp_path):
    # The newline that ends the last whole record then lies just before the chunk read last: the
    # next chunk must start right there, or the cut takes that record with the torn line.
    path = tmp_path / "out.jsonl"
    path.write_text('{"n": 1}\n' + "x" * jsonl.TAIL_CHUNK_BYTES)
    assert jsonl.repair_torn_tail(path) == jsonl.TAIL_CHUNK_BYTES
    assert path.read_text() == '{"n": 1}\n'


def test_a_complete_output_line_that_is_not_utf8_is_an_error_naming_the_line(tmp_path):
    # A resume must stop by name (not with a UnicodeDecodeError) rather than guess past a damaged line.
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": "caf\xe9"}\n{"n": 3}\n')
    with pytest.raises(jsonl.DataError, match=r"out.jsonl:2: not a JSON object.*Remove that line"):
        jsonl.scan_ids([path], lambda r: r["n"])


def test_a_merge_keeps_the_first_record_of_an_id_that_the_output_itself_repeats(tmp_path):
    target = write_lines(tmp_path / "out.jsonl", '{"id": "a", "v": 1}', '{"id": "a", "v": 2}', '{"id": "b", "v": 1}')
    assert jsonl.merge_parts(target, [], id_of=lambda r: r["id"], order={"a": 0, "b": 1}) == 2
    assert target.read_text() == '{"id": "a", "v": 1}\n{"id": "b", "v": 1}\n'


def test_a_merge_puts_ids_the_order_lacks_after_every_ordered_one(tmp_path):
    # "zz" is read first (from the output) but is no input position: it goes after all of them.
    target = write_lines(tmp_path / "out.jsonl", '{"id": "zz"}', '{"id": "b"}')
    part = write_lines(tmp_path / "out.part-0.jsonl", '{"id": "a"}')
    jsonl.merge_parts(target, [part], id_of=lambda r: r["id"], order={"a": 0, "b": 1})
    assert target.read_text() == '{"id": "a"}\n{"id": "b"}\n{"id": "zz"}\n'
    # Orders need not count from 0 (the failures merge orders by line x samples + sample): still last.
    part = write_lines(tmp_path / "out.part-0.jsonl", '{"id": "c"}')
    jsonl.merge_parts(target, [part], id_of=lambda r: r["id"], order={"a": 1, "b": 5, "c": 10})
    assert target.read_text() == '{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n{"id": "zz"}\n'


def test_a_merge_given_its_target_among_the_parts_keeps_the_target(tmp_path):
    # Parts are deleted after a merge: the target listed as one must not be deleted with them.
    target = write_lines(tmp_path / "out.jsonl", '{"id": "b"}')
    part = write_lines(tmp_path / "out.part-0.jsonl", '{"id": "a"}')
    assert jsonl.merge_parts(target, [part, tmp_path / "out.jsonl"], id_of=lambda r: r["id"],
                             order={"a": 0, "b": 1}) == 2
    assert target.read_text() == '{"id": "a"}\n{"id": "b"}\n' and not part.exists()


def test_a_merge_syncs_the_new_file_before_it_replaces_the_old_and_the_folder_after(tmp_path, monkeypatch):
    # Without both, a power loss right after the merge can leave an empty output or the old one
    # with its parts already deleted.
    events = []
    real_fsync, real_replace = jsonl.os.fsync, jsonl.os.replace
    monkeypatch.setattr(jsonl.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                       real_fsync(fd)))
    monkeypatch.setattr(jsonl.os, "replace", lambda old, new: (events.append(("replace", str(old))),
                                                                real_replace(old, new)))
    target = write_lines(tmp_path / "out.jsonl", '{"id": "b"}')
    part = write_lines(tmp_path / "out.part-0.jsonl", '{"id": "a"}')
    jsonl.merge_parts(target, [part], id_of=lambda r: r["id"], order={"a": 0, "b": 1})
    temporary = str(tmp_path / "out.jsonl.merging")
    assert events == [("fsync", temporary), ("replace", temporary), ("fsync", str(tmp_path))]
    assert target.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_one_process_writes_the_output_itself_and_each_of_several_its_own_parts(tmp_path):
    files = generation_files.OutputFiles(tmp_path / "out.jsonl")
    alone, first, second = (SimpleNamespace(index=0, count=1), SimpleNamespace(index=0, count=2),
                            SimpleNamespace(index=1, count=2))
    assert (files.output_part(alone), files.failures_part(alone)) == (files.output, files.failures)
    # The first of several too: otherwise it would append to the output while a merge rewrites it.
    assert [files.output_part(first).name, files.output_part(second).name] == ["out.part-0.jsonl", "out.part-1.jsonl"]
    assert [files.failures_part(first).name, files.failures_part(second).name] == [
        "out.failures.part-0.jsonl", "out.failures.part-1.jsonl"]


def output_line(example_id, sample=0, fingerprint="f"):
    return json.dumps({"input": f"prompt {example_id}", "output": "x", "metadata": {
        "example_id": example_id, "sample_index": sample, "settings_fingerprint": fingerprint}})


def failure_line(example_id, line, error, sample=0):
    return json.dumps(records.failure_record(example_id=example_id, line=line, stage="generation", error=error,
                                             sample_index=sample))


def test_a_resume_counts_outputs_left_in_part_files_as_written(tmp_path):
    # A killed data-parallel run leaves its outputs in parts: a rerun must not generate them again.
    write_lines(tmp_path / "out.jsonl", output_line("a"))
    write_lines(tmp_path / "out.part-1.jsonl", output_line("b"))
    written = generation_files.written_outputs(generation_files.OutputFiles(tmp_path / "out.jsonl"))
    assert set(written) == {("a", 0), ("b", 0)}


NO_BATCHES = {"seconds": 0.0, "batch_list": [], "too_long": 0, "setup_seconds": 0.0}


def examples_on_lines(*lines):
    return [records.Example(f"q{line}", line, f"prompt q{line}", {}) for line in lines]


def test_the_failures_merge_keeps_the_latest_error_of_each_candidate_in_line_and_sample_order(tmp_path):
    files = generation_files.OutputFiles(tmp_path / "out.jsonl")
    write_lines(files.output, output_line("q1", 0))
    write_lines(files.failures, failure_line("q2", 2, "old error", sample=0))
    # A later run failed again (the newer error is the one to read) and failed another sample of line 1.
    write_lines(tmp_path / "out.failures.part-0.jsonl", failure_line("q2", 2, "new error", sample=0),
                failure_line("q1", 1, "its own error", sample=1))
    write_lines(tmp_path / "out.part-0.jsonl", output_line("q2", 1))
    summary = generation_files.merge_and_audit(files, examples_on_lines(1, 2), [], [NO_BATCHES], samples=2,
                                               log=lambda line: None)
    failures = [json.loads(line) for line in files.failures.read_text().splitlines()]
    assert [(f["line"], f["sample_index"], f["error"]) for f in failures] == [(1, 1, "its own error"),
                                                                            (2, 0, "new error")]
    assert summary["in_output"] == 2 and summary["in_failures"] == 2 and summary["unaccounted"] == 0


def test_a_merge_the_disk_has_no_room_for_still_counts_every_record_in_the_parts(tmp_path, monkeypatch):
    # The outputs stay in their parts; the audit must read them there, and a failure since
    # retried with success must not count as failed.
    import errno
    files = generation_files.OutputFiles(tmp_path / "out.jsonl")
    write_lines(files.output, output_line("q1"))
    write_lines(tmp_path / "out.part-0.jsonl", output_line("q2"))
    write_lines(tmp_path / "out.failures.part-0.jsonl", failure_line("q2", 2, "failed before"),
                failure_line("q3", 3, "still failing"))

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl, "_replace_atomically", full)
    said = []
    summary = generation_files.merge_and_audit(files, examples_on_lines(1, 2, 3), [], [NO_BATCHES], log=said.append)
    assert summary["merged"] is False and any("the disk is full" in line for line in said)
    assert summary["in_output"] == 2 and summary["in_failures"] == 1 and summary["unaccounted"] == 0


def test_a_failure_whose_error_quotes_text_that_is_not_unicode_can_still_be_written(tmp_path):
    # The failures file is written strictly: a lone surrogate in the error would fail the whole write.
    record = records.failure_record(example_id="q1", line=1, stage="generation", error="bad token \udc80 here")
    with jsonl.LineAppender(tmp_path / "out.failures.jsonl") as appender:
        appender.write([record])
    written, = jsonl.read_complete_lines(tmp_path / "out.failures.jsonl")
    assert written[2]["error"] == "bad token \\udc80 here"


def test_the_settings_fingerprint_does_not_depend_on_the_order_of_the_settings():
    # A resume compares fingerprints: the same settings listed in another order must still match.
    settings = {"teacher_model": "tiny", "dtype": "fp32", "generation_params": {"temperature": 1.0, "top_p": 0.9}}
    reordered = {"generation_params": {"top_p": 0.9, "temperature": 1.0}, "dtype": "fp32", "teacher_model": "tiny"}
    assert records.settings_fingerprint(settings) == records.settings_fingerprint(reordered)
    assert records.settings_fingerprint(settings) != records.settings_fingerprint({**settings, "dtype": "bf16"})


def test_a_summary_the_disk_cuts_short_is_removed_not_left_half_written(tmp_path, monkeypatch):
    # A half-written summary would mislead whoever reads it; the outputs are safe without one.
    import errno
    files = generation_files.OutputFiles(tmp_path / "out.jsonl")

    def half_then_full(self, text):
        with open(self, "w") as handle:
            handle.write(text[:len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(generation_files.Path, "write_text", half_then_full)
    said = []
    generation_files.write_summary(files, {"in_output": 3, "unaccounted": 0}, log=said.append)
    assert not files.summary.exists() and any("was not written; the outputs are safe" in line for line in said)
