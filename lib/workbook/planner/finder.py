"""Prove the planner's batch size by running the worst case; back off when it runs out of memory.

The planner (``workbook.planner``) predicts the largest batch; this module checks it on the real
device before a long run starts::

    plan = planner.plan_generate(config, batch_size=1, prompt_len=longest, new_tokens=512, ...)
    probe = probes.generation_probe(model, tokenizer, longest_prompt, max_new_tokens=512)
    result = find_batch_size(plan.max_batch_size, probe,
                             predicted_bytes=lambda batch: planner.plan_generate(
                                 config, batch_size=batch, ...).total_bytes)
    result.batch_size          # the largest batch whose worst case ran; use it for the whole run
    result.to_dict()           # every attempt, the measured peak and the prediction beside it

Why not accelerate's ``find_executable_batch_size`` (or the HF Trainer's ``auto_find_batch_size``)?
They shrink the batch when whatever batch they happened to draw runs out of memory, so a run that
fits its first batches can still die hours later on the longest sequence. Here the probe IS the
worst case (the longest prompt with the full ``max_new_tokens`` forced, or the longest training
sequence with the optimizer states allocated), so a batch that passes the probe passes every
batch of the data set. The result is only as safe as the probe is worst-case: probe with a
shorter sequence than the data holds and the settled batch can still run out of memory.

Out-of-memory errors are recognised exactly as accelerate recognises them
(``accelerate.utils.memory.should_reduce_batch_size``: CUDA/XPU/MPS/CPU out of memory and cuDNN
"not supported"); any other error propagates unchanged.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from workbook.units import format_bytes

DEFAULT_BACKOFF = 0.9  # accelerate's find_executable_batch_size multiplies by 0.9 on each OOM
ERROR_TEXT_LIMIT = 300  # characters of an OOM message kept in the attempt record


# ----------------------------------------------------------------------------------------------
# What a probe measures, and what the finder returns.


@dataclass(frozen=True)
class ProbeMeasurement:
    """One worst-case run of a probe at ``batch_size``.

    Memory fields are bytes on the model's CUDA device and None on CPU: there is no CPU allocator
    high-water mark that can be reset before a run, so CPU peaks are not measured (not guessed).
    """

    batch_size: int
    device: str  # e.g. "cuda:0" or "cpu"
    seconds: float  # wall time of the run, device synchronized
    peak_reserved_bytes: int | None  # torch.cuda.max_memory_reserved: the caching allocator's peak
    peak_allocated_bytes: int | None  # torch.cuda.max_memory_allocated: live tensors at the peak
    # Device memory used outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN workspaces, and
    # any other process on the same GPU): total - free - memory_reserved, read after the run.
    non_pytorch_bytes: int | None
    sequence_tokens: int  # tokens per sequence: prompt + new tokens, or the training seq_len
    prompt_tokens: int | None = None  # generation only
    generated_tokens: int | None = None  # generation only: new tokens actually produced
    details: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int | None:
        """The device memory the run needed at its peak: reserved peak + non-PyTorch usage."""
        if self.peak_reserved_bytes is None or self.non_pytorch_bytes is None:
            return None
        return self.peak_reserved_bytes + self.non_pytorch_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class Attempt:
    """One probe run by the finder: passed ("ok") or ran out of memory ("oom")."""

    batch_size: int
    outcome: str  # "ok" or "oom"
    peak_bytes: int | None  # measured; None for an OOM or on CPU
    predicted_bytes: int | None  # the planner's total for this batch, when given
    seconds: float
    error: str | None = None  # the OOM message, shortened


@dataclass(frozen=True)
class FinderResult:
    """The batch size the worst-case probe ran at, and how the finder got there.

    Only as safe as the probe is worst-case: see the module docstring.
    """

    batch_size: int  # the settled batch: its probe passed; every larger attempt ran out of memory
    start_batch: int  # where the search began (the planner's max_batch_size)
    attempts: list[Attempt]
    measurement: ProbeMeasurement  # the settled batch's probe
    predicted_bytes: int | None  # the planner's total for the settled batch, when given

    @property
    def measured_peak_bytes(self) -> int | None:
        """Peak device bytes of the settled batch's probe; None on CPU (not measured)."""
        return self.measurement.peak_bytes

    def to_dict(self) -> dict:
        """A JSON-ready record of the search."""
        return {
            "batch_size": self.batch_size,
            "start_batch": self.start_batch,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_bytes": self.predicted_bytes,
            "attempts": [asdict(attempt) for attempt in self.attempts],
            "measurement": self.measurement.to_dict(),
        }


