"""Backends: generate for a list of prompts, or raise. ``backend`` in params picks one.

``static`` is Hugging Face ``generate`` with a dynamic KV cache; ``static-compiled`` uses a static
KV cache and ``torch.compile`` (on CUDA Hugging Face's default, CUDA graphs included; elsewhere
dynamic shapes, which exists for testing); ``continuous`` is transformers' continuous batching
(``generate_batch``: paged attention, a finished sequence's slot is refilled at once), with
``batch_size`` requests in flight. With greedy decoding all three give the tokens one-at-a-time
generation gives (tests/test_generate.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from accelerate.utils.memory import should_reduce_batch_size

from workbook.generation.engine import (
    BackendOutput, DecodingSettings, GenerationError, PartialFailure, Prompt, finish,
)
from workbook.models import left_pad
from workbook.params import SCHEMA

BACKENDS = SCHEMA["backend"].choices  # static, static-compiled, continuous
FINISH_EOS, FINISH_LENGTH = "eos", "length"
# Continuous batching gets this many batches of prompts per call, so that slots freed by short
# outputs are refilled from the queue instead of idling until the longest output of the call ends.
CONTINUOUS_BATCHES_PER_CALL = 4


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
