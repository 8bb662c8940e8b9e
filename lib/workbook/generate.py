"""Batched generation of teacher outputs: JSONL in, JSONL out, fast, resumable, and nothing lost.

The job behind notebook 02 and ``workbook generate``::

    summary = launch(params, run_dir=session.run_dir)          # notebook 02
    workbook generate --params h200 --set prompts_path=data.jsonl output_path=out/teacher.jsonl
    accelerate launch --multi_gpu --num_processes 8 -m workbook.generate --params h100x8 \
        --set output_path=out/teacher.jsonl

What it does, and why each way:

- Prompts are tokenized once and sorted by length, longest first: a batch then holds prompts of
  similar length (little padding), and the batch most likely to run out of memory runs first.
- Left padding, and the generated tokens are sliced at the padded prompt length. (Seed 000 sliced
  each row at its count of non-pad tokens, which under left padding keeps the prompt's tail in the
  response.) Every end-of-sequence id of the model ends a row (Llama 3 instruct has three).
- Out of memory (recognised as accelerate does): the batch is split in halves and retried, down to
  one example; an example that fails alone goes to the failures file with its error and the run
  goes on. Other errors are isolated the same way, but several single examples failing in a row
  with one stop the run: that is a broken setup, not a bad example.
- Each batch's records are appended as whole lines, flushed and fsynced before the next batch; a
  rerun with the same output skips every id already written (``workbook.data`` explains the torn
  last line a kill can leave). At the end the output is rewritten ordered by input position.
- Data parallel: N processes, each with the whole model on its own GPU, take every N-th prompt of
  the length-sorted list, write their own part, and the first merges the parts (deduplicated,
  ordered). The launcher is accelerate's ``notebook_launcher`` (or ``accelerate launch``), so
  nothing here touches CUDA before the processes exist.
- New tokens per example are ``min(max_new_tokens, model context - prompt tokens)``, as vLLM
  does; a prompt that leaves no room at all is handled by ``on_long_prompt``.

Backends (``backend`` in params): ``static`` is Hugging Face ``generate`` with a dynamic KV cache;
``static-compiled`` uses a static KV cache and ``torch.compile`` (on CUDA Hugging Face's default,
CUDA graphs included; elsewhere dynamic shapes, which exists for testing); ``continuous`` is
transformers' continuous batching (``generate_batch``: paged attention, a finished sequence's slot
is refilled at once), with ``batch_size`` requests in flight. With greedy decoding all three give
the tokens one-at-a-time generation gives (tests/test_generate.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from torch.distributed.elastic.multiprocessing.errors import record

from workbook import data, planning
from workbook.params import SCHEMA
from workbook.paths import REPO_ROOT

BACKENDS = SCHEMA["backend"].choices  # static, static-compiled, continuous
OUTPUT_FILE_NAME = "generations.jsonl"  # in the run folder when output_path is ''
FINISH_EOS, FINISH_LENGTH = "eos", "length"
# Continuous batching gets this many batches of prompts per call, so that slots freed by short
# outputs are refilled from the queue instead of idling until the longest output of the call ends.
CONTINUOUS_BATCHES_PER_CALL = 4
# Single examples failing in a row with errors other than out-of-memory: a broken setup, stop.
MAX_CONSECUTIVE_ERRORS = 3
ERROR_TEXT_LIMIT = 500  # characters of an error kept in a failure record
# The params keys this job reads; notebook 02 declares them all in its parameters cell.
PARAMS_USED = ("profile", "model", "dtype", "interactive", "batch_size", "prompt_len", "max_new_tokens",
               "gpu_count", "gpu_memory_gib", "safety_margin", "cuda_overhead_gib", "prompts_path",
               "prompt_field", "output_path", "backend", "do_sample", "temperature", "top_p", "seed",
               "max_examples", "on_bad_line", "on_long_prompt", "use_chat_template", "log_every_batches",
               "data_parallel_processes")


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


def left_pad(rows: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each row right-aligned: every prompt ends where generation starts."""
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([[pad_token_id] * (width - len(row)) + row for row in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    return input_ids, attention_mask


# ----------------------------------------------------------------------------------------------
# Backends: generate for a list of prompts, or raise.


class StaticBackend:
    """Hugging Face ``generate`` on a left-padded batch; ``compiled``: static KV cache + torch.compile."""

    def __init__(self, model, settings: DecodingSettings, batch_size: int, compiled: bool = False):
        self.model, self.settings = model, settings
        self.name = "static-compiled" if compiled else "static"
        self.prompts_per_call = batch_size
        self.extra: dict[str, Any] = {}
        if compiled:
            self.extra["cache_implementation"] = "static"
            if model.device.type != "cuda":
                # Hugging Face compiles generation only on CUDA-like devices unless told otherwise
                # (CompileConfig._compile_all_devices, used by its own CPU tests). Dynamic shapes, so
                # other prompt lengths do not compile again (a new batch size still does, measured);
                # CUDA keeps Hugging Face's default (CUDA graphs).
                from transformers import CompileConfig
                compile_config = CompileConfig(mode="default", dynamic=True)
                compile_config._compile_all_devices = True
                self.extra["compile_config"] = compile_config

    def generate(self, prompts: list[Prompt]) -> BackendOutput:
        input_ids, attention_mask = left_pad([p.token_ids for p in prompts], self.settings.pad_token_id,
                                             self.model.device)
        new_tokens = max(p.max_new_tokens for p in prompts)
        output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     generation_config=self.settings.generation_config(new_tokens, **self.extra))
        generated = output[:, input_ids.shape[1]:].tolist()  # sliced at the padded prompt length
        completions = [finish(row, p.max_new_tokens, self.settings.eos_token_ids)
                       for row, p in zip(generated, prompts)]
        return BackendOutput(completions, token_slots=output.shape[0] * output.shape[1])


class ContinuousBackend:
    """transformers' continuous batching (``generate_batch``) with ``batch_size`` requests in flight."""

    name = "continuous"

    def __init__(self, model, settings: DecodingSettings, batch_size: int):
        if not callable(getattr(model, "generate_batch", None)):
            import transformers
            raise GenerationError(
                f"backend 'continuous' needs transformers' continuous batching (model.generate_batch), which "
                f"transformers {transformers.__version__} does not offer for {type(model).__name__}. "
                "Use backend: static or static-compiled, or a transformers release with generate_batch.")
        self.model, self.settings, self.batch_size = model, settings, batch_size
        self.prompts_per_call = batch_size * CONTINUOUS_BATCHES_PER_CALL
        self.takes_config = "continuous_batching_config" in inspect.signature(model.generate_batch).parameters

    def generate(self, prompts: list[Prompt]) -> BackendOutput:
        new_tokens = max(p.max_new_tokens for p in prompts)
        generation_config = self.settings.generation_config(new_tokens)
        options = self._scheduling(len(prompts), max(len(p.token_ids) for p in prompts) + new_tokens)
        kwargs: dict[str, Any] = {}
        if self.takes_config:
            from transformers import ContinuousBatchingConfig
            names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                **{key: value for key, value in options.items() if key in names})
        else:  # releases before ContinuousBatchingConfig read these from the generation config
            for key, value in options.items():
                setattr(generation_config, key, value)
        results = self.model.generate_batch([p.token_ids for p in prompts], generation_config=generation_config,
                                            progress_bar=False, **kwargs)
        completed, error = {}, None
        for position, result in _match_results(prompts, list(results.values())).items():
            if result is None or result.error is not None:
                error = error or _error_from_text(result.error if result is not None else
                                                  "continuous batching returned no result for this request")
                continue
            completed[position] = finish(list(result.generated_tokens), prompts[position].max_new_tokens,
                                         self.settings.eos_token_ids)
        if error is not None:
            raise PartialFailure(completed, error)
        return BackendOutput([completed[position] for position in range(len(prompts))], token_slots=None)

    def _scheduling(self, requests: int, longest_sequence_tokens: int) -> dict:
        options = {"max_requests_per_batch": min(self.batch_size, requests), "seed": self.settings.seed}
        if self.model.device.type == "cpu":
            # Sized from free memory otherwise, which on CPU means 60% of RAM per process (slow to
            # allocate, and N processes would ask for N x 60%); this many blocks hold the flight.
            from transformers import ContinuousBatchingConfig
            page = getattr(ContinuousBatchingConfig, "page_size", None) or getattr(
                ContinuousBatchingConfig, "block_size", 256)
            pages_per_request = -(-longest_sequence_tokens // page)
            options["num_blocks"] = options["max_requests_per_batch"] * pages_per_request + 1
        return options


def _match_results(prompts: list[Prompt], results: list) -> dict[int, Any]:
    """Position -> result. ``generate_batch`` returns results in input order but leaves out lost
    requests, so each result is matched to the next prompt with its token ids."""
    matched: dict[int, Any] = {}
    cursor = 0
    for position, prompt in enumerate(prompts):
        if cursor < len(results) and list(results[cursor].prompt_ids) == prompt.token_ids:
            matched[position] = results[cursor]
            cursor += 1
        else:
            matched[position] = None
    return matched


def _error_from_text(text: str) -> BaseException:
    """An exception for an error the continuous batching thread reported as text; out-of-memory text
    becomes torch.OutOfMemoryError so the split-and-retry treats it as accelerate would."""
    probe = RuntimeError(text)
    return torch.OutOfMemoryError(text) if should_reduce_batch_size(probe) else probe


def make_backend(name: str, model, settings: DecodingSettings, batch_size: int):
    if name == "static":
        return StaticBackend(model, settings, batch_size)
    if name == "static-compiled":
        return StaticBackend(model, settings, batch_size, compiled=True)
    if name == "continuous":
        return ContinuousBackend(model, settings, batch_size)
    raise GenerationError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")


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


@dataclass
class Outcome:
    completed: list[tuple[Prompt, Completion]] = field(default_factory=list)
    failed: list[tuple[Prompt, str]] = field(default_factory=list)
    token_slots: int | None = None
    splits: int = 0


def sort_longest_first(prompts: list[Prompt]) -> list[Prompt]:
    return sorted(prompts, key=lambda p: (-len(p.token_ids), p.index))


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
                rank: int = 0) -> list[BatchStats]:
    """Generate for every prompt in batches of ``backend.prompts_per_call``; ``write`` receives each
    batch's outcome before the next batch starts. Returns one BatchStats per batch.

    ``progress`` is a tqdm bar (or None); a log line every ``log_every_batches`` batches (0: none).
    ``sort_by_length=False`` keeps input order (the benchmark's comparison).
    """
    ordered = sort_longest_first(prompts) if sort_by_length else list(prompts)
    size = backend.prompts_per_call
    batches = [ordered[start:start + size] for start in range(0, len(ordered), size)]
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
            token_slots=outcome.token_slots, splits=outcome.splits, rank=rank))
        done += len(outcome.completed)
        failed += len(outcome.failed)
        output_tokens += sum(lengths)
        elapsed = now - started
        if progress is not None:
            progress.update(len(batch))
            progress.set_postfix_str(f"done {done}, failed {failed}, batch {index}/{len(batches)}, "
                                     f"{output_tokens / elapsed:.0f} tok/s", refresh=False)
        if log_every_batches and (index % log_every_batches == 0 or index == len(batches)):
            finished = done + failed
            remaining = elapsed / finished * (len(ordered) - finished) if finished else 0.0
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
        # Share of computed positions that were padding: prompts padded to the batch's longest,
        # and rows that had finished while the batch's longest output went on.
        "padding_waste": round(1 - useful / slots, 4) if slots else None,
        "oom_or_error_splits": sum(b.splits for b in batches),
    }


