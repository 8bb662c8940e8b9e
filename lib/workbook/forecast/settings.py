"""The forecast's settings, built once at its entry (``workbook forecast``, notebook 01): the forecast's
own keys as one typed ``ForecastSettings``, the machine as ``workbook.hardware.Hardware``, and the job it
forecasts as that job builds its own settings (``GenerationSettings``, ``TrainConfig``). Below the entry
the forecast reads these objects, never the params::

    own = ForecastSettings.from_params(params)
    own.expected_lengths                        # (400,) or a distribution, () when not stated
    machines = profiles_hardware(params)        # every profile's Hardware, this run's own among them
    jobs_on_profiles(params)                    # the job as each profile runs it: its machine, layout, dtype
"""

from __future__ import annotations

from dataclasses import dataclass

from workbook import params as params_module
from workbook.hardware import Hardware
from workbook.params import default as _default

# What a profile brings to a job run on its machine: its hardware, price, process layout and dtype; the
# job's own settings (model, prompts, lengths, batch size) stay the job's.
HARDWARE_KEYS = ("profile", "gpu_spec", "gpu_name_pattern", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops",
                 "peak_fp16_tflops", "memory_bandwidth_gbs", "supports_bf16", "supports_tf32", "usd_per_gpu_hour",
                 "cuda_overhead_gib", "data_parallel_processes", "train_processes", "tensor_parallel_size", "dtype")


@dataclass(frozen=True)
class ForecastSettings:
    """The keys the forecast reads itself, besides the job's settings and the hardware."""

    profile: str = _default("profile")
    model: str = _default("model")
    plan_mode: str = _default("plan_mode")  # the job forecast when --mode is not given
    seq_len: int = _default("seq_len")  # training rows when max_seq_length is 'auto' (the no-pilot forecast)
    expected_new_tokens: str = _default("expected_new_tokens")
    output_path: str = _default("output_path")  # generation: where the pilot writes (the job's output)
    train_output_dir: str = _default("train_output_dir")  # training: where the forecast is recorded

    @classmethod
    def from_params(cls, params) -> "ForecastSettings":
        return params_module.settings_of(cls, params)

    @property
    def expected_lengths(self) -> tuple[int, ...]:
        """``expected_new_tokens`` as lengths in tokens (validated on load); () when not stated."""
        return tuple(int(item) for item in self.expected_new_tokens.replace(" ", "").split(",") if item)


def on_profile(params, other: dict) -> params_module.Params:
    """The job of ``params`` on ``other``'s machine: its hardware facts, price, process layout and
    dtype; the job's own settings (model, prompts, lengths, batch size) kept."""
    return params_module.Params({**params, **{key: other[key] for key in HARDWARE_KEYS if key in other}})


def jobs_on_profiles(params, profiles: dict | None = None) -> dict[str, params_module.Params]:
    """The job of ``params`` as each profile would run it (``on_profile``; ``profiles``: default every
    file in params/), its own profile as ``params`` state it (their --set included)."""
    profiles = params_module.load_all() if profiles is None else profiles
    own = params["profile"]
    return {name: params if name == own else on_profile(params, other)
            for name, other in {**profiles, own: params}.items()}


def profiles_hardware(params, profiles: dict | None = None) -> dict[str, Hardware]:
    """Each profile's machine (``profiles``: default every file in params/), this run's own from
    ``params`` (its --set included)."""
    profiles = params_module.load_all() if profiles is None else profiles
    return {name: Hardware.from_params(other) for name, other in {**profiles, params["profile"]: params}.items()}
