"""The generation engine: token ids in, token ids out, in batches, with nothing lost.

Prompts are sorted longest first; each batch goes to a backend (``backends``); a failing call is
split in halves and retried down to one prompt, whose failure is recorded; ``write`` receives each
batch's outcome before the next batch starts; ``summarize`` turns the batches into throughput and
padding waste. The engine never sees text or files: that is the job's (``job``).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Callable

from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from workbook import process_group
from workbook.generation.progress import positions_cost, remaining_seconds

FINISH_EOS, FINISH_LENGTH = "eos", "length"
# Single examples failing in a row with errors other than out-of-memory: a broken setup, stop.
MAX_CONSECUTIVE_ERRORS = 3
ERROR_TEXT_LIMIT = 500  # characters of an error kept in a failure record


class GenerationError(RuntimeError):
    """The job cannot run as configured; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# What the engine works on: token ids in, token ids out.


@dataclass(frozen=True)
class DecodingSettings:
    """How every sequence is decoded. Token ids, not text: the engine never sees a tokenizer."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]  # every id that ends a sequence
    pad_token_id: int
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    min_new_tokens: int = 0  # the benchmark forces full-length outputs with it; the job leaves it 0

    def generation_config(self, max_new_tokens: int, **extra):
        """A complete GenerationConfig. Decoding settings the model ships (top_k=50, a repetition
        penalty) would otherwise be merged in by ``generate``; they are switched off so that the
        params are the whole truth and batched greedy decoding equals one-at-a-time decoding."""
        from transformers import GenerationConfig
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_new_tokens or None,
            do_sample=self.do_sample,
            temperature=self.temperature if self.do_sample else 1.0,
            top_p=self.top_p if self.do_sample else 1.0,
            top_k=0 if self.do_sample else None,  # 0: no top-k cut (only top_p), as the params say
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            **extra,
        )

    def recorded(self) -> dict:
        """``metadata.generation_params`` of every output record; temperature, top_p and seed are
        None under greedy decoding, which does not use them."""
        sampling = self.do_sample
        return {"temperature": self.temperature if sampling else None, "top_p": self.top_p if sampling else None,
                "max_new_tokens": self.max_new_tokens, "do_sample": sampling, "seed": self.seed if sampling else None}


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the input (ties in the length sort keep input order)
    token_ids: list[int]
    max_new_tokens: int  # min(max_new_tokens, room left in the model's context)
    sample: int = 0  # which of the prompt's samples_per_prompt candidates this is


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated tokens, the end-of-sequence token included, no padding
    finish_reason: str  # "eos" or "length"


@dataclass(frozen=True)
class BackendOutput:
    completions: list[Completion]  # one per prompt, in order
    token_slots: int | None  # rows x sequence positions computed (padding included); None: no padding


class PartialFailure(RuntimeError):
    """Some prompts of a call completed and the others failed with ``error``."""

    def __init__(self, completed: dict[int, Completion], error: BaseException):
        super().__init__(str(error))
        self.completed = completed  # position in the call's prompt list -> completion
        self.error = error


def finish(generated: list[int], limit: int, eos_token_ids: tuple[int, ...]) -> Completion:
    """A row's completion: its tokens up to and including the first end of sequence, at most ``limit``."""
    for position, token in enumerate(generated[:limit]):
        if token in eos_token_ids:
            return Completion(generated[: position + 1], FINISH_EOS)
    return Completion(generated[:limit], FINISH_LENGTH)


# ----------------------------------------------------------------------------------------------
# The engine: sorted batches, split on failure, write each batch, count.


@dataclass
class BatchStats:
    """One written batch (a call's prompts, however often it was split)."""

    index: int  # 1-based
    examples: int  # prompts in the batch
    failed: int  # of them, failed alone and written to the failures file
    seconds: float  # wall time, generation + writing
    finished_at_seconds: float  # since the engine started
    prompt_tokens: int  # of the completed examples
    output_tokens: int  # of the completed examples
    longest_output_tokens: int
    token_slots: int | None  # positions computed, padding included (None: continuous, no padding)
    splits: int  # times a failing call was split in two
    rank: int = 0
    first_result_seconds: float | None = None  # since the engine started; None: this batch's end
    planned: float | None = None  # the ETA's plan for it: seconds by the forecast's model, else positions


