"""Prove the planner's batch size by running the worst case; back off when it runs out of memory.

The planner (``workbook.memory``) predicts the largest batch; this module checks it on the real
device before a long run starts::

    plan = memory.plan_generate(config, batch_size=1, prompt_len=longest, new_tokens=512, ...)
    probe = generation_probe(model, tokenizer, longest_prompt, max_new_tokens=512)
    result = find_batch_size(plan.max_batch_size, probe,
                             predicted_bytes=lambda batch: memory.plan_generate(
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

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

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


class ProbeError(RuntimeError):
    """A probe could not run the worst case it was asked for (e.g. generation stopped early)."""


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
    return "not measured" if value is None else f"{value / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------
# Probes: the worst case of generation and of a training step.


def generation_probe(
    model: torch.nn.Module,
    tokenizer,
    longest_prompt: str | list[int],
    max_new_tokens: int,
) -> Callable[[int], ProbeMeasurement]:
    """A probe that generates from ``batch`` copies of the longest prompt for exactly
    ``max_new_tokens`` tokens, greedily, on the model's device.

    ``min_new_tokens = max_new_tokens`` stops end-of-sequence from ending generation early, so
    the KV cache reaches its full length, the worst case of the data set. All copies have the
    same length, so no padding is needed (its side does not matter). ``longest_prompt`` is text
    (tokenized with ``tokenizer``, special tokens included as for the data) or token ids
    (``tokenizer`` may then be None). Raises ProbeError if generation still stops short.
    """
    prompt_ids = _prompt_ids(tokenizer, longest_prompt)
    _require_positive_int("max_new_tokens", max_new_tokens)
    pad_token_id = _pad_token_id(model, tokenizer)
    device = _model_device(model)

    def probe(batch: int) -> ProbeMeasurement:
        input_ids = torch.tensor([prompt_ids] * batch, dtype=torch.long, device=device)

        def run():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # end of sequence cannot end it early
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_token_id,
            )
            return output.shape[1] - len(prompt_ids)

        generated, memory_fields, seconds = _measure(device, run)
        if generated != max_new_tokens:
            raise ProbeError(
                f"the generation probe produced {generated} new tokens, not max_new_tokens="
                f"{max_new_tokens}, so the worst case was not measured; check the model's "
                "generation_config (max_length, stop strings) and that the model's "
                "max_position_embeddings allows prompt + max_new_tokens"
            )
        return ProbeMeasurement(
            batch_size=batch, device=str(device), seconds=seconds, **memory_fields,
            sequence_tokens=len(prompt_ids) + generated, prompt_tokens=len(prompt_ids),
            generated_tokens=generated,
        )

    return probe


def training_probe(
    model: torch.nn.Module,
    seq_len: int,
    *,
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    vocab_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Callable[[int], ProbeMeasurement]:
    """A probe that runs one full training step on ``batch`` random sequences of ``seq_len`` tokens.

    Forward with labels, backward, one optimizer step (so the optimizer states exist at the
    peak, as from the first real step on), then ``zero_grad(set_to_none=True)``. The model is put
    in train mode for the step (gradient checkpointing only acts in train mode) and returned to
    its previous mode. ``autocast_dtype`` (e.g. torch.bfloat16) runs the forward under autocast,
    as a mixed-precision trainer would; None runs in the weights' own dtype.

    The probe does not train the model. The default optimizer is ``AdamW(lr=0)``: it allocates
    both moments like any AdamW, and with lr=0 its step leaves every parameter bit for bit as it
    was (decoupled weight decay multiplies by 1 - lr x wd = 1; the update is scaled by lr), as
    long as the gradients are finite (0 x inf is NaN: a model whose first step overflows is
    broken anyway). Weights are not copied and restored instead, because a copy on the device
    would inflate the very peak being measured. A custom ``optimizer_factory(parameters)`` must keep that promise
    (build it with lr=0). Gradients the model held before the probe are discarded. The optimizer
    is rebuilt for every call, so the user's own optimizer state is never touched.
    """
    _require_positive_int("seq_len", seq_len)
    vocab_size = vocab_size or _vocab_size(model)
    make_optimizer = optimizer_factory or (lambda parameters: torch.optim.AdamW(parameters, lr=0.0))
    device = _model_device(model)

    def probe(batch: int) -> ProbeMeasurement:
        # Random ids: memory depends on shapes only; a fixed seed keeps runs comparable.
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator).to(device)
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        was_training = model.training

        def run():
            optimizer = make_optimizer(trainable)
            model.train()
            try:
                with torch.autocast(device.type, dtype=autocast_dtype,
                                    enabled=autocast_dtype is not None):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
            finally:
                optimizer.zero_grad(set_to_none=True)
                model.train(was_training)
            return None

        _, memory_fields, seconds = _measure(device, run)
        return ProbeMeasurement(
            batch_size=batch, device=str(device), seconds=seconds, **memory_fields,
            sequence_tokens=seq_len,
        )

    return probe


def _measure(device: torch.device, run: Callable[[], object]) -> tuple[object, dict, float]:
    """Run ``run()`` and return its result, the memory fields of ProbeMeasurement and seconds.

    On CUDA the peak statistics are reset after emptying the cache, so the reserved peak counts
    what this run held (live tensors from before included), not blocks cached by earlier runs.
    """
    cuda = device.type == "cuda"
    if cuda:
        clear_device_cache(garbage_collection=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result = run()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    if not cuda:
        fields = dict(peak_reserved_bytes=None, peak_allocated_bytes=None, non_pytorch_bytes=None)
        return result, fields, seconds
    free, total = torch.cuda.mem_get_info(device)
    fields = dict(
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        non_pytorch_bytes=total - free - torch.cuda.memory_reserved(device),
    )
    return result, fields, seconds


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (tokens), got {value!r}")


def _prompt_ids(tokenizer, longest_prompt: str | list[int]) -> list[int]:
    if isinstance(longest_prompt, str):
        if tokenizer is None:
            raise ValueError("longest_prompt is text, so a tokenizer is needed to turn it into ids")
        ids = list(tokenizer(longest_prompt)["input_ids"])
    else:
        ids = [int(token) for token in longest_prompt]
    if not ids:
        raise ValueError("longest_prompt is empty; pass the longest prompt of the data set")
    return ids


def _pad_token_id(model, tokenizer) -> int:
    """The tokenizer's pad id, else the model's, else end of sequence, else 0 (all copies are
    equally long, so padding never happens; generate() only wants the id set)."""
    candidates = []
    if tokenizer is not None:
        candidates += [tokenizer.pad_token_id, tokenizer.eos_token_id]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates += [generation_config.pad_token_id, generation_config.eos_token_id]
    for candidate in candidates:
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _vocab_size(model) -> int:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text.vocab_size


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------
# From a params profile: load the model on the device and prove the planned batch.

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_probe_model(model: str, dtype: str, device: str | torch.device):
    """(model, description) for probing: a local directory (or 'tiny') loads its weights; a preset
    name builds the architecture with random weights on the device (memory does not depend on the
    values, and nothing is downloaded)."""
    from transformers import AutoModelForCausalLM

    from workbook import presets, tiny_model

    torch_dtype = TORCH_DTYPES[dtype]
    try:
        path = tiny_model.resolve_model_path(model)
    except ValueError:
        config = presets.load_config(model)  # raises for a name that is neither preset nor path
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        return built.eval(), f"{model}: architecture from the preset config, random {dtype} weights"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    return loaded.eval(), f"{model}: weights loaded from {path} in {dtype}"


def prove_batch_size(params, mode: str, *, device: str | torch.device, log=print) -> tuple[FinderResult, str]:
    """Start from the planner's batch for the profile and prove it with the worst-case probe.

    Generation probes prompts of the profile's `prompt_len` tokens continued by the full
    `max_new_tokens`; training probes sequences of `seq_len` tokens with the optimizer step.
    Returns the finder's result and a description of the model that was probed.
    """
    from workbook import planning

    start = planning.resolve_batch_size(params, mode)
    model, description = load_probe_model(params["model"], params["dtype"], device)
    vocab = model.config.vocab_size
    if mode == "generate":
        prompt = torch.randint(0, vocab, (params["prompt_len"],), generator=torch.Generator().manual_seed(0))
        probe = generation_probe(model, None, prompt.tolist(), params["max_new_tokens"])
    else:
        if params["grad_checkpointing"]:
            model.gradient_checkpointing_enable()
        probe = training_probe(model, params["seq_len"])

    def predicted(batch: int) -> int:
        return planning.plan(params, mode=mode, batch_size=batch).total_bytes

    try:
        return find_batch_size(start, probe, predicted_bytes=predicted, log=log), description
    finally:
        del model, probe
        clear_device_cache(garbage_collection=True)
