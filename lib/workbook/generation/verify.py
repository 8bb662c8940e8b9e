"""Which generated outputs are right, and the set kept for training (rejection sampling, seed 002).

A verifier is called with one output record (the dict the job writes, seed 000's format) and
returns True/False or a number (accepted when > 0)::

    verifier = load_verifier("final_number")          # built in; or "my_checks:is_correct"
    summary = verify_output("out/teacher.jsonl", "final_number", max_accepted_per_prompt=4)
    # -> out/teacher.accepted.jsonl: the accepted records, as they are, so the trainer reads them

It runs after generation and on an existing output alike (``workbook verify``), so a rule can be
changed without generating again. A verifier that raises on one record makes that record a failure
with its error (``<stem>.verify_errors.jsonl``), never the job's.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workbook import job_keys, jsonl
from workbook.generation.files import OutputFiles, read_outputs

PARAMS_USED = job_keys.VERIFY
ERROR_TEXT_LIMIT = 500  # characters of a verifier's error kept per record
# Where the reference answer of a record is looked for, in order: the input line's own "output"
# (kept as metadata.original_output), then the GSM8K-style "answer" and a generic "reference"
# field carried through at the top level.
REFERENCE_FIELDS = ("answer", "reference")
# A number as people write it: sign, thousands separators, decimals ("-1,234.50").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class VerifyError(ValueError):
    """The verifier setting cannot be used; the message names the key and what to change."""


def reference_of(record: dict) -> str | None:
    """The reference answer of an output record, or None when it has none."""
    original = record.get("metadata", {}).get("original_output")
    if original is not None:
        return str(original)
    for name in REFERENCE_FIELDS:
        if record.get(name) is not None:
            return str(record[name])
    return None


def final_number(text: str) -> float | None:
    """The last number in ``text`` (GSM8K answers end "#### 72"; models end "... so 72."), or None."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return float(numbers[-1].replace(",", "").rstrip("."))


def final_number_matches(record: dict) -> bool:
    """Built-in ``final_number``: the output's last number equals the reference's last number."""
    reference = reference_of(record)
    if reference is None:
        raise VerifyError("no reference answer (metadata.original_output, answer or reference) to compare with")
    expected = final_number(reference)
    if expected is None:
        raise VerifyError(f"the reference {reference!r} holds no number")
    return final_number(record["output"]) == expected


