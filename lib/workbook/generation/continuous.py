"""The ``continuous`` backend: one transformers continuous-batching manager streams the whole job.

All pending requests are queued once, longest first; ``batch_size`` of them are in flight, and a
finished request's slot is refilled at once from the queue (transformers' paged attention, so no
row waits for the longest output of its batch). Each finished request is handed to ``write`` as it
finishes, so the job appends its line at once: a kill loses only what was in flight. The job's
appenders fsync every FSYNC_EVERY_LINES lines or FSYNC_EVERY_SECONDS seconds (``fsync_every``).

The paged KV cache is sized by the planner (``planner.paged.paged_layout``: blocks for the
in-flight requests at the longest prompt + new tokens of the data), never by transformers' guess
from free memory. A failure in flight stops transformers' generation loop and fails every request
in it: those requests are queued again, first, under half the in-flight limit (an out-of-memory
keeps the lower limit for the rest of the run, another error only until they are done), and one
that fails alone is recorded as failed, as the static path's split-and-retry does.

It runs one whole copy of the model per process: tensor parallelism is refused before a model loads
(``planner.profile.CONTINUOUS_NOT_SHARDED`` says why).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import inspect
import time
from typing import Any, Callable

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from workbook.generation.engine import (
    MAX_CONSECUTIVE_ERRORS, BackendOutput, BatchStats, DecodingSettings, GenerationError, Outcome, PartialFailure,
    Prompt, _error_text, finish, sort_longest_first,
)
from workbook.generation.progress import remaining_seconds
from workbook.planner.paged import (
    PagedLayout, continuous_batching_config, default_page_size, paged_kernel, paged_layout,
)

FSYNC_EVERY_LINES = 64  # the job's appenders fsync this often (lines) ...
FSYNC_EVERY_SECONDS = 2.0  # ... or this often (seconds), whichever comes first
RESULT_WAIT_SECONDS = 0.05  # the main thread wakes this often to see whether the manager is still alive
STOP_WAIT_SECONDS = 60  # the longest a stop waits for transformers' generation thread to end


class ContinuousBackend:
    """transformers' continuous batching with ``batch_size`` requests in flight, for a whole job."""

    name = "continuous"
    fsync_every = (FSYNC_EVERY_LINES, FSYNC_EVERY_SECONDS)

    def __init__(self, model, settings: DecodingSettings, batch_size: int):
        if not callable(getattr(model, "init_continuous_batching", None)):
            import transformers
            raise GenerationError(
                f"backend 'continuous' needs transformers' continuous batching (model.init_continuous_batching), "
                f"which transformers {transformers.__version__} does not offer for {type(model).__name__}. "
                "Use backend: static or static-compiled, or a transformers release with continuous batching.")
        self.model, self.settings, self.batch_size = model, settings, batch_size
        self.prompts_per_call = batch_size
        self.layout: PagedLayout | None = None  # the paged cache of the last manager started
        # The attention the last manager ran: transformers switches sdpa to flash where it is installed; sdpa
        # takes one dense mask over every request in flight (a step of n decoding requests costs n^2).
        self.attention: str | None = None
        # Seconds each manager took to start (paged cache allocated, CUDA graphs captured): paid once per
        # job, so a benchmark of a few hundred prompts states it beside the pass it is part of.
        self.start_seconds: list[float] = []

    # ------------------------------------------------------------------------------------------
    # The whole job as one stream.

    def stream(self, prompts: list[Prompt], *, write: Callable[[Outcome], None], sort_by_length: bool = True,
               progress=None, log: Callable[[str], None] = print, log_every_batches: int = 0,
               rank: int = 0, planned_batch_seconds: list[float] | None = None) -> list[BatchStats]:
        """Generate every prompt; ``write`` receives each finished request's Outcome at once (it may
        move the completion to ``failed``, as in ``engine.run_batches``). One BatchStats per
        ``batch_size`` finished requests (``token_slots`` None: no padded positions). The ETA is
        ``progress.remaining_seconds`` over ``planned_batch_seconds`` (the planned seconds of
        each ``batch_size`` prompts in queue order, as ``engine.run_batches`` plans them)."""
        queue = collections.deque(sort_longest_first(prompts) if sort_by_length else prompts)
        prompt_tokens = max((len(p.token_ids) for p in prompts), default=1)
        new_tokens = max((p.max_new_tokens for p in prompts), default=1)
        tally = _Tally(len(prompts), self.batch_size, rank, progress, log, log_every_batches,
                       planned_batch_seconds or [])
        limit, restore_after, restore = self.batch_size, set(), False
        ceiling = self.batch_size  # the in-flight limit to go back to; an out-of-memory lowers it for good
        consecutive_errors = 0
        manager, in_flight = None, {}

        def deliver(outcome: Outcome) -> None:
            write(outcome)
            tally.add(outcome)

        try:
            while queue or in_flight:
                if restore and not restore_after and not in_flight:
                    # The requests retried after an error are done: the rest runs at the full limit again.
                    if manager is not None:
                        stop_manager(manager)
                    manager, limit, restore = None, ceiling, False
                if manager is None:
                    manager = self._start(limit, prompt_tokens, new_tokens)
                while queue and len(in_flight) < limit and not (restore and not restore_after):
                    prompt = queue.popleft()
                    in_flight[self._add(manager, prompt)] = prompt
                result = manager.get_result(timeout=RESULT_WAIT_SECONDS)
                if result is None and manager.is_running():
                    continue
                if result is not None and result.error is None:
                    prompt = in_flight.pop(result.request_id, None)
                    if prompt is None or not result.is_finished():
                        continue
                    deliver(self._completed(prompt, list(result.generated_tokens)))
                    consecutive_errors = 0
                    restore_after.discard(_key(prompt))
                    continue
                # A failure (or a manager that stopped): transformers fails everything in flight.
                error_text = (result.error if result is not None else None) or _stopped_text(manager)
                failed = list(in_flight.values())
                finished = stop_manager(manager, drain=in_flight)
                manager, in_flight = None, {}
                for prompt, tokens in finished:  # completed before the loop stopped
                    deliver(self._completed(prompt, tokens))
                    failed.remove(prompt)
                error = _error_from_text(error_text)
                out_of_memory = should_reduce_batch_size(error)
                clear_device_cache(garbage_collection=True)
                if limit > 1 and failed:
                    limit = max(1, min(limit, len(failed)) // 2)
                    tally.splits += 1
                    restore = not out_of_memory
                    ceiling = limit if out_of_memory else ceiling
                    restore_after = {_key(p) for p in failed}
                    log(f"{'out of memory' if out_of_memory else 'error'} with {len(failed)} requests in flight "
                        f"({error_text[:120]}); retrying them first with at most {limit} in flight"
                        + (" for the rest of this run" if out_of_memory else ""))
                    queue.extendleft(reversed(sort_longest_first(failed)))
                    continue
                for prompt in failed:
                    deliver(Outcome(failed=[(prompt, _error_text(error))]))
                    restore_after.discard(_key(prompt))
                    consecutive_errors = 0 if out_of_memory else consecutive_errors + 1
                if consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                    raise GenerationError(
                        f"{consecutive_errors} examples in a row failed alone with: {_error_text(error)}. That is not "
                        "one bad example but a broken setup; fix it and rerun (everything written so far is kept "
                        "and skipped).")
        finally:
            if manager is not None:  # also gives the model back its own attention implementation
                stop_manager(manager, hard=bool(in_flight))  # an exception left requests in flight: Ctrl-C
        return tally.finish()

    def generate(self, prompts: list[Prompt]) -> BackendOutput:
        """One call over ``prompts`` (the benchmark's warm-up, ``generate_with_split``)."""
        completed, failures = {}, []
        position = {id(prompt): i for i, prompt in enumerate(prompts)}

        def collect(outcome: Outcome) -> None:
            completed.update({position[id(prompt)]: completion for prompt, completion in outcome.completed})
            failures.extend(error for _, error in outcome.failed)

        self.stream(prompts, write=collect, log=lambda line: None)
        if failures:
            raise PartialFailure(completed, _error_from_text(failures[0]))
        return BackendOutput([completed[i] for i in range(len(prompts))], token_slots=None)

    def _completed(self, prompt: Prompt, tokens: list[int]) -> Outcome:
        return Outcome(completed=[(prompt, finish(tokens, prompt.max_new_tokens, self.settings.eos_token_ids))])

    # ------------------------------------------------------------------------------------------
    # The transformers manager.

    def _start(self, limit: int, prompt_tokens: int, new_tokens: int):
        """A started manager with ``limit`` requests in flight and the planner's paged cache."""
        began = time.perf_counter()
        manager = self.model.init_continuous_batching(**self.manager_arguments(limit, prompt_tokens, new_tokens))
        self.attention = paged_kernel(getattr(self.model.config, "_attn_implementation", None))
        if callable(getattr(manager, "warmup", None)) and not getattr(manager, "warmed_up", True):
            manager.warmup()  # as generate_batch does: CUDA graphs captured before the first request
        manager.start()
        self.start_seconds.append(time.perf_counter() - began)
        return manager

    def manager_arguments(self, limit: int, prompt_tokens: int, new_tokens: int, *, hints: bool = True) -> dict:
        """Keyword arguments of ``init_continuous_batching`` (``generate_batch`` too, ``hints=False``)
        for ``limit`` requests in flight of up to ``prompt_tokens`` + ``new_tokens``."""
        from transformers import GenerationConfig
        page_size = default_page_size()
        self.layout = paged_layout(limit, prompt_tokens, new_tokens, page_size)
        options = {"max_requests_per_batch": limit, "num_blocks": self.layout.num_blocks,
                   "max_batch_tokens": self.layout.max_batch_tokens, "seed": self.settings.seed,
                   # The cache holds every in-flight request at full length, so transformers need not
                   # keep blocks free for decoding (its default holds back 15% from new requests).
                   "safety_margin": 0.0, "page_size": page_size}
        generation_config: GenerationConfig = self.settings.generation_config(new_tokens)
        accepted = inspect.signature(self.model.init_continuous_batching).parameters
        kwargs: dict[str, Any] = {}
        config = continuous_batching_config(options) if "continuous_batching_config" in accepted else None
        if config is not None:
            kwargs["continuous_batching_config"] = config
        else:  # releases before ContinuousBatchingConfig read these from the generation config
            for key, value in options.items():
                setattr(generation_config, key, value)
        if hints and "workload_hints" in accepted:  # sizes the decode fast path's block table (flash attention)
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=prompt_tokens, max_generated_length=new_tokens,
                                                     num_requests=limit)
        return {"generation_config": generation_config, **kwargs}

    def _add(self, manager, prompt: Prompt) -> str:
        request_id = f"{prompt.index}:{prompt.sample}"
        manager.add_request(prompt.token_ids, request_id=request_id, max_new_tokens=prompt.max_new_tokens)
        return request_id