# ----------------------------------------------------------------------------------------------
# From params to a job: model, prompts, resume, writing, merging.


@dataclass(frozen=True)
class Rank:
    """This process's place in a data-parallel job (index 0 of 1 when alone)."""

    index: int
    count: int
    device: torch.device
    state: Any = None  # accelerate's PartialState when there are several processes

    def gather(self, value) -> list:
        if self.state is None:
            return [value]
        from accelerate.utils import gather_object
        return gather_object([value])


def inside_launcher() -> bool:
    """True in a process started by accelerate launch / notebook_launcher with several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current_rank() -> Rank:
    if inside_launcher():
        from accelerate import PartialState
        state = PartialState(cpu=not torch.cuda.is_available())  # gloo on CPU, NCCL on GPUs
        return Rank(state.process_index, state.num_processes, state.device, state)
    return Rank(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


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
    def summary(self) -> Path:
        return self.output.with_name(f"{self.output.stem}.summary.json")

    def output_part(self, rank: Rank) -> Path:
        return self.output if rank.count == 1 else self._sibling(f".part-{rank.index}")

    def failures_part(self, rank: Rank) -> Path:
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


def load_model(model_name: str, dtype: str, device):
    """(model, tokenizer) from 'tiny' or a local Hugging Face directory; nothing is downloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbook import finder, tiny_model
    try:
        path = tiny_model.resolve_model_path(model_name)
    except ValueError as error:
        raise GenerationError(str(error)) from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=finder.TORCH_DTYPES[dtype]).to(device)
    return model.eval(), tokenizer


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the generation config's (often several), the model config's
    and the tokenizer's."""
    candidates = [getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None]
    ids: list[int] = []
    for candidate in candidates:
        for value in candidate if isinstance(candidate, (list, tuple)) else [candidate]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def pad_token_id(model, tokenizer, eos_ids: tuple[int, ...]) -> int:
    """The tokenizer's pad id, else the model's, else the first end-of-sequence id: padded positions
    are masked out and sliced off, so any id serves."""
    for candidate in (getattr(tokenizer, "pad_token_id", None),
                      getattr(model.generation_config, "pad_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return eos_ids[0] if eos_ids else 0


def context_length(model) -> int | None:
    """Positions the model was built for (None when its config does not say)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def tokenize_prompts(tokenizer, prompts: list[str], use_chat_template: bool) -> list[list[int]]:
    """Token ids of each prompt: as one user turn of the chat template, or as plain text (with the
    special tokens the tokenizer adds, e.g. BOS)."""
    if not use_chat_template:
        return [list(ids) for ids in tokenizer(prompts)["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise GenerationError(f"use_chat_template is true but the tokenizer ({tokenizer.name_or_path}) has no chat "
                              "template; set use_chat_template: false (plain prompts, e.g. for a base model).")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True) for prompt in prompts]
    # The rendered template already holds BOS and the other special tokens.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def decoding_settings(params, model, tokenizer) -> DecodingSettings:
    if params["do_sample"] and params["temperature"] <= 0:
        raise GenerationError(f"do_sample is true and temperature is {params['temperature']}; sampling needs "
                              "temperature > 0 (or set do_sample: false for greedy decoding).")
    if params["do_sample"] and params["top_p"] <= 0:
        raise GenerationError("do_sample is true and top_p is 0, which keeps no token; use 0 < top_p <= 1.")
    eos_ids = eos_token_ids(model, tokenizer)
    return DecodingSettings(max_new_tokens=params["max_new_tokens"], eos_token_ids=eos_ids,
                            pad_token_id=pad_token_id(model, tokenizer, eos_ids), do_sample=params["do_sample"],
                            temperature=params["temperature"], top_p=params["top_p"], seed=params["seed"])


def progress_bar(total: int, interactive: bool):
    """tqdm: the notebook widget when ``interactive`` (JupyterLab), else text on stderr (terminals,
    papermill), redrawn at most once a second so a saved notebook stays small."""
    if interactive:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc="generating", unit="example")
    from tqdm.std import tqdm
    return tqdm(total=total, desc="generating", unit="example", mininterval=1.0, file=sys.stderr)


@dataclass
class Share:
    """What one process generates: its prompts, the ones too long for the model, and how."""

    examples: list[data.Example]  # every example of the input (all processes read them all)
    bad_lines: list[data.BadLine]
    token_ids: list[list[int]]  # per example
    prompts: list[Prompt]  # this process's, still to generate
    too_long: list[int]  # this process's examples that leave no room in the model's context
    backend: Any
    batch_size: int
    model: Any
    tokenizer: Any
    settings: DecodingSettings
    prompts_path: Path


def prepare_share(params, files: OutputFiles, rank: Rank, *, model=None, tokenizer=None,
                  log: Callable[[str], None] = print) -> Share:
    """Read and check the prompts, load the model, skip what is written, and pick this process's share."""
    prompts_path = resolve_input_path(params["prompts_path"])
    examples, bad_lines = data.load_examples(prompts_path, prompt_field=params["prompt_field"],
                                             on_bad_line=params["on_bad_line"], max_examples=params["max_examples"])
    if model is None:
        if rank.device.type == "cpu" and rank.count > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.count))
        model, tokenizer = load_model(params["model"], params["dtype"], rank.device)
    settings = decoding_settings(params, model, tokenizer)
    batch_size = planning.resolve_batch_size(params, "generate")
    backend = make_backend(params["backend"], model, settings, batch_size)
    token_ids = tokenize_prompts(tokenizer, [example.prompt for example in examples], params["use_chat_template"])
    done = data.scan_ids([files.output, *files.output_parts()], data.output_record_id)
    pending = [i for i in range(len(examples)) if examples[i].example_id not in done]
    room = _room_check(params, model, examples, token_ids, pending, prompts_path)
    # Every process sorts all prompts alike and takes every count-th: shares of equal length mix,
    # fixed by the input alone, so a process never takes an example another one owns.
    by_length = sorted(range(len(examples)), key=lambda i: (-len(token_ids[i]), i))
    pending_set = set(pending)
    mine = [i for i in by_length[rank.index::rank.count] if i in pending_set]
    longest = max((len(token_ids[i]) for i in pending), default=0)
    if params["batch_size"] == "auto" and longest > params["prompt_len"]:
        log(f"note: the longest prompt has {longest} tokens but batch_size 'auto' was planned for prompt_len "
            f"{params['prompt_len']}; a batch that runs out of memory is split and retried (nothing is lost), "
            "but raising prompt_len gives a batch size that fits from the start.")
    if rank.index == 0:
        log(f"{len(examples)} examples in {prompts_path}; {len(examples) - len(pending)} already in {files.output}; "
            f"{len(pending)} to generate with {params['model']} ({backend.name}, batch {batch_size}, {rank.count} "
            f"process{'es' if rank.count > 1 else ''}); {len(bad_lines)} bad input lines skipped")
    return Share(examples, bad_lines, token_ids,
                 prompts=[Prompt(i, token_ids[i], room[i]) for i in mine if room[i] > 0],
                 too_long=[i for i in mine if room[i] <= 0], backend=backend, batch_size=batch_size, model=model,
                 tokenizer=tokenizer, settings=settings, prompts_path=prompts_path)


