"""Tensor-parallel generation: a model too big for one GPU sharded over T processes with
transformers' own tensor parallelism, and T x D layouts (D groups of T share the prompts).

    torchrun --nproc_per_node 4 -m workbook.generation --params h100x8 \\
        --set model=/models/teacher tensor_parallel_size=2 output_path=outputs/teacher.jsonl

Consecutive processes form a group (ranks 0..T-1 hold copy 0, T..2T-1 copy 1, ...), so a group's
GPUs are neighbours on one machine. Every rank of a group runs the same batches (each forward is a
collective over the group); only the group's first rank writes. Everything here is checked before
a model loads, so a wrong size fails in a second, not after the weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbook import models, presets, runtime
from workbook.generation.engine import GenerationError
from workbook.generation.settings import GenerationSettings
from workbook.params import AUTO
from workbook.planner import layout, profile


@dataclass(frozen=True)
class Layout:
    """T x D: processes per copy of the model, and copies sharing the prompts."""

    tensor_parallel_size: int
    data_parallel_size: int

    @property
    def processes(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


def resolve_layout(settings: GenerationSettings, processes: int, *, launched: bool) -> Layout:
    """The layout a job of ``processes`` processes runs, or GenerationError saying what to change:
    a T that does not divide the model's key/value heads (transformers would fail deep in a
    reshape), a process count that is not a multiple of T, or T > 1 in one process nobody launched
    (transformers would quietly load the whole model: never run T = 1 while the params say 2)."""
    size = settings.tensor_parallel_size
    if size == AUTO:  # the planner's choice for this many GPUs
        size = profile.plan(settings.profile_params, mode="generate", batch_size=1,
                            gpu_count=processes if settings.gpu_count else 0).tensor_parallel_size
    if size == 1:  # plain data parallel: nothing to check that the job does not check already
        return Layout(1, processes)
    if settings.backend == "continuous":
        raise GenerationError(profile.CONTINUOUS_NOT_SHARDED.format(size=size))
    try:
        layout.check_tensor_parallel_size(size, layout_model_heads(settings.model), model=settings.model)
        if size > 1 and not launched:
            raise GenerationError(
                f"tensor_parallel_size {size} needs {size} processes, one per GPU, and this is a single process: "
                f"run `torchrun --nproc_per_node {size} -m workbook.generation --params ... --set "
                f"tensor_parallel_size={size}` (or accelerate launch), or from notebook 02 set "
                f"data_parallel_processes to a multiple of {size}.")
        layout.check_tensor_parallel_size(size, None, processes)
    except ValueError as error:  # a LayoutError, or a model whose config cannot be read
        raise GenerationError(str(error)) from None
    return Layout(size, processes // size)


def layout_model_heads(model: str) -> int:
    """The key/value heads of ``model`` from its config alone (no weights read)."""
    config = presets.load_config(models.model_source(model))
    text = config.get_text_config(decoder=True)
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def launched_layout(settings: GenerationSettings) -> Layout:
    """This process's layout: the launcher's process count (1 when not launched)."""
    return resolve_layout(settings, runtime.launched_processes(), launched=runtime.inside_launcher())


def sharding_arguments(job_layout: Layout) -> dict | None:
    """The ``from_pretrained`` keywords that shard the model for the layout; None for T = 1 (each
    process loads the whole model, as data parallel always did).

    ``DistributedConfig(tp_plan="auto")`` applies the model's own plan (transformers 5.2x). The
    ``tp_plan=`` keyword of ``from_pretrained`` is deprecated (removed in 5.18 by its own warning), so it
    is used only where ``DistributedConfig`` has no ``tp_plan`` field, as older 5.x releases may lack
    it (the GPU image's 5.17 is not at hand here to check). With D > 1 groups, ``dp_replicate_size=D``
    makes the mesh (D, T) over all processes: its tp axis is innermost, so consecutive ranks share a
    copy; parameters are replicated across groups, and generation (no backward, no gradients) never
    communicates between them: the TP=2 x DP=2 test runs groups through different batch counts."""
    if job_layout.tensor_parallel_size == 1:
        return None
    from transformers.distributed import DistributedConfig
    fields = DistributedConfig.__dataclass_fields__
    if "tp_plan" not in fields and job_layout.data_parallel_size == 1:
        return {"tp_plan": "auto", "tp_size": job_layout.tensor_parallel_size}
    if "tp_plan" not in fields or (job_layout.data_parallel_size > 1 and "dp_replicate_size" not in fields):
        raise GenerationError("tensor x data parallel needs transformers' DistributedConfig(tp_plan=..., "
                              "dp_replicate_size=...) (transformers 5.2x): upgrade transformers, or run "
                              "tensor_parallel_size processes only (one copy).")
    options = dict(tp_size=job_layout.tensor_parallel_size, tp_plan="auto")
    if job_layout.data_parallel_size > 1:
        options["dp_replicate_size"] = job_layout.data_parallel_size
    return {"distributed_config": DistributedConfig(**options)}