@dataclass
class Outcome:
    completed: list[tuple[Prompt, Completion]] = field(default_factory=list)
    failed: list[tuple[Prompt, str]] = field(default_factory=list)
    token_slots: int | None = None
    splits: int = 0


def sort_longest_first(prompts: list[Prompt]) -> list[Prompt]:
    return sorted(prompts, key=lambda p: (-len(p.token_ids), p.index, p.sample))


def in_batches(ordered: list[Prompt], size: int) -> list[list[Prompt]]:
    """``ordered`` cut every ``size`` prompts: the job's batches (after ``sort_longest_first``)."""
    return [ordered[start:start + size] for start in range(0, len(ordered), size)]


def generate_with_split(backend, prompts: list[Prompt], log: Callable[[str], None] = print) -> Outcome:
    """Generate for ``prompts``; a failing call is split in halves and retried, down to one prompt,
    whose failure is recorded. Stops the run (GenerationError) when MAX_CONSECUTIVE_ERRORS single
    prompts in a row fail with an error other than out-of-memory."""
    outcome = Outcome()
    pending = [prompts]
    consecutive_errors = 0
    while pending:
        part = pending.pop()
        failure = None
        try:
            output = backend.generate(part)
        except PartialFailure as partial:
            outcome.completed += [(part[i], completion) for i, completion in partial.completed.items()]
            part = [prompt for i, prompt in enumerate(part) if i not in partial.completed]
            failure = partial.error
        except Exception as error:  # out of memory, or anything one example could cause
            if process_group.is_exchange_failure(error):
                raise  # a tensor-parallel peer is gone or silent: no example's fault, and no retry reaches it
            failure = error
        else:
            outcome.completed += list(zip(part, output.completions))
            if output.token_slots is not None:
                outcome.token_slots = (outcome.token_slots or 0) + output.token_slots
            consecutive_errors = 0
            continue
        out_of_memory = should_reduce_batch_size(failure)
        text = _error_text(failure)
        del failure  # it holds the frames, and through them the batch's tensors
        clear_device_cache(garbage_collection=True)
        if len(part) > 1:
            half = len(part) // 2
            outcome.splits += 1
            log(f"{'out of memory' if out_of_memory else 'error'} at {len(part)} prompts ({text[:120]}); "
                f"retrying as {half} + {len(part) - half}")
            pending += [part[half:], part[:half]]  # the first half runs next
            continue
        outcome.failed.append((part[0], text))
        consecutive_errors = 0 if out_of_memory else consecutive_errors + 1
        if consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
            raise GenerationError(
                f"{consecutive_errors} examples in a row failed alone with: {text}. That is not one bad example "
                "but a broken setup; fix it and rerun (everything written so far is kept and skipped).")
    return outcome


def _error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 3] + "..."