def generate_share(params, share: Share, files: OutputFiles, rank: Rank, *, log: Callable[[str], None] = print,
                   sort_by_length: bool = True, show_progress: bool = True) -> list[BatchStats]:
    """Generate this process's prompts into its part of the output; failures into its failures part."""
    examples, teacher, generation_params = share.examples, params["model"], share.settings.recorded()
    if params["do_sample"]:
        torch.manual_seed(share.settings.seed + rank.index)
    with data.LineAppender(files.output_part(rank)) as outputs, \
            data.LineAppender(files.failures_part(rank)) as failures:
        if rank.index == 0:
            failures.write(data.failure_record(example_id=bad.example_id, line=bad.line, stage="input",
                                               error=bad.reason) for bad in share.bad_lines)
        failures.write(data.failure_record(example_id=examples[i].example_id, line=examples[i].line,
                                           stage="prompt_too_long",
                                           error=_too_long_text(share.token_ids[i], share.model))
                       for i in share.too_long)

        def write(outcome: Outcome) -> None:
            outputs.write(_output_record(examples[prompt.index], completion, share.tokenizer, params, teacher,
                                         generation_params, len(prompt.token_ids))
                          for prompt, completion in outcome.completed)
            failures.write(data.failure_record(example_id=examples[prompt.index].example_id,
                                               line=examples[prompt.index].line, stage="generation", error=error)
                           for prompt, error in outcome.failed)

        bar = progress_bar(len(share.prompts), params["interactive"]) if show_progress and rank.index == 0 else None
        try:
            return run_batches(share.backend, share.prompts, write=write, sort_by_length=sort_by_length,
                               progress=bar, log=log, log_every_batches=params["log_every_batches"],
                               rank=rank.index)
        finally:
            if bar is not None:
                bar.close()


