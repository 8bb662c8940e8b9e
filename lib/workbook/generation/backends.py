"""Backends: generate for a list of prompts, or raise. The ``backend`` setting picks one.

``static`` is Hugging Face ``generate`` with a dynamic KV cache; ``static-compiled`` uses a static
KV cache and ``torch.compile`` (on CUDA Hugging Face's default, CUDA graphs included; elsewhere
dynamic shapes, which exists for testing); ``continuous`` (``continuous.py``) is transformers'
continuous batching: one manager streams the whole job, paged attention, a finished sequence's
slot is refilled at once, ``batch_size`` requests in flight. With greedy decoding all three give
the tokens one-at-a-time generation gives (tests/test_generate.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from workbook.generation.continuous import ContinuousBackend
from workbook.generation.engine import BackendOutput, DecodingSettings, GenerationError, Prompt, finish
from workbook.generation.settings import GenerationSettings
from workbook.decoding import left_pad
from workbook.params import AUTO, SCHEMA
from workbook.paths import REFERENCE_DIR

BACKENDS = tuple(name for name in SCHEMA["backend"].choices if name != AUTO)  # static, static-compiled, continuous
# What ``backend: auto`` reads: the continuous-batching benchmark of the profile, under REFERENCE_DIR.
MEASUREMENT_FILE = "continuous_batching.json"
FINISH_EOS, FINISH_LENGTH = "eos", "length"


class StaticBackend:
    """Hugging Face ``generate`` on a left-padded batch; ``compiled``: static KV cache + torch.compile."""

    def __init__(self, model, settings: DecodingSettings, batch_size: int, compiled: bool = False):
        self.model, self.settings = model, settings
        self.name = "static-compiled" if compiled else "static"
        self.prompts_per_call = batch_size
        self.extra: dict[str, Any] = {}
        # prompts -> logits processors for their batch (the benchmark forces each row's length with one)
        self.logits_processors: Callable[[list[Prompt]], list] | None = None
        # The static cache this backend passes to ``generate`` and keeps: (batch size, length, cache).
        self._static_cache: tuple[int, int, Any] | None = None
        if compiled:
            # generate builds a new static cache per call unless given one (transformers 5.17-5.23,
            # _prepare_static_cache), and a new cache is a new address: CUDA graphs are then recorded
            # again every batch (torch re-records when a static input moves, and after 128 it runs the
            # step eagerly). One cache, reset between batches, keeps the graphs valid. A model whose
            # generation_config names its own cache keeps that (generate refuses both).
            if getattr(getattr(model, "generation_config", None), "cache_implementation", None) not in (None, "hybrid"):
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
        self.keeps_cache = compiled and "cache_implementation" not in self.extra

    def generate(self, prompts: list[Prompt]) -> BackendOutput:
        input_ids, attention_mask = left_pad([p.token_ids for p in prompts], self.settings.pad_token_id,
                                             self.model.device)
        new_tokens = max(p.max_new_tokens for p in prompts)
        processors = self.logits_processors(prompts) if self.logits_processors is not None else None
        cache = {}
        if self.keeps_cache:
            # Room for the job's outputs even on a shorter call (a pilot's two-token warm-up): the next
            # batch then reuses the cache instead of recompiling for a new one. Never past the context.
            context = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
            needed = input_ids.shape[1] + new_tokens
            room = input_ids.shape[1] + max(new_tokens, self.settings.max_new_tokens)
            cache["past_key_values"] = self.static_cache(len(prompts), max(needed, min(room, context or room)))
        output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, logits_processor=processors,
                                     generation_config=self.settings.generation_config(new_tokens, **self.extra),
                                     **cache)
        generated = output[:, input_ids.shape[1]:].tolist()  # sliced at the padded prompt length
        completions = [finish(row, p.max_new_tokens, self.settings.eos_token_ids)
                       for row, p in zip(generated, prompts)]
        return BackendOutput(completions, token_slots=output.shape[0] * output.shape[1])

    def static_cache(self, batch_size: int, length: int):
        """The kept static cache, emptied, when it has ``batch_size`` rows and room for ``length``
        positions; else a new one (the old one dropped first, so both never live at once: after an
        out-of-memory split the half batch gets the memory back). Batches run longest first, so the
        first batch's cache serves the job; as in generate, a cache never shrinks in length."""
        if self._static_cache is not None:
            rows, room, cache = self._static_cache
            if rows == batch_size and room >= length:
                cache.reset()
                return cache
            length = max(length, room)
            self._static_cache = None
        from transformers import StaticCache
        cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=length)
        self._static_cache = (batch_size, length, cache)
        return cache


def make_backend(name: str, model, settings: DecodingSettings, batch_size: int):
    if name == "static":
        return StaticBackend(model, settings, batch_size)
    if name == "static-compiled":
        return StaticBackend(model, settings, batch_size, compiled=True)
    if name == "continuous":
        return ContinuousBackend(model, settings, batch_size)
    raise GenerationError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")


def resolve_backend(profile: dict, reference_dir: Path = REFERENCE_DIR) -> tuple[str, str]:
    """``choose_backend`` for a whole validated profile (its settings built here)."""
    return choose_backend(GenerationSettings.from_params(profile), reference_dir)


def choose_backend(settings: GenerationSettings, reference_dir: Path = REFERENCE_DIR) -> tuple[str, str]:
    """(backend, why). ``auto`` reads the profile's continuous-batching benchmark
    (``workbook bench-continuous``): continuous where it beat length-sorted static
    batches on uneven outputs (teacher outputs are uneven), static where it did not, where nothing
    was measured for this profile, or under tensor parallelism (which continuous cannot run)."""
    name, profile_name = settings.backend, settings.profile
    if name != AUTO:
        return name, f"backend {name}: set in params"
    tensor_parallel_size = settings.tensor_parallel_size
    if tensor_parallel_size not in (1, AUTO):  # the job passes the size 'auto' resolved to
        return "static", (f"backend auto -> static: tensor_parallel_size {tensor_parallel_size}, and continuous "
                          "batching does not run sharded")
    path = Path(reference_dir) / profile_name / MEASUREMENT_FILE
    if not path.exists():
        return "static", (f"backend auto -> static: nothing measured for the {profile_name} profile ({path} is "
                          f"missing); workbook bench-continuous --out {path.parent} measures it")
    try:
        report = json.loads(path.read_text())
        results = {result["workload"]: result for result in report["results"]}
        workloads = [results[name] for name in ("uneven", "full") if name in results]
        if not workloads:
            raise KeyError("neither an 'uneven' nor a 'full' workload")
        # A run its time budget cut may lack an arm, and so the ratio, of a workload.
        measured = next((result for result in workloads if result["continuous_vs_static"] is not None), None)
        ratio = None if measured is None else float(measured["continuous_vs_static"])
    except (ValueError, KeyError, TypeError) as error:
        raise GenerationError(f"backend auto reads {path}, which is not a continuous-batching benchmark report "
                              f"({type(error).__name__}: {error}); rerun workbook bench-continuous "
                              f"--out {path.parent}, or set backend to static or continuous.") from None
    if ratio is None:
        return "static", (f"backend auto -> static: {path} compares no continuous with static run (its time budget "
                          f"ran out first); workbook bench-continuous --out {path.parent} measures it")
    chosen = "continuous" if ratio >= 1 else "static"
    return chosen, (f"backend auto -> {chosen}: on the {profile_name} profile ({report.get('device')}, "
                    f"{report.get('model')}) continuous batching ran at {ratio}x the speed of length-sorted static "
                    f"batches on {measured['workload']} outputs ({path})")