def stop_manager(manager, drain: dict[str, Prompt] | None = None, *, hard: bool = False
                 ) -> list[tuple[Prompt, list[int]]]:
    """Stop a transformers manager; with ``drain``, the (prompt, tokens) of the requests of ``drain``
    that finished without an error before it stopped. ``hard``: now, failing what is in flight, as
    after Ctrl-C or a time budget's end; otherwise transformers flushes first, generating every
    request it holds to its end (minutes of an 8B model's long outputs), and its ``destroy`` would
    wait for that with no time limit."""
    hard_stop = {"hard_stop": True} if hard and "hard_stop" in inspect.signature(manager.stop).parameters else {}
    manager.stop(block=True, timeout=STOP_WAIT_SECONDS, **hard_stop)  # it also restores the attention implementation
    finished = []
    while drain is not None:
        result = manager.get_result(timeout=0)
        if result is None:
            break
        prompt = drain.get(result.request_id)
        if prompt is not None and result.error is None and result.is_finished():
            finished.append((prompt, list(result.generated_tokens)))
    if callable(getattr(manager, "destroy", None)) and not manager.is_running():
        manager.destroy()
    return finished


def _key(prompt: Prompt) -> tuple[int, int]:
    return prompt.index, prompt.sample


def _stopped_text(manager) -> str:
    status = getattr(manager, "background_thread_status", None)
    fatal = getattr(status, "fatal_error", None)
    return f"{type(fatal).__name__}: {fatal}" if fatal is not None else \
        "transformers' continuous batching loop stopped before these requests finished"