def run_job(params, output_path: str | Path, *, model=None, tokenizer=None, log: Callable[[str], None] = print,
            sort_by_length: bool = True, show_progress: bool = True) -> dict | None:
    """This process's share of the job (all of it when alone). Returns the job's summary in the
    first process (which merges the parts and writes ``<output>.summary.json``), None in the others.

    ``model``/``tokenizer`` preloaded skip loading ``params['model']`` (tests, the benchmark).
    """
    _require_keys(params)
    rank = current_rank()
    files = OutputFiles(Path(output_path))
    began = time.perf_counter()
    share = prepare_share(params, files, rank, model=model, tokenizer=tokenizer, log=log)
    engine_began = time.perf_counter()
    batches = generate_share(params, share, files, rank, log=log, sort_by_length=sort_by_length,
                             show_progress=show_progress)
    counts = {"rank": rank.index, **summarize(batches, time.perf_counter() - engine_began),
              "too_long": len(share.too_long), "setup_seconds": round(engine_began - began, 3),
              "batch_list": [dataclasses.asdict(b) for b in batches]}
    # A collective: the first process passes it only when every process has closed its part.
    every_process = rank.gather(counts)
    if rank.index != 0:
        return None
    summary = _merge_and_audit(files, share.examples, share.bad_lines, every_process)
    summary.update(backend=share.backend.name, batch_size=share.batch_size, processes=rank.count,
                   model=params["model"], prompts_path=str(share.prompts_path),
                   generation_params=share.settings.recorded(), device=str(rank.device), dtype=params["dtype"])
    files.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _require_keys(params) -> None:
    missing = [key for key in PARAMS_USED if key not in params]
    if missing:
        raise GenerationError(f"the generation job needs parameter(s) {', '.join(missing)}; a notebook that runs "
                              "it must declare them in its parameters cell (see notebooks/02_batched_generation).")


