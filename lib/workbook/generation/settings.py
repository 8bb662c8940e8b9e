"""The generation job's settings: the validated params become one typed ``GenerationSettings``, once,
at the job's entry (``run_job``, the launcher, the forecast's pilot); every later step reads its
fields, never the params again. Defaults are the schema's (``workbook.params.SCHEMA``)::

    settings = GenerationSettings.from_params(params)
    settings.max_new_tokens, settings.do_sample, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from workbook import job_keys
from workbook.generation.engine import GenerationError
from workbook.params import SCHEMA, default as _default


@dataclass(frozen=True)
class GenerationSettings:
    """Everything the generation job reads, each field a params key of the same name."""

    profile: str = _default("profile")
    model: str = _default("model")
    dtype: str = _default("dtype")
    interactive: bool = _default("interactive")  # the progress bar: a notebook widget, or text
    batch_size: int | str = _default("batch_size")  # sequences per batch, or 'auto' (the planner's)
    prompt_len: int = _default("prompt_len")  # the prompt length 'auto' plans for
    max_new_tokens: int = _default("max_new_tokens")
    prompts_path: str = _default("prompts_path")
    prompt_field: str = _default("prompt_field")
    output_path: str = _default("output_path")
    backend: str = _default("backend")
    do_sample: bool = _default("do_sample")
    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    seed: int = _default("seed")
    max_examples: int = _default("max_examples")
    on_bad_line: str = _default("on_bad_line")
    on_long_prompt: str = _default("on_long_prompt")
    use_chat_template: bool = _default("use_chat_template")
    log_every_batches: int = _default("log_every_batches")
    data_parallel_processes: int = _default("data_parallel_processes")
    tensor_parallel_size: int | str = _default("tensor_parallel_size")
    samples_per_prompt: int = _default("samples_per_prompt")
    verifier: str = _default("verifier")
    max_accepted_per_prompt: int = _default("max_accepted_per_prompt")
    system_prompt: str = _default("system_prompt")
    on_no_system_role: str = _default("on_no_system_role")
    peer_timeout_seconds: float = _default("peer_timeout_seconds")
    # The whole validated profile, for the planner alone (memory budget, batch size, layout), which is
    # asked with a profile; kept equal to the fields above by ``replace``.
    profile_params: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_params(cls, params) -> "GenerationSettings":
        """The settings of a validated params profile (or a notebook's parameters); a key the job reads
        and ``params`` lacks is named, with where to declare it."""
        problem = job_keys.missing(params, "generate")
        if problem:
            raise GenerationError(problem)
        return cls(**{name: params[name] for name in field_keys()}, profile_params=dict(params))

    def replace(self, **changes) -> "GenerationSettings":
        """A copy with ``changes`` (params keys), in its fields and in the profile the planner reads."""
        return dataclasses.replace(self, **changes, profile_params={**self.profile_params, **changes})


def field_keys() -> tuple[str, ...]:
    """The params keys the settings hold (each field's name)."""
    return tuple(f.name for f in fields(GenerationSettings) if f.name in SCHEMA)
