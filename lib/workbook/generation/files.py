"""The files of one output: the output itself, its failures, per-process parts, the summary and the
lock; where they are, the checks before a job writes them (writable, locked, holding what this job
wrote and nothing else), and the merge that checks every example is accounted for."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from workbook import jsonl, runtime
from workbook.generation.engine import BatchStats, GenerationError, summarize
from workbook.generation import records
from workbook.paths import REPO_ROOT

OUTPUT_FILE_NAME = "generations.jsonl"  # in the run folder when output_path is ''


@dataclass(frozen=True)
class OutputFiles:
    """The files of one output: the output, its failures, per-process parts, the summary."""

    output: Path

    def _sibling(self, infix: str) -> Path:
        return self.output.with_name(f"{self.output.stem}{infix}{self.output.suffix or '.jsonl'}")

    @property
    def failures(self) -> Path:
        return self._sibling(".failures")

    @property
    def accepted(self) -> Path:
        """The records a verifier accepted (``verify``), in the output's format."""
        return self._sibling(".accepted")

    @property
    def verify_errors(self) -> Path:
        return self._sibling(".verify_errors")

    @property
    def summary(self) -> Path:
        return self.output.with_name(f"{self.output.stem}.summary.json")

    @property
    def lock(self) -> Path:
        return self.output.with_name(f"{self.output.stem}.lock")

    def output_part(self, rank) -> Path:
        return self.output if rank.count == 1 else self._sibling(f".part-{rank.index}")

    def failures_part(self, rank) -> Path:
        return self.failures if rank.count == 1 else self._sibling(f".failures.part-{rank.index}")

    def output_parts(self) -> list[Path]:
        return sorted(self.output.parent.glob(f"{self.output.stem}.part-*{self.output.suffix or '.jsonl'}"))

    def failure_parts(self) -> list[Path]:
        return sorted(self.output.parent.glob(f"{self.output.stem}.failures.part-*{self.output.suffix or '.jsonl'}"))

    def every_file(self) -> list[Path]:
        """Every file a job on this output may write or replace (the parts: those there now)."""
        return [self.output, self.failures, self.accepted, self.verify_errors, self.summary, self.lock,
                *self.output_parts(), *self.failure_parts()]


def resolve_input_path(text: str) -> Path:
    """A relative prompts path is read from the working directory, else from the repository root."""
    path = Path(text).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path if (REPO_ROOT / path).exists() else path


def resolve_output_path(output_path: str, run_dir: str | Path | None) -> Path:
    """``output_path``, or ``<run_dir>/generations.jsonl`` when it is ''."""
    if output_path:
        return Path(output_path).expanduser()
    if run_dir is None:
        raise GenerationError("output_path is '' (write into the run folder) but there is no run folder; "
                              "set output_path to the JSONL file to write (and to resume).")
    return Path(run_dir) / OUTPUT_FILE_NAME


def lock_output(files: OutputFiles) -> runtime.ExclusiveLock:
    """Check that the output can be written, then take its lock for the whole job; one clear
    GenerationError otherwise, before any model loads. Two jobs on one output would both do all
    the work, and a merge by one could drop what the other appended meanwhile."""
    _check_writable(files.output)
    try:
        return runtime.ExclusiveLock(files.lock).acquire()
    except runtime.LockHeldError as held:
        raise GenerationError(f"another job is writing {files.output}: its lock {files.lock} is held by "
                              f"{held.holder}. Wait for that job to finish (or stop it; a rerun then resumes), "
                              "or set output_path to another file.") from None
    except OSError as error:
        raise GenerationError(f"cannot write in {files.output.parent} (creating the lock file {files.lock.name}: "
                              f"{error.strerror}); set output_path to a file in a folder you can write to.") from None