def _room_check(params, model, examples, token_ids, pending, prompts_path) -> dict[int, int]:
    """New tokens each pending example may have; a prompt that leaves no room fails the run
    ('fail', checked before anything is generated) or is listed in the failures file ('skip')."""
    context = context_length(model)
    room = {}
    for i in pending:
        left = context - len(token_ids[i]) if context else params["max_new_tokens"]
        room[i] = min(params["max_new_tokens"], left)
        if room[i] <= 0:
            problem = data.BadLine(str(prompts_path), examples[i].line, _too_long_text(token_ids[i], model),
                                   examples[i].example_id)
            data.handle_bad_line(problem, params["on_long_prompt"], "on_long_prompt")
    return room


def _too_long_text(ids: list[int], model) -> str:
    return (f"prompt of {len(ids)} tokens leaves no room to generate in the model's context of "
            f"{context_length(model)} tokens")


def _output_record(example, completion: Completion, tokenizer, params, teacher, generation_params,
                   prompt_tokens: int) -> dict:
    ids = completion.token_ids[:-1] if completion.finish_reason == FINISH_EOS else completion.token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
    return data.output_record(example, output=text, prompt_field=params["prompt_field"], teacher_model=teacher,
                              generation_params=generation_params, prompt_tokens=prompt_tokens,
                              output_tokens=len(completion.token_ids), finish_reason=completion.finish_reason)