def normalize(text: str) -> str:
    """Case, Unicode form, surrounding punctuation and runs of white space do not count."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.split()).strip(" .,;:!?\"'")


def exact_match(record: dict) -> bool:
    """Built-in ``exact_match``: the output equals the reference after ``normalize``."""
    reference = reference_of(record)
    if reference is None:
        raise VerifyError("no reference answer (metadata.original_output, answer or reference) to compare with")
    return normalize(record["output"]) == normalize(reference)


BUILT_IN = {"final_number": final_number_matches, "exact_match": exact_match}


def load_verifier(spec: str) -> Callable[[dict], Any] | None:
    """None for '' (no verification); a built-in by name; or a user's ``module:function``, imported
    from the working directory or PYTHONPATH."""
    if not spec:
        return None
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise VerifyError(f"verifier {spec!r}: expected one of {', '.join(BUILT_IN)}, '' (none), or "
                          "'module:function' (e.g. my_checks:is_correct, importable from the working directory)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: a checks module beside the user's data
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise VerifyError(f"verifier {spec!r}: cannot import {module_name!r} ({error}); put it in the working "
                          "directory or on PYTHONPATH") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise VerifyError(f"verifier {spec!r}: {module_name} has no function {function_name!r}")
    return function


def record_key(record: dict) -> tuple[Any, int]:
    """(example id, sample index) of an output record: one candidate of one prompt."""
    metadata = record["metadata"]
    return metadata["example_id"], metadata.get("sample_index", 0)


@dataclass
class Selection:
    """What the verifier made of an output: the accepted records, the failures, the pass rates."""

    accepted: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # one per record the verifier raised on
    samples: dict[Any, int] = field(default_factory=dict)  # example id -> candidates verified
    passed: dict[Any, int] = field(default_factory=dict)  # example id -> candidates accepted (duplicates too)
    duplicates: int = 0  # accepted candidates left out because the same prompt already had that output
    capped: int = 0  # accepted candidates left out by max_accepted_per_prompt

    def summary(self) -> dict:
        rates = {example_id: self.passed.get(example_id, 0) / count for example_id, count in self.samples.items()}
        candidates = sum(self.samples.values())
        return {
            "candidates": candidates,
            "prompts": len(self.samples),
            "accepted_candidates": sum(self.passed.values()),
            "acceptance_rate": sum(self.passed.values()) / candidates if candidates else None,
            "prompts_with_an_accepted_sample": sum(1 for count in self.passed.values() if count),
            "written": len(self.accepted),
            "duplicates_dropped": self.duplicates,
            "capped": self.capped,
            "verifier_errors": len(self.errors),
            "pass_rate_per_prompt": rates,
        }


def select(records: list[dict], verifier: Callable[[dict], Any], max_accepted_per_prompt: int = 0) -> Selection:
    """Verify every record; keep the accepted ones in order, each prompt's identical outputs once and
    at most ``max_accepted_per_prompt`` per prompt (0: no cap)."""
    selection = Selection()
    kept_outputs: dict[Any, set[str]] = {}
    for record in records:
        example_id, sample_index = record_key(record)
        selection.samples[example_id] = selection.samples.get(example_id, 0) + 1
        try:
            score = verifier(record)
        except Exception as error:  # the user's code: one record's failure, not the job's
            text = f"{type(error).__name__}: {error}"
            selection.errors.append({"example_id": example_id, "sample_index": sample_index,
                                     "stage": "verify", "error": text[:ERROR_TEXT_LIMIT]})
            continue
        if not _accepted(score):
            continue
        selection.passed[example_id] = selection.passed.get(example_id, 0) + 1
        outputs = kept_outputs.setdefault(example_id, set())
        if record["output"] in outputs:
            selection.duplicates += 1
        elif max_accepted_per_prompt and len(outputs) >= max_accepted_per_prompt:
            selection.capped += 1
        else:
            outputs.add(record["output"])
            selection.accepted.append(record)
    return selection


def _accepted(score: Any) -> bool:
    if isinstance(score, bool):
        return score
    if isinstance(score, (int, float)):
        return score > 0
    raise VerifyError(f"a verifier must return True/False or a number, got {type(score).__name__} {score!r}")


def verify_output(output_path: str | Path, verifier_spec: str, max_accepted_per_prompt: int = 0,
                  verifier: Callable[[dict], Any] | None = None) -> dict:
    """Verify an existing output: write ``<stem>.accepted.jsonl`` (and ``<stem>.verify_errors.jsonl``
    when the verifier raised) beside it, each replaced whole; return the summary."""
    files = OutputFiles(Path(output_path))
    verifier = verifier or load_verifier(verifier_spec)
    if verifier is None:
        raise VerifyError("verifier is '' (none): set verifier to final_number, exact_match or module:function")
    if not files.output.is_file():
        raise VerifyError(f"{files.output}: no such output to verify; generate first or fix output_path")
    records = read_outputs(files.output)  # its unmerged parts too, when a full disk left some
    selection = select(records, verifier, max_accepted_per_prompt)
    jsonl.write_whole(files.accepted, selection.accepted)
    if selection.errors:
        jsonl.write_whole(files.verify_errors, selection.errors)
    else:
        files.verify_errors.unlink(missing_ok=True)
    return {"verifier": verifier_spec, "max_accepted_per_prompt": max_accepted_per_prompt,
            "accepted_path": str(files.accepted),
            "verify_errors_path": str(files.verify_errors) if selection.errors else None,
            **selection.summary()}


def summary_lines(summary: dict) -> list[str]:
    """The verification in words (``workbook verify``, ``workbook generate``)."""
    rate = summary["acceptance_rate"]
    lines = [f"verifier {summary['verifier']}: {summary['accepted_candidates']} of {summary['candidates']} outputs "
             f"accepted ({'n/a' if rate is None else f'{rate:.1%}'}); {summary['prompts_with_an_accepted_sample']} of "
             f"{summary['prompts']} prompts have at least one",
             f"accepted: {summary['accepted_path']} ({summary['written']} records; {summary['duplicates_dropped']} "
             f"identical and {summary['capped']} over max_accepted_per_prompt left out)"]
    if summary["verify_errors_path"]:
        lines.append(f"the verifier raised on {summary['verifier_errors']} records: {summary['verify_errors_path']}")
    return lines
