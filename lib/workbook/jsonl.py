"""JSON-lines files: reading with a stated policy for bad lines, crash-safe appends, resume scans and
the merge of per-process parts. The generation job writes through it and the trainer reads through it.

Writing so that a crash loses nothing and duplicates nothing::

    appender = LineAppender("out.jsonl")       # first cuts a torn last line left by a crash
    appender.write([record, ...])               # whole lines, then flush + fsync
    done = scan_ids(["out.jsonl"], id_of)       # a rerun skips these
    merge_parts("out.jsonl", ["out.part-0.jsonl", ...], id_of=id_of, order=positions)

A line counts only once its newline is on disk: every write ends lines with "\\n", so a last line
without one is the torn remainder of a killed write. Readers ignore it and the next appender cuts it
off before writing, so the example it held is generated again, exactly once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

FAIL, SKIP = "fail", "skip"
BAD_LINE_POLICIES = (FAIL, SKIP)  # the params schema offers the same two (on_bad_line, on_long_prompt)
TAIL_CHUNK_BYTES = 1 << 16  # how far back at a time the torn-line check reads from the end of a file


class DataError(ValueError):
    """An input or output file cannot be used as it is. The message names the file and line."""


@dataclass(frozen=True)
class BadLine:
    """An input line that holds no usable example, and why."""

    path: str
    line: int  # 1-based, as editors count
    reason: str
    example_id: Any = None  # the line's id when it could be read, else the line number

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict | BadLine]]:
    """Yield (line number, JSON object) for each line of ``path``; a line that is not a JSON object
    yields a BadLine instead. Blank lines are not records and are passed over."""
    path = Path(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, BadLine(str(path), number, f"not UTF-8 text (byte {error.start + 1})", number)
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                yield number, BadLine(str(path), number, f"not valid JSON ({error.msg} at column {error.colno})",
                                      number)
                continue
            if not isinstance(value, dict):
                yield number, BadLine(str(path), number, f"a JSON {type(value).__name__}, not an object", number)
                continue
            yield number, value


def read_jsonl(path: str | Path, *, on_bad_line: str = FAIL) -> tuple[list[tuple[int, dict]], list[BadLine]]:
    """Every JSON object of ``path`` with its line number, and the bad lines (only with 'skip')."""
    check_policy("on_bad_line", on_bad_line)
    records, bad_lines = [], []
    for number, value in iter_jsonl(existing_file(path)):
        if isinstance(value, BadLine):
            bad_lines.append(handle_bad_line(value, on_bad_line, "on_bad_line"))
        else:
            records.append((number, value))
    return records, bad_lines


def handle_bad_line(bad_line: BadLine, policy: str, policy_key: str) -> BadLine:
    """Raise for 'fail' (naming the file, line and the key that changes it); return it for 'skip'."""
    if policy == FAIL:
        raise DataError(f"{bad_line.describe()}. Fix or remove that line, or set {policy_key}: skip to go on "
                        "without it (skipped lines are listed in the failures file).")
    return bad_line


def check_policy(key: str, policy: str) -> None:
    if policy not in BAD_LINE_POLICIES:
        raise ValueError(f"{key} is {policy!r}; expected one of {', '.join(BAD_LINE_POLICIES)}")


def existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file. Check prompts_path (relative paths are read from the repository "
                        "root or the current directory).")
    return path


# ----------------------------------------------------------------------------------------------
# Crash-safe appends and the resume scan.


def repair_torn_tail(path: str | Path) -> int:
    """Cut a last line that has no newline (left by a killed write); returns the bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    with path.open("rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - TAIL_CHUNK_BYTES)
            handle.seek(start)
            chunk = handle.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return size - keep


class LineAppender:
    """Appends JSON records to one file as whole lines; each ``write`` ends with flush and fsync.

    Opening cuts a torn last line first. The file is opened O_APPEND and each call writes all its
    lines with one buffer, so a kill leaves at most one torn line at the end, which the next
    appender (or any reader) drops. fsync because flush only reaches the OS: after a power loss or
    a VM preemption, unsynced lines would vanish although the run had counted them as done.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired_bytes = repair_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, records: Iterable[dict]) -> int:
        """Append ``records`` (one JSON line each) and make them durable; returns the count."""
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
        if not lines:
            return 0
        view = memoryview("".join(lines).encode("utf-8"))
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        return len(lines)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "LineAppender":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_complete_lines(path: str | Path) -> Iterator[tuple[int, str, dict]]:
    """(line number, line text, record) for each complete line of a file this module wrote.

    A torn last line is ignored. A complete line that is not a JSON object means the file was
    edited or damaged: DataError names the line, since guessing could lose or duplicate an example.
    """
    path = Path(path)
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.endswith("\n"):
                return  # torn by a killed write; the example is generated again
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                record = error
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: not a JSON object, but this file is written one object per "
                                "line; it was edited or damaged. Remove that line (its example is then generated "
                                "again) and rerun.")
            yield number, line, record


def scan_ids(paths: Iterable[str | Path], id_of: Callable[[dict], Any]) -> set:
    """Ids of every complete record in ``paths`` (missing files count as empty)."""
    return {id_of(record) for path in paths for _, _, record in read_complete_lines(path)}


def merge_parts(target: str | Path, parts: Iterable[str | Path], *, id_of: Callable[[dict], Any],
                order: dict[Any, int], keep: str = "first", exclude: set | None = None) -> int:
    """Rewrite ``target`` as the records of ``target`` and ``parts``, one per id, ordered by
    ``order[id]`` (ids it lacks go last, in reading order); then delete the parts.

    ``keep`` says which record of an id wins ("first" or "last" read; ``target`` is read first);
    ids in ``exclude`` are left out. The new file replaces the old atomically (written beside it,
    fsynced, renamed), so a kill during the merge leaves the old files intact; a target left empty
    is removed. Lines are copied byte for byte. Returns the number of records written.
    """
    target = Path(target)
    parts = [Path(part) for part in parts if Path(part) != target]
    chosen: dict[Any, tuple[int, str]] = {}
    sequence = 0
    for path in [target, *parts]:
        for _, line, record in read_complete_lines(path):
            record_id = id_of(record)
            if exclude and record_id in exclude:
                continue
            if keep == "first" and record_id in chosen:
                continue
            sequence += 1
            chosen[record_id] = (sequence, line)
    unknown = len(order) + 1
    lines = [line for record_id, (sequence, line) in
             sorted(chosen.items(), key=lambda item: (order.get(item[0], unknown), item[1][0]))]
    if lines:
        _replace_atomically(target, "".join(lines))
    elif target.exists():
        target.unlink()
    for part in parts:
        part.unlink(missing_ok=True)
    return len(lines)


def _replace_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".merging")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    # The rename itself is durable only once the directory entry is synced.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