def _merge_and_audit(files: OutputFiles, examples, bad_lines, per_process: list[dict]) -> dict:
    """Merge the parts into the output (ordered by input position) and the failures file (ordered
    by line, minus examples that succeeded since), then check that every example is accounted for."""
    positions = {example.example_id: i for i, example in enumerate(examples)}
    written = data.merge_parts(files.output, files.output_parts(), id_of=data.output_record_id, order=positions)
    output_ids = data.scan_ids([files.output], data.output_record_id)
    every_line = {e.line for e in examples} | {b.line for b in bad_lines}
    succeeded_lines = {examples[positions[i]].line for i in output_ids if i in positions}
    failure_count = data.merge_parts(files.failures, files.failure_parts(), id_of=lambda r: r["line"],
                                     order={line: line for line in every_line}, keep="last", exclude=succeeded_lines)
    failed_lines = {r["line"] for _, _, r in data.read_complete_lines(files.failures)}
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


# ----------------------------------------------------------------------------------------------
# Launching: one process, several (notebook_launcher), or under accelerate launch.


@record  # a failing process's traceback reaches the launcher's error instead of "see the logs"
def _process_entry(params: dict, output_path: str) -> None:
    run_job(params, output_path)


def launch(params, output_path: str | Path | None = None, *, run_dir: str | Path | None = None,
           log: Callable[[str], None] = print) -> dict | None:
    """Run the job and return its summary (None in the non-first processes of ``accelerate launch``).

    The output is ``output_path``, else params' ``output_path``, else ``<run_dir>/generations.jsonl``.
    With ``data_parallel_processes`` > 1, and not already under a launcher, the processes are started
    with accelerate's ``notebook_launcher`` (fork; this process must not have used CUDA yet, and
    nothing before this call in this module does).
    """
    _require_keys(params)
    if output_path is None:
        if inside_launcher() and not params["output_path"]:
            raise GenerationError("under a launcher (accelerate launch, torchrun) every process must write to the "
                                  "same file: set output_path (e.g. --set output_path=outputs/teacher.jsonl).")
        output_path = resolve_output_path(params["output_path"], run_dir)
    output_path = Path(output_path)
    processes = params["data_parallel_processes"]
    if processes > 1 and not inside_launcher():
        from accelerate import notebook_launcher
        # Read the prompts here first: a bad line then fails with its message, not as a crashed process.
        data.load_examples(resolve_input_path(params["prompts_path"]), prompt_field=params["prompt_field"],
                           on_bad_line=params["on_bad_line"], max_examples=params["max_examples"])
        summary_file = OutputFiles(output_path).summary
        summary_file.unlink(missing_ok=True)
        log(f"starting {processes} processes (accelerate notebook_launcher)")
        try:
            notebook_launcher(_process_entry, args=(dict(params), str(output_path)), num_processes=processes,
                              use_port=str(_free_port()))
        except Exception as error:  # torch elastic's ChildFailedError, or the launcher's RuntimeError
            raise GenerationError(f"a generation process failed (its traceback is printed above): "
                                  f"{_root_cause(error)}. Everything written so far is kept; rerun with the "
                                  "same output_path to resume.") from error
        return json.loads(summary_file.read_text())
    if inside_launcher() and int(os.environ["WORLD_SIZE"]) != processes:
        log(f"note: running as {os.environ['WORLD_SIZE']} processes (the launcher's count), not "
            f"data_parallel_processes={processes}")
    return run_job(params, output_path, log=log)


