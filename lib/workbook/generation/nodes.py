"""Generation over several processes and nodes: which candidates each process owns, what is already
written anywhere, and bringing to the first process the parts it cannot see.

Each process writes its part in the output's folder as its own node sees it. On one machine, or
nodes sharing a filesystem, the first process reads every part from there. Nodes each with their own
disk (``torchrun --nnodes 2`` on rented machines) keep their parts locally; at the end they send
their records over the process group to the first process, which stores them as its own copies of
those parts (fsynced) before the senders delete theirs, then merges as usual. A kill at any moment
leaves every record in some part, on some node, that the next run reads.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, Callable, Sequence

import torch

from workbook import jsonl, runtime
from workbook.generation.engine import GenerationError
from workbook.generation.files import OutputFiles

RECORDS_PER_MESSAGE = 2048  # records a process sends per collective: bounds the first process's memory

_Place = namedtuple("_Place", "index count")  # what OutputFiles needs to name one process's part


def shard(candidates: Sequence, index: int, count: int) -> list:
    """The candidates process ``index`` of ``count`` owns: every count-th of a list every process
    builds alike from the input. It depends on nothing but the input and (index, count), so a rerun on
    the same layout finds each shard's records where it left them. A tensor-parallel layout passes
    (data-parallel group index, group count): one shard per group of ranks."""
    return list(candidates[index::count])


def in_step(rank, work: Callable[[], Any]) -> Any:
    """``work()`` in every process; when it stops one with an error for the user (a prompts file
    missing on one node, a model that does not load), every process stops with that error, naming
    the process, instead of the others waiting in the next collective until the connection breaks."""
    result, error = None, None
    try:
        result = work()
    except (GenerationError, jsonl.DataError) as problem:
        error = problem
    if rank.count > 1:
        failures = [(index, text) for index, text in enumerate(rank.gather(None if error is None else str(error)))
                    if text is not None]
        if failures and error is None:
            index, text = failures[0]
            raise GenerationError(f"process {index} of {rank.count} stopped: {text} Fix that on its node, then "
                                  "rerun the same command on every node.")
    if error is not None:
        raise error
    return result


def output_folder_shared(files: OutputFiles, rank) -> list[bool]:
    """Per process: whether it sees the first process's output folder (a collective; all True alone)."""
    if rank.count == 1:
        return [True]
    return runtime.folder_shared_with_first(files.output.parent, rank.index, rank.gather)


def written_anywhere(done: set, rank) -> set:
    """(id, sample) written in any process's view of the output: a node that cannot see the merged
    output (or another node's parts) still skips what is done."""
    return done if rank.count == 1 else set().union(*rank.gather(done))


def bring_parts_to_first(files: OutputFiles, rank, shared: list[bool]) -> list[int]:
    """Send the parts of every process that does not share the first one's folder to the first
    process, which appends them to its own copies of those parts; each sender deletes its parts once
    the first has them on disk. Returns the ranks whose parts came over the network. A collective."""
    remote = [index for index, seen in enumerate(shared) if not seen]
    if not remote:
        return []
    place = _Place(rank.index, rank.count)
    messages = []
    if rank.index in remote:
        for kind, path in (("output", files.output_part(place)), ("failures", files.failures_part(place))):
            found = [record for _, _, record in jsonl.read_complete_lines(path)]
            messages += [(kind, found[start:start + RECORDS_PER_MESSAGE])
                         for start in range(0, len(found), RECORDS_PER_MESSAGE)]
    rounds = max(rank.gather(len(messages)))
    stored, error = True, None
    appenders: dict[tuple[str, int], jsonl.LineAppender] = {}
    try:
        for round_index in range(rounds):
            received = _gather_to_first(messages[round_index] if round_index < len(messages) else None, rank)
            for sender, message in enumerate(received or []):
                if message is None or error is not None:
                    continue
                kind, records = message
                try:
                    _appender(appenders, files, kind, sender, rank.count).write(records)
                except (OSError, ValueError) as problem:  # keep taking part in the collectives, then fail
                    stored, error = False, problem
    finally:
        for appender in appenders.values():
            appender.close()
    if all(rank.gather(stored)) and rank.index in remote:
        files.output_part(place).unlink(missing_ok=True)
        files.failures_part(place).unlink(missing_ok=True)
    if error is not None:
        raise error
    return remote


def _appender(appenders: dict, files: OutputFiles, kind: str, sender: int, count: int) -> jsonl.LineAppender:
    key = (kind, sender)
    if key not in appenders:
        place = _Place(sender, count)
        appenders[key] = jsonl.LineAppender(files.output_part(place) if kind == "output"
                                            else files.failures_part(place))
    return appenders[key]


def _gather_to_first(message: Any, rank) -> list | None:
    """Every process's ``message`` in the first process (None elsewhere): not all_gather, so the
    records are not copied to every process."""
    received = [None] * rank.count if rank.index == 0 else None
    torch.distributed.gather_object(message, received, dst=0)
    return received
