"""The settings each job reads from the params, declared once and free of torch: one dataclass per
job whose fields are params keys, each starting at the schema's default. The jobs' typed objects are
built on them (``generation.settings.GenerationSettings``, ``training.config.TrainConfig``), and
``job_keys`` lists their fields as the keys each job reads, so ``--help`` lists them without
importing the job. A key added here is read by the job and listed by ``--help`` at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from workbook.params import SCHEMA, default as _default

# The memory a plan fits (``planner.profile.Budget``, whose fields these are): both jobs size 'auto'
# batches and check the RAM with it.
BUDGET_KEYS = ("gpu_count", "gpu_memory_gib", "cuda_overhead_gib", "safety_margin")


@dataclass(frozen=True)
class GenerationFields:
    """What the generation job reads, each field a params key of the same name."""

    profile: str = _default("profile")
    model: str = _default("model")
    dtype: str = _default("dtype")
    interactive: bool = _default("interactive")  # the progress bar: a notebook widget, or text
    batch_size: int | str = _default("batch_size")  # sequences per batch, or 'auto' (the planner's)
    prompt_len: int = _default("prompt_len")  # the prompt length 'auto' plans for
    max_new_tokens: int = _default("max_new_tokens")
    gpu_count: int = _default("gpu_count")  # 0: the cpu profile (its processes share this machine's RAM)
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


# TrainFields fields filled from a params key of another name; every other field is its key's namesake.
PARAMS_KEY_OF = {"processes": "train_processes"}


@dataclass(kw_only=True)
class TrainFields:
    """What a training run reads from the params as it is given: each field a params key (or the one
    ``PARAMS_KEY_OF`` names), starting at that key's schema default. ``eval_prompts_path`` is kept
    resolved (absolute) by ``training.config.config_from_params``."""

    model: str  # 'tiny', a local HF directory, or a preset name (random weights, synthetic data: benchmarks)
    on_bad_line: str = _default("on_bad_line")  # not a JSON object: 'fail' stops at file:line, 'skip' leaves it out
    input_field: str = _default("input_field")
    output_field: str = _default("output_field")
    use_chat_template: bool = _default("use_chat_template")
    max_seq_length: int | str = _default("max_seq_length")
    length_percentile: float = _default("length_percentile")
    padding: str = _default("padding")
    validation_fraction: float = _default("validation_fraction")
    eval_prompts_path: str = _default("eval_prompts_path")  # held-out questions scored before and after ('' = the validation split)
    micro_batch_size: int | str = _default("micro_batch_size")
    gradient_accumulation_steps: int = _default("gradient_accumulation_steps")
    learning_rate: float = _default("learning_rate")
    lr_scaling: str = _default("lr_scaling")
    base_batch: int = _default("base_batch")
    epochs: int = _default("epochs")
    max_steps: int = _default("max_steps")
    warmup_steps: int = _default("warmup_steps")
    weight_decay: float = _default("weight_decay")
    optimizer: str = _default("optimizer")
    lora_rank: int = _default("lora_rank")
    lora_targets: str = _default("lora_targets")  # '' = every linear projection (planner.shape.choose_lora_targets)
    lora_save: str = _default("lora_save")  # merged | adapters: what <output_dir>/final holds after LoRA
    dtype: str = _default("dtype")
    tf32: bool = _default("tf32")
    grad_checkpointing: bool = _default("grad_checkpointing")
    torch_compile: bool = _default("torch_compile")
    attn_implementation: str = _default("attn_implementation")
    dataloader_workers: int = _default("dataloader_workers")
    pin_memory: bool = _default("pin_memory")
    prefetch_factor: int = _default("prefetch_factor")
    save_every_steps: int = _default("save_every_steps")
    loss_chunk_tokens: int = _default("loss_chunk_tokens")  # 0: full logits; N: the loss over chunks of N positions (chunked_loss)
    precision: str = _default("precision")  # 16-bit dtypes: 'mixed' (autocast, fp32 master weights) or 'bf16' (pure bf16)
    offload_activations: bool = _default("offload_activations")  # saved activations to host memory and back (offload)
    report_to: str = _default("report_to")  # none | tensorboard | wandb: per-step metrics through accelerate's trackers
    processes: int = _default("train_processes")
    peer_timeout_seconds: float = _default("peer_timeout_seconds")  # a process waits this long for the others (process_group)
    profile: str = _default("profile")
    peak_bf16_tflops: float = _default("peak_bf16_tflops")
    peak_fp16_tflops: float = _default("peak_fp16_tflops")
    usd_per_gpu_hour: float = _default("usd_per_gpu_hour")


# The keys training reads that are no TrainFields field: each becomes a resolved path of the run.
TRAIN_PATH_KEYS = (
    "train_data_path",  # the training data; '' = notebook 02's outputs, else the shipped sample
    "output_path",  # where notebook 02 wrote its outputs: the default training data
    "verifier",  # set: notebook 02 verified its outputs, and the accepted ones are the default training data
    "train_output_dir",  # checkpoints and the final model; '' = <run folder>/training
)


def generation_keys() -> tuple[str, ...]:
    """The params keys the generation job reads: its settings', then the memory budget its planner reads."""
    return tuple(dict.fromkeys([f.name for f in fields(GenerationFields)] + list(BUDGET_KEYS)))


def train_fields() -> dict[str, str]:
    """TrainFields field -> the params key it is filled from."""
    return {f.name: PARAMS_KEY_OF.get(f.name, f.name) for f in fields(TrainFields)
            if PARAMS_KEY_OF.get(f.name, f.name) in SCHEMA}


def train_keys() -> tuple[str, ...]:
    """The params keys a training run reads: its fields' keys, the memory budget, and the paths' keys."""
    return tuple(dict.fromkeys(list(train_fields().values()) + list(BUDGET_KEYS) + list(TRAIN_PATH_KEYS)))