def _root_cause(error: Exception) -> str:
    """The first failing process's last traceback line, when torch elastic recorded it."""
    if hasattr(error, "get_first_failure"):
        message = error.get_first_failure()[1].message  # the error file's {"message": ...}, or text
        text = str(message.get("message", message) if isinstance(message, dict) else message).strip()
        return text.splitlines()[-1].rstrip(".") if text else type(error).__name__
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _free_port() -> int:
    """A port no one listens on, so two jobs on one machine do not collide on accelerate's 29500."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def summary_lines(summary: dict) -> list[str]:
    """The end-of-run report in words."""
    waste = summary["padding_waste"]
    lines = [
        f"generated {summary['generated']} in {summary['seconds']:.1f} s: {summary['examples_per_minute']} "
        f"examples/min, {summary['output_tokens_per_second']} output tokens/s"
        + (f", padding waste {waste:.1%}" if waste is not None else "")
        + f" ({summary['backend']}, batch {summary['batch_size']}, {summary['processes']} process(es))",
        f"output: {summary['output_path']} ({summary['in_output']} of {summary['examples']} examples)",
    ]
    longest = sorted(batch["longest_output_tokens"] for batch in summary["batch_list"])
    if longest:
        limit = summary["generation_params"]["max_new_tokens"]
        lines.append(f"longest output per batch: {longest[0]} to {longest[-1]} tokens, median "
                     f"{longest[len(longest) // 2]} (max_new_tokens {limit}; every row of a static batch waits "
                     "for its longest)")
    if summary["in_failures"]:
        lines.append(f"failures: {summary['failures_path']} ({summary['in_failures']} lines: "
                     f"{summary['bad_input_lines']} bad input, {summary['too_long']} too long, "
                     f"{summary['failed']} failed alone in this run); rerunning retries the generation failures")
    if summary["unaccounted"]:
        lines.append(f"ERROR: {summary['unaccounted']} examples are neither in the output nor in the failures "
                     f"file, e.g. {summary['unaccounted_ids'][:5]}; please report this")
    return lines


def task_accuracy(records: list[dict]) -> dict | None:
    """Accuracy on a checkable task: the arithmetic records (domain 'arithmetic' with a reference
    answer) scored by ``workbook.arithmetic``; None when the output holds none."""
    from workbook import arithmetic
    checkable = [r for r in records if r.get("domain") == arithmetic.DOMAIN
                 and r["metadata"].get("original_output") is not None]
    if not checkable:
        return None
    references = [{"id": r["metadata"]["example_id"], "output": r["metadata"]["original_output"]} for r in checkable]
    return {"task": arithmetic.DOMAIN, "scored": len(checkable),
            "accuracy": arithmetic.accuracy(references, [r["output"] for r in checkable])}


def read_outputs(path: str | Path) -> list[dict]:
    return [record for _, _, record in data.read_complete_lines(path)]


# ----------------------------------------------------------------------------------------------
# Command line: `workbook generate` and `python -m workbook.generate` (also under accelerate launch).


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook generate --params FILE [--set key=value ...]`. Exit 0 when every example was
    generated, 1 when some are in the failures file, 2 when the job could not run."""
    from workbook import memory, notebook, params as params_module, runner

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        params = runner.resolve_params(params_arg, overrides, log=say)[0]
        output_path = None
        if not params["output_path"] and not inside_launcher():
            output_path = resolve_output_path("", notebook.new_run_dir(params["profile"]))
            settings = " ".join(overrides)
            say(f"writing to {output_path}; to resume after an interruption: workbook generate --params "
                f"{params_arg} --set {settings + ' ' if settings else ''}output_path={output_path}")
        summary = launch(params, output_path, log=say)
    except (params_module.ParamsError, data.DataError, GenerationError, memory.DoesNotFitError) as error:
        say(f"error: {error}")
        return 2
    if summary is None:
        return 0
    for line in summary_lines(summary):
        print(line)
    return 0 if summary["in_failures"] == 0 and summary["unaccounted"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m workbook.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override a parameter")
    args = parser.parse_args(argv)
    return cli_main(args.params, args.set)


if __name__ == "__main__":
    raise SystemExit(main())