def _error_from_text(text: str) -> BaseException:
    """An exception for an error the continuous batching thread reported as text; out-of-memory text
    becomes torch.OutOfMemoryError so that it is treated as accelerate would."""
    probe = RuntimeError(text)
    return torch.OutOfMemoryError(text) if should_reduce_batch_size(probe) else probe


@dataclasses.dataclass
class _Tally:
    """Statistics, progress bar and log lines of a stream: one BatchStats per ``group`` requests."""

    total: int
    group: int
    rank: int
    progress: Any
    log: Callable[[str], None]
    log_every_batches: int
    planned_batch_seconds: list[float]
    splits: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    stats: list = dataclasses.field(default_factory=list)
    current: list = dataclasses.field(default_factory=list)
    first_result_seconds: float | None = None
    done: int = 0
    failed: int = 0
    output_tokens: int = 0
    remaining_seconds: float | None = None  # the ETA when the last group closed ...
    _closed_at: float = 0.0  # ... at this many seconds into the stream

    def add(self, outcome: Outcome) -> None:
        now = time.perf_counter() - self.started
        if self.first_result_seconds is None and outcome.completed:
            self.first_result_seconds = now
        self.current.append(outcome)
        self.done += len(outcome.completed)
        self.failed += len(outcome.failed)
        self.output_tokens += sum(len(c.token_ids) for _, c in outcome.completed)
        if self.progress is not None:
            self.progress.update(len(outcome.completed) + len(outcome.failed))
            self.progress.set_postfix_str(f"done {self.done}, failed {self.failed}, "
                                          f"{self.output_tokens / max(now, 1e-9):.0f} tok/s{self._eta_text(now)}",
                                          refresh=False)
        if len(self.current) >= self.group:
            self._close_group(now)

    def _close_group(self, now: float) -> None:
        completed = [pair for outcome in self.current for pair in outcome.completed]
        lengths = [len(completion.token_ids) for _, completion in completed]
        previous = self.stats[-1].finished_at_seconds if self.stats else 0.0
        plan = self.planned_batch_seconds
        self.stats.append(BatchStats(
            index=len(self.stats) + 1, examples=sum(len(o.completed) + len(o.failed) for o in self.current),
            failed=sum(len(o.failed) for o in self.current), seconds=now - previous, finished_at_seconds=now,
            prompt_tokens=sum(len(prompt.token_ids) for prompt, _ in completed), output_tokens=sum(lengths),
            longest_output_tokens=max(lengths, default=0), token_slots=None, splits=self.splits, rank=self.rank,
            first_result_seconds=self.first_result_seconds if not self.stats else None,
            planned=plan[len(self.stats)] if len(self.stats) < len(plan) else None))
        self.current, self.splits = [], 0
        index = len(self.stats)
        self._closed_at = now
        if self.planned_batch_seconds:
            finished_at = [stats.finished_at_seconds for stats in self.stats]
            self.remaining_seconds = remaining_seconds(self.planned_batch_seconds, finished_at)
        if self.log_every_batches and index % self.log_every_batches == 0:
            finished = self.done + self.failed
            self.log(f"{'[rank %d] ' % self.rank if self.rank else ''}{finished}/{self.total} "
                     f"({100 * finished / max(self.total, 1):.1f}%) - generated {self.done}, failed {self.failed}, "
                     f"{self.output_tokens / max(now, 1e-9):.0f} output tokens/s{self._eta_text(now)}")

    def _eta_text(self, now: float) -> str:
        """The ETA of the last closed group, counted down since (none before the first group closes)."""
        if self.remaining_seconds is None:
            return ""
        left = max(0.0, self.remaining_seconds - (now - self._closed_at))
        return f", ETA {datetime.timedelta(seconds=round(left))}"

    def finish(self) -> list[BatchStats]:
        if self.current:
            self._close_group(time.perf_counter() - self.started)
        return self.stats