def run_batches(backend, prompts: list[Prompt], *, write: Callable[[Outcome], None], sort_by_length: bool = True,
                progress=None, log: Callable[[str], None] = print, log_every_batches: int = 0,
                rank: int = 0, planned_seconds: Callable[[list[list[Prompt]]], list[float]] | None = None
                ) -> list[BatchStats]:
    """Generate for every prompt in batches of ``backend.prompts_per_call``; ``write`` receives each
    batch's outcome before the next batch starts, and may move a completed prompt to ``failed``
    (its record could not be written): the batch's statistics count it there. Returns one
    BatchStats per batch.

    ``progress`` is a tqdm bar (or None); a log line every ``log_every_batches`` batches (0: none).
    ``sort_by_length=False`` keeps input order (the benchmark's comparison). The ETA is the
    progress's (``progress.remaining_seconds``) over ``planned_seconds(batches)``, each
    batch's planned seconds (default: ``progress.positions_cost``), not examples left times
    seconds per example: the first batches hold the longest prompts. A streaming backend
    (``continuous``: one manager for every prompt) runs the whole list itself, writing each prompt as
    it finishes; its ETA counts each ``prompts_per_call`` finished prompts as one batch.
    """
    ordered = sort_longest_first(prompts) if sort_by_length else list(prompts)
    size = backend.prompts_per_call
    batches = in_batches(ordered, size)
    planned = (planned_seconds or positions_cost)(batches)
    if callable(getattr(backend, "stream", None)):
        return backend.stream(ordered, write=write, sort_by_length=False, progress=progress, log=log,
                              log_every_batches=log_every_batches, rank=rank, planned_batch_seconds=planned)
    stats: list[BatchStats] = []
    started = time.perf_counter()
    done = failed = output_tokens = 0
    for index, batch in enumerate(batches, start=1):
        batch_started = time.perf_counter()
        outcome = generate_with_split(backend, batch, log=log)
        write(outcome)
        now = time.perf_counter()
        lengths = [len(completion.token_ids) for _, completion in outcome.completed]
        stats.append(BatchStats(
            index=index, examples=len(batch), failed=len(outcome.failed), seconds=now - batch_started,
            finished_at_seconds=now - started,
            prompt_tokens=sum(len(prompt.token_ids) for prompt, _ in outcome.completed),
            output_tokens=sum(lengths), longest_output_tokens=max(lengths, default=0),
            token_slots=outcome.token_slots, splits=outcome.splits, rank=rank, planned=planned[index - 1]))
        done += len(outcome.completed)
        failed += len(outcome.failed)
        output_tokens += sum(lengths)
        elapsed = now - started
        remaining = remaining_seconds(planned, [batch.finished_at_seconds for batch in stats])
        if progress is not None:
            progress.update(len(batch))
            progress.set_postfix_str(f"done {done}, failed {failed}, batch {index}/{len(batches)}, "
                                     f"{output_tokens / elapsed:.0f} tok/s, ETA {dt.timedelta(seconds=round(remaining))}",
                                     refresh=False)
        if log_every_batches and (index % log_every_batches == 0 or index == len(batches)):
            finished = done + failed
            log(f"{'[rank %d] ' % rank if rank else ''}batch {index}/{len(batches)}: {finished}/{len(ordered)} "
                f"({100 * finished / max(len(ordered), 1):.1f}%) - generated {done}, failed {failed}, "
                f"{output_tokens / elapsed:.0f} output tokens/s, ETA {dt.timedelta(seconds=round(remaining))}")
    return stats


def summarize(batches: list[BatchStats], seconds: float) -> dict:
    """Throughput and waste of some batches that took ``seconds`` of wall time."""
    generated = sum(b.examples - b.failed for b in batches)
    output_tokens = sum(b.output_tokens for b in batches)
    slotted = [b for b in batches if b.token_slots is not None]
    useful = sum(b.prompt_tokens + b.output_tokens for b in slotted)
    slots = sum(b.token_slots for b in slotted)
    return {
        "generated": generated,
        "failed": sum(b.failed for b in batches),
        "batches": len(batches),
        "seconds": round(seconds, 3),
        "examples_per_minute": round(60 * generated / seconds, 1) if seconds else None,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(b.prompt_tokens for b in batches),
        "output_tokens_per_second": round(output_tokens / seconds, 1) if seconds else None,
        # When the first output was written (a static batch writes all of its outputs at its end).
        "first_result_seconds": min((b.finished_at_seconds if b.first_result_seconds is None else b.first_result_seconds
                                     for b in batches), default=None),
        # Share of computed positions that were padding: prompts padded to the batch's longest,
        # and rows that had finished while the batch's longest output went on.
        "padding_waste": round(1 - useful / slots, 4) if slots else None,
        "oom_or_error_splits": sum(b.splits for b in batches),
    }
