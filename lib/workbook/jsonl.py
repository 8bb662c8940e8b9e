"""JSON-lines files: reading with a stated policy for bad lines, crash-safe appends, resume scans and
the merge of per-process parts. The generation job writes through it and the trainer reads through it.

Writing so that a crash loses nothing and duplicates nothing::

    appender = LineAppender("out.jsonl")       # first cuts a torn last line left by a crash
    appender.write([record, ...])               # whole lines, then flush + fsync
    appender.write_encodable([record, ...])     # the same, but a record UTF-8 cannot hold fails alone
    done = scan_ids(["out.jsonl"], id_of)       # a rerun skips these
    merge_parts("out.jsonl", ["out.part-0.jsonl", ...], id_of=id_of, order=positions)

A line counts only once its newline is on disk: every write ends lines with "\\n", so a last line
without one is the torn remainder of a killed write. Readers ignore it and the next appender cuts it
off before writing, so the example it held is generated again, exactly once. A last line that is a
whole JSON object all the same (a hand edit, another tool's writer) is a record, not a torn one:
readers take it, and the next appender ends it with its newline instead.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

FAIL, SKIP = "fail", "skip"
BAD_LINE_POLICIES = (FAIL, SKIP)  # the params schema offers the same two (on_bad_line, on_long_prompt)
TAIL_CHUNK_BYTES = 1 << 16  # how far back at a time the torn-line check reads from the end of a file
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota is used up


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
    """Yield (line number, JSON object) for each line of ``path``; a line that is not a JSON object,
    or holds text that is not valid Unicode, yields a BadLine instead. Blank lines are not records
    and are passed over."""
    path = Path(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if number == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise DataError(f"{path}: UTF-16 text (its first bytes say so); JSONL is UTF-8: save the file as "
                                "UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
            try:
                # A byte-order mark (as Windows editors save UTF-8) opens the file, not the first record.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                yield number, BadLine(str(path), number, f"not UTF-8 text (byte {error.start + 1})", number)
                continue
            if not line.strip():
                continue
            try:
                # Without its newline: a line cut short is then "expecting ..." at its end, not column 1 of the next.
                value = json.loads(line.rstrip("\r\n"), parse_constant=_refuse_constant)
            except json.JSONDecodeError as error:
                yield number, BadLine(str(path), number, f"not valid JSON ({error.msg} at column {error.colno})",
                                      number)
                continue
            except ValueError as error:  # NaN or Infinity: Python's json takes them, JSON and its readers do not
                yield number, BadLine(str(path), number, f"not valid JSON ({error})", number)
                continue
            if not isinstance(value, dict):
                yield number, BadLine(str(path), number, f"a JSON {type(value).__name__}, not an object", number)
                continue
            # JSON may escape half of a UTF-16 pair ("\ud800"): valid JSON, but not text that a
            # tokenizer reads or UTF-8 can write, so it would fail its whole batch, on every rerun.
            where = unencodable_path(value) if "\\u" in line else None
            if where is not None:
                yield number, BadLine(str(path), number, f"{where} holds an unpaired surrogate escape (\\ud800 to "
                                      "\\udfff), which is not valid Unicode text", number)
                continue
            yield number, value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value; write null or a string")


def unencodable_path(value: Any, path: str = "") -> str | None:
    """Where in a JSON value a string (or key) cannot be encoded as UTF-8, e.g. "field 'meta.tags[1]'";
    None when every string can. Lone surrogates are the only str that UTF-8 refuses."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"field '{path}'" if path else "the value"
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key.encode("utf-8", "backslashreplace").decode("utf-8")  # printable even when bad itself
            child = f"{path}.{name}" if path else name
            if unencodable_path(key) is not None:
                return f"the key '{child}'"
            found = unencodable_path(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unencodable_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


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


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


def check_policy(key: str, policy: str) -> None:
    if policy not in BAD_LINE_POLICIES:
        raise ValueError(f"{key} is {policy!r}; expected one of {', '.join(BAD_LINE_POLICIES)}")


def existing_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a file. Check prompts_path: it names one JSONL file.")
    if not path.is_file():
        raise DataError(f"{path}: no such file. Check prompts_path (relative paths are read from the repository "
                        "root or the current directory).")
    return path


# ----------------------------------------------------------------------------------------------
# Crash-safe appends and the resume scan.


def repair_torn_tail(path: str | Path) -> int:
    """Cut a last line that has no newline (left by a killed write); returns the bytes removed. A last
    line that is a whole JSON object gets its newline instead (0 removed)."""
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
        handle.seek(keep)
        if _whole_object(handle.read(size - keep)):
            handle.write(b"\n")
            keep = size
        else:
            handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return size - keep


def _whole_object(raw: bytes) -> bool:
    """A line without its newline that is a record all the same: never the prefix of one of ours
    (a JSON object's prefix is not a JSON object), so a hand edit's or another writer's."""
    try:
        return isinstance(json.loads(raw.decode("utf-8")), dict)
    except ValueError:
        return False


class LineAppender:
    """Appends JSON records to one file as whole lines; each ``write`` ends with flush and fsync.

    Opening cuts a torn last line first. The file is opened O_APPEND and each call writes all its
    lines with one buffer, so a kill leaves at most one torn line at the end, which the next
    appender (or any reader) drops. fsync because flush only reaches the OS: after a power loss or
    a VM preemption, unsynced lines would vanish although the run had counted them as done.

    ``fsync_every=(lines, seconds)`` syncs instead once that many lines or seconds have passed since
    the last sync (and on close): for a writer of one line per call, such as the continuous backend,
    whose records finish one by one. A kill still loses nothing written (the OS holds it); a power
    loss loses at most those lines.
    """

    def __init__(self, path: str | Path, fsync_every: tuple[int, float] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired_bytes = repair_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fsync_every = fsync_every
        self._unsynced_lines, self._synced_at = 0, time.monotonic()

    def write(self, records: Iterable[dict]) -> int:
        """Append ``records`` (one JSON line each) and make them durable; returns the count. A record
        that cannot be encoded raises ValueError, and nothing of the call is written."""
        lines, rejected = encode_lines(records)
        if rejected:
            position, reason = rejected[0]
            raise ValueError(f"{self.path}: record {position + 1} of the batch cannot be written: {reason}")
        return self._append(lines)

    def write_encodable(self, records: Iterable[dict]) -> list[tuple[int, str]]:
        """Append the records that can be encoded, as ``write``; returns (position, reason) of each
        one that cannot, so that it fails alone instead of taking its whole batch with it."""
        lines, rejected = encode_lines(records)
        self._append(lines)
        return rejected

    def _append(self, lines: list[str]) -> int:
        if not lines:
            return 0
        view = memoryview("".join(lines).encode("utf-8"))
        start = os.fstat(self._fd).st_size
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            self._unsynced_lines += len(lines)
            self._sync_when_due()
        except OSError as error:
            # A full disk can take part of the buffer: cut it back, so the file ends on a whole line
            # (freeing space needs none), and name the file, which os.write's error does not.
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # the torn remainder is cut by the next appender instead
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        return len(lines)

    def _sync_when_due(self) -> None:
        if self.fsync_every is not None:
            lines, seconds = self.fsync_every
            if self._unsynced_lines < lines and time.monotonic() - self._synced_at < seconds:
                return
        os.fsync(self._fd)
        self._unsynced_lines, self._synced_at = 0, time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            try:
                if self._unsynced_lines:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "LineAppender":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def encode_lines(records: Iterable[dict]) -> tuple[list[str], list[tuple[int, str]]]:
    """The JSON line of each record that can be encoded as UTF-8, and (position, reason) of those
    that cannot (text that is not valid Unicode, a value JSON has no form for)."""
    lines, rejected = [], []
    for position, record in enumerate(records):
        try:
            line = json.dumps(record, ensure_ascii=False) + "\n"
            line.encode("utf-8")
        except UnicodeEncodeError:
            where = unencodable_path(record) or "a string"
            rejected.append((position, f"{where} holds an unpaired surrogate (not valid Unicode), which UTF-8 "
                                       "cannot encode"))
            continue
        except (TypeError, ValueError) as error:
            rejected.append((position, f"not JSON: {type(error).__name__}: {error}"))
            continue
        lines.append(line)
    return lines, rejected


def read_complete_lines(path: str | Path) -> Iterator[tuple[int, str, dict]]:
    """(line number, line text, record) for each complete line of a file this module wrote.

    A torn last line is ignored. A complete line that is not a JSON object means the file was
    edited or damaged: DataError names the line, since guessing could lose or duplicate an example.
    """
    path = Path(path)
    if not path.exists():
        return
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.endswith(b"\n") and not _whole_object(raw):
                return  # torn by a killed write; the example is generated again
            try:
                line = raw.decode("utf-8").rstrip("\n") + "\n"  # a whole last record may lack its newline
                record = json.loads(line)
            except ValueError as error:  # not UTF-8, or not JSON
                line, record = "", error
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
    fsynced, renamed), so a kill or a full disk during the merge leaves the old files intact (and
    no temporary file); a target that is already the result is left as it is, so a rerun needs no
    space for a second copy. A target left empty is removed. Lines are copied byte for byte.
    Returns the number of records written.
    """
    target = Path(target)
    parts = [Path(part) for part in parts if Path(part) != target]
    _temporary(target).unlink(missing_ok=True)  # left by a merge that was killed
    target_lines: list[str] = []
    chosen: dict[Any, tuple[int, str]] = {}
    sequence = 0
    for path in [target, *parts]:
        for _, line, record in read_complete_lines(path):
            if path == target:
                target_lines.append(line)
            record_id = id_of(record)
            if exclude and record_id in exclude:
                continue
            if keep == "first" and record_id in chosen:
                continue
            sequence += 1
            chosen[record_id] = (sequence, line)
    unknown = max(order.values(), default=-1) + 1  # after every ordered id, whatever numbers the order uses
    lines = [line for record_id, (sequence, line) in
             sorted(chosen.items(), key=lambda item: (order.get(item[0], unknown), item[1][0]))]
    if lines and lines == target_lines:
        repair_torn_tail(target)  # the only change left; cutting needs no space
    elif lines:
        _replace_atomically(target, "".join(lines))
    elif target.exists():
        target.unlink()
    for part in parts:
        part.unlink(missing_ok=True)
    return len(lines)


def write_whole(path: str | Path, records: Iterable[dict]) -> None:
    """Replace ``path`` with ``records`` as JSON lines, atomically: a reader sees the old file or the new."""
    _replace_atomically(Path(path), "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text``: a reader, or a kill mid-write, sees the old file or the new."""
    _replace_atomically(Path(path), text)


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".merging")


def _replace_atomically(path: Path, text: str) -> None:
    temporary = _temporary(path)
    try:
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk must not keep a half copy taking its space
        raise
    # The rename itself is durable only once the directory entry is synced.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
