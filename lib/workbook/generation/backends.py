"""Backends: generate for a list of prompts, or raise. ``backend`` in params picks one.

``static`` is Hugging Face ``generate`` with a dynamic KV cache; ``static-compiled`` uses a static
KV cache and ``torch.compile`` (on CUDA Hugging Face's default, CUDA graphs included; elsewhere
dynamic shapes, which exists for testing); ``continuous`` (``continuous.py``) is transformers'
continuous batching: one manager streams the whole job, paged attention, a finished sequence's
slot is refilled at once, ``batch_size`` requests in flight. With greedy decoding all three give
the tokens one-at-a-time generation gives (tests/test_generate.py).
"""

from __future__ import annotations

from typing import Any

from workbook.generation.continuous import ContinuousBackend
from workbook.generation.engine import BackendOutput, DecodingSettings, GenerationError, Prompt, finish
from workbook.models import left_pad
from workbook.params import SCHEMA

BACKENDS = SCHEMA["backend"].choices  # static, static-compiled, continuous
FINISH_EOS, FINISH_LENGTH = "eos", "length"


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


def make_backend(name: str, model, settings: DecodingSettings, batch_size: int):
    if name == "static":
        return StaticBackend(model, settings, batch_size)
    if name == "static-compiled":
        return StaticBackend(model, settings, batch_size, compiled=True)
    if name == "continuous":
        return ContinuousBackend(model, settings, batch_size)
    raise GenerationError(f"backend {name!r}: expected one of {', '.join(BACKENDS)}")
