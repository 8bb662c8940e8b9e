"""The files of one output: the output itself, its failures, per-process parts and the summary;
where they are, and the merge that checks every example is accounted for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workbook import jsonl
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

    def output_part(self, rank) -> Path:
        return self.output if rank.count == 1 else self._sibling(f".part-{rank.index}")

    def failures_part(self, rank) -> Path:
        return self.failures if rank.count == 1 else self._sibling(f".failures.part-{rank.index}")

    def output_parts(self) -> list[Path]:
        return sorted(self.output.parent.glob(f"{self.output.stem}.part-*{self.output.suffix or '.jsonl'}"))

    def failure_parts(self) -> list[Path]:
        return sorted(self.output.parent.glob(f"{self.output.stem}.failures.part-*{self.output.suffix or '.jsonl'}"))


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


def merge_and_audit(files: OutputFiles, examples, bad_lines, per_process: list[dict]) -> dict:
    """Merge the parts into the output (ordered by input position) and the failures file (ordered
    by line, minus examples that succeeded since), then check that every example is accounted for."""
    positions = {example.example_id: i for i, example in enumerate(examples)}
    written = jsonl.merge_parts(files.output, files.output_parts(), id_of=records.output_record_id, order=positions)
    output_ids = jsonl.scan_ids([files.output], records.output_record_id)
    every_line = {e.line for e in examples} | {b.line for b in bad_lines}
    succeeded_lines = {examples[positions[i]].line for i in output_ids if i in positions}
    failure_count = jsonl.merge_parts(files.failures, files.failure_parts(), id_of=lambda r: r["line"],
                                     order={line: line for line in every_line}, keep="last", exclude=succeeded_lines)
    failed_lines = {r["line"] for _, _, r in jsonl.read_complete_lines(files.failures)}
    unaccounted = [e.example_id for e in examples if e.example_id not in output_ids and e.line not in failed_lines]
    seconds = max((counts["seconds"] for counts in per_process), default=0.0)
    batches = [batch for counts in per_process for batch in counts["batch_list"]]
    combined = summarize([BatchStats(**batch) for batch in batches], seconds)
    return {
        "output_path": str(files.output),
        "failures_path": str(files.failures) if failure_count else None,
        "examples": len(examples),
        "bad_input_lines": len(bad_lines),
        "in_output": written,
        "in_failures": failure_count,
        # Examples neither written nor listed as failed: must be 0 (nothing lost).
        "unaccounted": len(unaccounted),
        "unaccounted_ids": unaccounted[:20],
        **combined,
        "too_long": sum(counts["too_long"] for counts in per_process),
        "setup_seconds": max((counts["setup_seconds"] for counts in per_process), default=0.0),
        "per_process": [{k: v for k, v in counts.items() if k != "batch_list"} for counts in per_process],
        "batch_list": batches,
    }


def read_outputs(path: str | Path) -> list[dict]:
    return [record for _, _, record in jsonl.read_complete_lines(path)]