class NoBatchFitsError(RuntimeError):
    """Even batch 1 of the worst-case probe exhausted the device; the message says what to do."""




# ----------------------------------------------------------------------------------------------
# The search.


def find_batch_size(
    start_batch: int,
    probe: Callable[[int], ProbeMeasurement],
    *,
    predicted_bytes: Callable[[int], int] | None = None,
    backoff: float = DEFAULT_BACKOFF,
    log: Callable[[str], None] | None = print,
) -> FinderResult:
    """The largest batch, from ``start_batch`` down, whose worst-case ``probe`` runs.

    Runs ``probe(start_batch)``; on an out-of-memory error multiplies the batch by ``backoff``
    (and lowers it by at least 1) and tries again, freeing memory between attempts as accelerate
    does (garbage collection, then the device cache). Errors that are not out-of-memory propagate
    unchanged. Raises NoBatchFitsError when batch 1 runs out of memory too.

    ``predicted_bytes(batch)``, usually the planner's ``total_bytes``, is recorded beside each
    measurement. ``log`` (print by default, None for silence) receives one line per attempt.
    """
    if isinstance(start_batch, bool) or not isinstance(start_batch, int) or start_batch < 1:
        raise ValueError(
            f"start_batch must be a positive integer (the planner's max_batch_size), got "
            f"{start_batch!r}; a plan whose max_batch_size is 0 does not fit even at batch 1, "
            "see Plan.advice()"
        )
    if not 0 < backoff < 1:
        raise ValueError(f"backoff must be between 0 and 1 (e.g. 0.9), got {backoff!r}")
    say = log or (lambda line: None)
    attempts: list[Attempt] = []
    batch = start_batch
    clear_device_cache(garbage_collection=True)  # start from an empty cache, as accelerate does
    while True:
        predicted = predicted_bytes(batch) if predicted_bytes is not None else None
        started = time.perf_counter()
        try:
            measurement = probe(batch)
        except Exception as error:
            if not should_reduce_batch_size(error):
                raise
            attempts.append(Attempt(batch, "oom", None, predicted, time.perf_counter() - started,
                                    error_summary(error)))
            if batch == 1:
                raise NoBatchFitsError(_no_batch_fits_message(attempts, predicted)) from error
        else:
            attempts.append(Attempt(batch, "ok", measurement.peak_bytes, predicted,
                                    measurement.seconds))
            say(f"batch {batch}: worst case ran ({_bytes_text(measurement.peak_bytes)} peak, "
                f"predicted {_bytes_text(predicted)})")
            return FinderResult(batch, start_batch, attempts, measurement, predicted)
        # Outside the except block no reference to the error (and to the frames holding the
        # probe's tensors) is left, so garbage collection can free them before the cache is emptied.
        clear_device_cache(garbage_collection=True)
        next_batch = smaller_batch(batch, backoff)
        say(f"batch {batch}: ran out of memory; trying {next_batch}")
        batch = next_batch


def smaller_batch(batch: int, backoff: float = DEFAULT_BACKOFF) -> int:
    """The batch to try after ``batch`` ran out of memory: ``floor(batch x backoff)``, at most
    ``batch - 1`` (0.9 x 5 would stay at 4.5 -> 4, but 0.9 x 2 = 1.8 must not round back to 2)
    and at least 1."""
    return max(1, min(batch - 1, math.floor(batch * backoff)))


def _no_batch_fits_message(attempts: list[Attempt], predicted: int | None) -> str:
    # Worded without accelerate's OOM phrases, so an outer batch-size finder does not mistake
    # this advice for an out-of-memory error it could fix by shrinking its own batch.
    tried = ", ".join(str(attempt.batch_size) for attempt in attempts)
    prediction = f" (the planner predicted {_bytes_text(predicted)} for it)" if predicted else ""
    return (
        f"even batch size 1 exhausted device memory in the worst-case probe{prediction}; tried "
        f"batch sizes {tried}. The longest sequence does not fit: shorten the longest prompt or "
        "max_new_tokens (generation) or seq_len (training), use a smaller dtype or quantized "
        "weights, enable gradient checkpointing, train LoRA adapters or use an 8-bit optimizer, "
        "or use a GPU with more memory (or more GPUs). The original error is chained below."
    )


def error_summary(error: BaseException) -> str:
    """'Type: message' of ``error``, cut to ERROR_TEXT_LIMIT characters for a JSON record."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 3] + "..."


def _bytes_text(value: int | None) -> str:
    return "not measured" if value is None else format_bytes(value)

