"""The generation job's records: examples read from a prompts file (ids, prompt field, bad lines),
the output record in seed 000's format, and the failures file's record. One function each.

    examples, bad_lines = load_examples("prompts.jsonl", prompt_field="auto", on_bad_line="skip")
    examples[0].example_id, examples[0].line, examples[0].prompt, examples[0].record
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbook.jsonl import FAIL, BadLine, check_policy, existing_file, handle_bad_line, iter_jsonl

AUTO_PROMPT_FIELD = "auto"
PROMPT_FIELDS = ("input", "prompt", "question")  # what 'auto' looks for, in this order
ID_FIELD = "id"
# Top-level keys of an output record (seed 000's format); input fields with these names that are
# not consumed go under metadata.source_fields instead of overwriting them.
OUTPUT_KEYS = ("input", "output", "difficulty", "domain", "metadata")


@dataclass(frozen=True)
class Example:
    """One prompt to generate for. ``record`` is the whole input line as read."""

    example_id: str | int  # the line's "id" when it has one, else its line number
    line: int  # 1-based line number in the input file
    prompt: str
    record: dict


# How a JSON value that is not text is named in a bad line's reason.
JSON_TYPES = {type(None): "null", bool: "true/false", int: "number", float: "number", list: "array", dict: "object"}


def load_examples(path: str | Path, *, prompt_field: str = AUTO_PROMPT_FIELD, on_bad_line: str = FAIL,
                  max_examples: int = 0) -> tuple[list[Example], list[BadLine]]:
    """The examples of a prompts file, in file order, and the lines skipped under ``on_bad_line='skip'``.

    The prompt is the ``prompt_field`` of each line ('auto': the first of input, prompt, question
    present). Its id is the line's "id" (a string or an integer) or else its line number. A line
    that is not a JSON object, lacks the prompt, has an empty or non-text prompt, an id that is not
    a string or integer, or an id seen before is bad: 'fail' raises DataError naming the file and
    line, 'skip' returns it among the bad lines. ``max_examples`` > 0 stops reading after that many
    examples (bad lines further down are then not looked at).
    """
    check_policy("on_bad_line", on_bad_line)
    path = existing_file(path)
    examples: list[Example] = []
    bad_lines: list[BadLine] = []
    first_line_of: dict[Any, int] = {}
    for number, value in iter_jsonl(path):
        if max_examples and len(examples) >= max_examples:
            break
        problem = value if isinstance(value, BadLine) else _example_problem(path, number, value, prompt_field,
                                                                              first_line_of)
        if problem is not None:
            bad_lines.append(handle_bad_line(problem, on_bad_line, "on_bad_line"))
            continue
        example_id = value.get(ID_FIELD, number)
        first_line_of[example_id] = (number, ID_FIELD in value)
        examples.append(Example(example_id, number, _prompt_of(value, prompt_field)[1], value))
    return examples, bad_lines


def _example_problem(path: Path, number: int, value: dict, prompt_field: str,
                     first_line_of: dict[Any, tuple[int, bool]]) -> BadLine | None:
    example_id = value.get(ID_FIELD, number)
    if isinstance(example_id, bool) or not isinstance(example_id, (str, int)):
        return BadLine(str(path), number, f"'{ID_FIELD}' is {example_id!r}; expected a string or an integer", number)
    if example_id in first_line_of:
        return BadLine(str(path), number, _duplicate_id_text(example_id, ID_FIELD in value, *first_line_of[example_id]),
                       example_id)
    field, prompt = _prompt_of(value, prompt_field)
    if field is None:
        wanted = " or ".join(PROMPT_FIELDS) if prompt_field == AUTO_PROMPT_FIELD else prompt_field
        return BadLine(str(path), number, f"no prompt field ({wanted}); the line has {sorted(value)}", example_id)
    if not isinstance(prompt, str):
        return BadLine(str(path), number, f"'{field}' is {json.dumps(prompt)[:40]} (JSON "
                       f"{JSON_TYPES.get(type(prompt), type(prompt).__name__)}), not text", example_id)
    if not prompt.strip():
        return BadLine(str(path), number, f"'{field}' is empty", example_id)
    return None


def _duplicate_id_text(example_id, explicit: bool, first_line: int, first_explicit: bool) -> str:
    """Why an id is refused as seen before. A line without "id" is known by its line number, which
    an explicit integer id elsewhere can equal: that is refused too, rather than giving implicit
    ids another form, so the ids of outputs already written stay what they are."""
    unique = "ids must be unique (outputs are matched to prompts by id)"
    if not explicit:
        return (f"this line has no '{ID_FIELD}', so its id is its line number, {example_id}, but line {first_line} "
                f"gives '{ID_FIELD}': {example_id!r}; {unique}: give this line an '{ID_FIELD}' of its own")
    if not first_explicit:
        return (f"id {example_id!r} is already the id of line {first_line}, which has no '{ID_FIELD}' and so is known "
                f"by its line number; {unique}: give line {first_line} an '{ID_FIELD}', or this line another one")
    return f"id {example_id!r} already appeared on line {first_line}; {unique}"


def _prompt_of(record: dict, prompt_field: str) -> tuple[str | None, Any]:
    """(field name, prompt) of a record, or (None, None) when it has no prompt field."""
    fields = PROMPT_FIELDS if prompt_field == AUTO_PROMPT_FIELD else (prompt_field,)
    for field in fields:
        if field in record:
            return field, record[field]
    return None, None


def prompt_field_of(record: dict, prompt_field: str) -> str | None:
    """Which field of ``record`` holds its prompt under ``prompt_field`` ('auto' or a name)."""
    return _prompt_of(record, prompt_field)[0]


# ----------------------------------------------------------------------------------------------
# The records written: one function for each format.


def settings_fingerprint(settings: dict) -> str:
    """16 hex digits of SHA-256 over the settings that change an output besides its prompt (the
    model, its dtype, the chat template's use, the decoding settings): a resume compares them."""
    text = json.dumps(settings, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def output_record(example: Example, *, output: str, prompt_field: str, teacher_model: str,
                  generation_params: dict, prompt_tokens: int, output_tokens: int, finish_reason: str,
                  settings_fingerprint: str, sample_index: int | None = None,
                  system_prompt: dict | None = None) -> dict:
    """One output line in seed 000's format, plus what an audit needs.

    ``input`` is the prompt as read (before any chat template), ``output`` the generated text;
    ``difficulty`` and ``domain`` are copied (None when absent); ``metadata.original_output`` is the
    input line's own ``output`` (e.g. a reference answer). ``metadata`` adds ``prompt_tokens`` (as
    fed to the model, template included), ``output_tokens`` (generated, the end-of-sequence token
    included) and ``finish_reason`` ("eos": the model ended it; "length": max_new_tokens or the
    model's context ended it) and ``settings_fingerprint`` (of everything besides the prompt that
    made this output; a resume refuses to mix outputs of different settings in one file). With
    several samples per prompt, ``metadata.sample_index`` (0 to N - 1) says which candidate this is;
    (example_id, sample_index) is then what a resume and a merge count. With a system prompt (prompt
    distillation), ``metadata.system_prompt`` records which (its source, length and SHA-256, not its
    text). Every other input field is carried through at the top level.
    """
    consumed = {prompt_field_of(example.record, prompt_field), "output", "difficulty", "domain"}
    record = {
        "input": example.prompt,
        "output": output,
        "difficulty": example.record.get("difficulty"),
        "domain": example.record.get("domain"),
        "metadata": {
            "original_output": example.record.get("output"),
            "example_id": example.example_id,
            **({} if sample_index is None else {"sample_index": sample_index}),
            "teacher_model": teacher_model,
            "generation_params": generation_params,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "finish_reason": finish_reason,
            "settings_fingerprint": settings_fingerprint,
            **({} if system_prompt is None else {"system_prompt": system_prompt}),
        },
    }
    clashing = {}
    for key, value in example.record.items():
        if key in consumed:
            continue
        if key in OUTPUT_KEYS:
            clashing[key] = value
        else:
            record[key] = value
    if clashing:
        record["metadata"]["source_fields"] = clashing
    return record


def output_record_id(record: dict) -> Any:
    return record["metadata"]["example_id"]


def failure_record(*, example_id: Any, line: int, stage: str, error: str, sample_index: int | None = None) -> dict:
    """One line of the failures file: which example, where it came from, at which stage and why.

    Stages: "input" (a bad line), "prompt_too_long", "generation" (failed alone, even at batch 1),
    "write" (its output record could not be encoded).
    """
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")  # an error may quote text that is not Unicode
    return {"example_id": example_id, "line": line, **({} if sample_index is None else {"sample_index": sample_index}),
            "stage": stage, "error": error, "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def failure_record_id(record: dict) -> Any:
    return record["example_id"]


def output_record_key(record: dict) -> tuple[Any, int]:
    """(example id, sample index) of an output record: the unit a resume and a merge count once."""
    return record["metadata"]["example_id"], record["metadata"].get("sample_index", 0)


def failure_record_key(record: dict) -> tuple[int, int]:
    """(input line, sample index) of a failure record."""
    return record["line"], record.get("sample_index", 0)
