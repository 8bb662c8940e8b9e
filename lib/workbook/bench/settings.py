"""The benchmark's settings (notebook 04, ``workbook bench``): the validated params become one typed
``BenchSettings``, once, at the benchmark's entry (``report.cli_main``, notebook 04); the sweeps and
the report read its fields, never the params again. Defaults are the schema's::

    settings = BenchSettings.from_params(params)
    settings.bench_examples, settings.hardware.memory_bandwidth_gbs, ...

Its field names are the keys the benchmark reads (``job_keys.BENCH``), so this module stays free of
torch: ``workbook bench --help`` lists them without importing the benchmark.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from workbook.hardware import Hardware
from workbook.params import SCHEMA, ParamsError, default as _default

NOTEBOOK = "notebooks/04_benchmarking"  # declares every key in its parameters cell


@dataclass(frozen=True)
class BenchSettings:
    """Everything the benchmark reads: the profile's machine, and the sweeps' settings, each field a
    params key of the same name."""

    hardware: Hardware = field(default_factory=Hardware)  # peaks, price and memory the points are judged by
    dtype: str = _default("dtype")  # on a GPU; a CPU runs fp32 (counting.run_dtype)
    prompt_len: int = _default("prompt_len")  # the longest generation prompt, tokens
    seq_len: int = _default("seq_len")  # rows of a preset training model, tokens
    bench_generate_model: str = _default("bench_generate_model")
    bench_train_model: str = _default("bench_train_model")
    bench_batch_sizes: str = _default("bench_batch_sizes")  # comma-separated; 'auto': the planner's largest
    bench_strategies: str = _default("bench_strategies")
    bench_examples: int = _default("bench_examples")
    bench_max_new_tokens: int = _default("bench_max_new_tokens")
    bench_repeats: int = _default("bench_repeats")
    bench_train_micro_batches: str = _default("bench_train_micro_batches")
    bench_train_steps: int = _default("bench_train_steps")  # 0: no training sweep
    bench_train_settings: str = _default("bench_train_settings")
    bench_train_baselines: str = _default("bench_train_baselines")
    # The training points train as the profile's training job would, in these of its settings.
    lora_rank: int = _default("lora_rank")
    lora_targets: str = _default("lora_targets")
    attn_implementation: str = _default("attn_implementation")  # the generation plans' attention too
    optimizer: str = _default("optimizer")
    dataloader_workers: int = _default("dataloader_workers")
    pin_memory: bool = _default("pin_memory")
    prefetch_factor: int = _default("prefetch_factor")
    learning_rate: float = _default("learning_rate")

    @classmethod
    def from_params(cls, params) -> "BenchSettings":
        """The settings of a validated params profile (or notebook 04's parameters); the keys the
        benchmark reads and ``params`` lacks are named, with where to declare them."""
        absent = [key for key in field_keys() if key not in params]
        if absent:
            raise ParamsError(f"workbook bench needs the parameter(s) {', '.join(absent)}; a notebook that runs it "
                              f"must declare them in its parameters cell (see {NOTEBOOK}), or add them to the "
                              "params file")
        return cls(hardware=Hardware.from_params(params), **{key: params[key] for key in _own_keys()})

    def replace(self, **changes) -> "BenchSettings":
        """A copy with ``changes`` (params keys, the hardware's included)."""
        machine = {key: changes.pop(key) for key in list(changes) if key in _hardware_keys()}
        return dataclasses.replace(self, hardware=dataclasses.replace(self.hardware, **machine), **changes)

    def as_params(self) -> dict[str, Any]:
        """Every key the benchmark read, with its value: the record a report keeps of what it ran with."""
        return {**dataclasses.asdict(self.hardware), **{key: getattr(self, key) for key in _own_keys()}}


def _hardware_keys() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Hardware))


def _own_keys() -> tuple[str, ...]:
    return tuple(f.name for f in fields(BenchSettings) if f.name in SCHEMA)


def field_keys() -> tuple[str, ...]:
    """The params keys the benchmark reads: the hardware's, then its own (``job_keys.BENCH``)."""
    return _hardware_keys() + _own_keys()