def _check_writable(output: Path) -> None:
    if output.is_dir():
        raise GenerationError(f"output_path {output} is a folder; set it to a file in it, e.g. "
                              f"output_path={output / OUTPUT_FILE_NAME}")
    folder = output.parent
    if folder.exists() and not folder.is_dir():
        raise GenerationError(f"output_path {output} is inside {folder}, which is a file, not a folder; "
                              "set output_path to a file in a folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if output.exists():
            os.close(os.open(output, os.O_WRONLY | os.O_APPEND))
    except OSError as error:
        raise GenerationError(f"cannot write output_path {output}: {error.strerror} ({error.filename}); set "
                              "output_path to a file in a folder you can write to.") from None


@dataclass(frozen=True)
class Written:
    """What an output record already written says about how it was made (for the resume checks)."""

    prompt_digest: bytes  # of its "input": the prompt as read
    settings: str  # its settings fingerprint ('' before outputs recorded one)
    teacher_model: Any
    generation_params: Any


def prompt_digest(prompt: str) -> bytes:
    return hashlib.sha256(prompt.encode("utf-8")).digest()[:8]  # 64 bits: no accidental match in practice


def written_outputs(files: OutputFiles) -> dict[tuple[Any, int], Written]:
    """(id, sample) -> Written for every complete record of the output and its parts. A line that is not an
    output record of this job (output_path naming another file, e.g. the prompts) stops by name."""
    written = {}
    for path in [files.output, *files.output_parts()]:
        for number, _, record in jsonl.read_complete_lines(path):
            metadata = record.get("metadata")
            if not (isinstance(metadata, dict) and "example_id" in metadata and isinstance(record.get("input"), str)):
                raise GenerationError(f"{path}:{number} is not an output record (no metadata.example_id), so "
                                      f"output_path {files.output} names a file this job did not write (the prompts "
                                      "file?); set output_path to a new file.")
            written[records.output_record_key(record)] = Written(prompt_digest(record["input"]),
                                                                 metadata.get("settings_fingerprint", ""),
                                                                 metadata.get("teacher_model"),
                                                                 metadata.get("generation_params"))
    return written


def check_resume(files: OutputFiles, written: dict[tuple[Any, int], Written], examples, prompts_path: Path, *,
                 settings_fingerprint: str, teacher_model: str, generation_params: dict,
                 samples_per_prompt: int) -> None:
    """Resume matches more than ids: outputs made with other settings, more samples per prompt than
    asked (the audit and the verifier would count them all), or from a prompt that has changed since
    under the same id, stop the job by name instead of staying in the output."""
    def same_settings(entry: Written) -> bool:
        if entry.settings:
            return entry.settings == settings_fingerprint
        return (entry.teacher_model, entry.generation_params) == (teacher_model, generation_params)  # older outputs

    other_settings = [example_id for (example_id, _), entry in written.items() if not same_settings(entry)]
    if other_settings:
        first = next(entry for entry in written.values() if not same_settings(entry))
        now = f"{teacher_model} with {generation_params}"
        if (first.teacher_model, first.generation_params) == (teacher_model, generation_params):
            how = f"the same model and decoding ({now}), so dtype, use_chat_template or system_prompt differ"
        else:
            how = f"{first.teacher_model} with {first.generation_params}; this run: {now}"
        raise GenerationError(
            f"{files.output} holds {len(other_settings)} output(s) made with other settings than this run's (model, "
            f"dtype, use_chat_template, system_prompt or decoding), e.g. id {other_settings[0]!r}: {how}. Resuming would mix them "
            f"in one file: set output_path to a new file for these settings, or move {files.output.name} (and its "
            "part files) away to start again.")
    beyond = sorted({sample for _, sample in written if sample >= samples_per_prompt})
    if beyond:
        raise GenerationError(f"{files.output} holds sample(s) {beyond[0]}..{beyond[-1]} of some prompts, made with "
                              f"samples_per_prompt {beyond[-1] + 1} or more; this run asks {samples_per_prompt}. "
                              f"Set samples_per_prompt: {beyond[-1] + 1} to resume it (more adds samples), or set "
                              "output_path to a new file.")
    digests = {example_id: entry.prompt_digest for (example_id, _), entry in written.items()}
    changed = [e.example_id for e in examples
               if e.example_id in digests and digests[e.example_id] != prompt_digest(e.prompt)]
    if changed:
        shown = ", ".join(repr(i) for i in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise GenerationError(
            f"{len(changed)} prompt(s) in {prompts_path} changed since their outputs were written to {files.output}: "
            f"id {shown}. Resuming would keep the stale outputs: set output_path to a new file, or delete those "
            f"ids' lines from {files.output.name} (and its part files) so that they are generated again.")


def merge_and_audit(files: OutputFiles, examples, bad_lines, per_process: list[dict], *, samples: int = 1,
                    log: Callable[[str], None] = print) -> dict:
    """Merge the parts into the output (ordered by input position) and the failures file (ordered
    by line, minus examples that succeeded since), then check that every candidate (example and
    sample, ``samples`` per example) is accounted for.

    A merge the disk has no room for is not a failure: every record is safe in the output and its
    parts (the resume scan and ``read_outputs`` read them too); it is reported, and a rerun with
    space merges them."""
    positions = {(example.example_id, sample): i * samples + sample
                 for i, example in enumerate(examples) for sample in range(samples)}
    line_of = {example.example_id: example.line for example in examples}
    every_line = {e.line for e in examples} | {b.line for b in bad_lines}
    failure_order = {(line, sample): line * samples + sample for line in every_line for sample in range(samples)}
    merge_error = None
    try:
        jsonl.merge_parts(files.output, files.output_parts(), id_of=records.output_record_key, order=positions)
    except OSError as error:
        if not jsonl.is_disk_full(error):
            raise
        merge_error = error
    output_keys = jsonl.scan_ids([files.output, *files.output_parts()], records.output_record_key)
    succeeded = {(line_of[example_id], sample) for example_id, sample in output_keys if example_id in line_of}
    try:
        jsonl.merge_parts(files.failures, files.failure_parts(), id_of=records.failure_record_key,
                          order=failure_order, keep="last", exclude=succeeded)
    except OSError as error:
        if not jsonl.is_disk_full(error):
            raise
        merge_error = merge_error or error
    failed = {records.failure_record_key(r) for path in [files.failures, *files.failure_parts()]
              for _, _, r in jsonl.read_complete_lines(path)} - succeeded
    if merge_error is not None:
        log(f"warning: the disk is full ({merge_error.strerror}), so {files.output.name} could not be merged and put "
            f"in input order; all {len(output_keys)} outputs are safe in {files.output} and its part files, which "
            "reruns and read_outputs also read. Free some space and rerun the same command to merge them.")
    unaccounted = [e.example_id if samples == 1 else [e.example_id, sample] for e in examples
                   for sample in range(samples)
                   if (e.example_id, sample) not in output_keys and (e.line, sample) not in failed]
    seconds = max((counts["seconds"] for counts in per_process), default=0.0)
    batches = [batch for counts in per_process for batch in counts["batch_list"]]
    combined = summarize([BatchStats(**batch) for batch in batches], seconds)
    return {
        "output_path": str(files.output),
        "failures_path": str(files.failures) if failed else None,
        "examples": len(examples),
        "samples_per_prompt": samples,
        "candidates": len(examples) * samples,
        "bad_input_lines": len(bad_lines),
        "in_output": len(output_keys),
        "in_failures": len(failed),
        # Candidates neither written nor listed as failed: must be 0 (nothing lost).
        "unaccounted": len(unaccounted),
        "unaccounted_ids": unaccounted[:20],
        # False when a full disk left the output in parts, unordered (see the warning above).
        "merged": merge_error is None,
        **combined,
        "too_long": sum(counts["too_long"] for counts in per_process),
        "setup_seconds": max((counts["setup_seconds"] for counts in per_process), default=0.0),
        "per_process": [{k: v for k, v in counts.items() if k != "batch_list"} for counts in per_process],
        "batch_list": batches,
    }


def write_summary(files: OutputFiles, summary: dict, log: Callable[[str], None] = print) -> None:
    """``<output>.summary.json``; a full disk costs only the summary (the outputs are safe), said so."""
    try:
        files.summary.write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as error:
        if not jsonl.is_disk_full(error):
            raise
        files.summary.unlink(missing_ok=True)  # a truncated summary would mislead
        log(f"warning: the disk is full, so {files.summary} was not written; the outputs are safe in "
            f"{files.output}.")


def read_outputs(path: str | Path) -> list[dict]:
    """The records of an output (or failures) file, and of its per-process parts when a full disk
    kept them from being merged."""
    path = Path(path)
    return [record for file in [path, *OutputFiles(path).output_parts()]
            for _, _, record in jsonl.read_complete_lines(file)]
