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
from workbook.job_settings import GenerationFields
from workbook.params import SCHEMA


@dataclass(frozen=True)
class GenerationSettings(GenerationFields):
    """Everything the generation job reads: the fields (params keys of the same names) are declared,
    torch-free, in ``workbook.job_settings.GenerationFields``."""

    # The whole validated profile, for the planner alone (memory budget, batch size, layout), which is
    # asked with a profile; kept equal to the fields by ``replace``.
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
