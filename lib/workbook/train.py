"""Supervised fine-tuning (notebook 03, `workbook train`): one `train(config)` for one process or many.

    config = config_from_params(params, run_dir)        # every setting from a params profile
    prepared = prepare_data(config)                      # tokens, lengths, truncation, padding waste
    result = launch(config, prepared)                    # 1 process in-process, N via notebook_launcher

From the shell, the same function: `workbook train --params h200 [--set key=value ...]`, or one
process per GPU (several nodes: the launcher's usual node flags) with
`accelerate launch --multi_gpu --num_processes 8 -m workbook.train --params h100x8 --run-dir DIR`
(FSDP: `accelerate launch --config_file fsdp.yaml ...` instead of the first two flags) or
`torchrun --nproc_per_node 8 -m workbook.train --params h100x8 --run-dir DIR`.

Why a plain accelerate loop and not the Hugging Face Trainer: this notebook exists to measure what
each speed setting does, so the loop must own every number it reports and be short enough to read
(one optimizer step is ~40 lines in `train`). It normalises the loss over the response tokens of the
whole effective batch (every micro-batch of every process), so gradient accumulation and 1 vs N
processes give the same gradient (tests/test_train.py checks it); it counts non-padding tokens and
model FLOPs per example and times each step end to end. With the Trainer these would be callbacks
around a loop we do not see, configured by ~100 arguments that change between the transformers
releases we support (5.17 to 5.23). accelerate still does what is hard: DDP/FSDP wrapping from the
launcher's config, mixed precision, gradient scaling, `no_sync`, `save_state`/`load_state` (model,
optimizer, scaler, RNG) and `torch.compile`.

What is measured, and how:
- tokens/s: non-padding input tokens of all processes per second of training steps (data loading
  included, evaluation excluded), after the first TIMING_WARMUP_STEPS steps (compilation and
  allocator warm-up), as nanoGPT's bench.py does; the overall figure is reported beside it.
- MFU, torchtitan's convention: per example of n tokens, 6 x N x n + 12 x layers x heads x head_dim
  x n^2 FLOPs (the second term is attention; N counts every matmul weight: all parameters except
  the input embedding table, whose lookup costs nothing, but with the output projection even when
  tied to it, because its matmul runs), against the profile's dense peak x processes. LoRA: 4 x N
  (no weight gradients for the frozen base). Recomputation by gradient checkpointing is not model
  work and is not counted. On CPU, or without a peak for the dtype, MFU is "n/a", never invented.
- peak memory: torch.cuda's reserved peak plus the memory outside PyTorch's allocator (CUDA context,
  NCCL, workspaces) as in `finder`, beside the planner's prediction for the same settings. On CPU
  there is no resettable high-water mark: not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbook import arithmetic, memory, planning, sft_data
from workbook.params import AUTO

# Keys of a params profile this module reads; notebook 03 declares each of them.
PARAMS_USED = (
    "profile", "gpu_count", "gpu_memory_gib", "peak_bf16_tflops", "peak_fp16_tflops", "usd_per_gpu_hour",
    "model", "dtype", "micro_batch_size", "grad_checkpointing", "lora_rank", "safety_margin", "cuda_overhead_gib",
    "train_data_path", "input_field", "output_field", "use_chat_template", "max_seq_length", "length_percentile",
    "padding", "validation_fraction", "learning_rate", "lr_scaling", "base_batch", "gradient_accumulation_steps",
    "epochs", "max_steps", "warmup_steps", "weight_decay", "optimizer", "tf32", "torch_compile", "attn_implementation",
    "dataloader_workers", "pin_memory", "prefetch_factor", "save_every_steps", "train_output_dir", "train_processes",
    "output_path",  # where notebook 02 wrote its outputs: the default training data
)
TRAINING_DIR_NAME = "training"  # train_output_dir '' -> <run folder>/training/
RESULT_FILE = "training_result.json"
STATE_FILE = "workbook_state.json"  # written last into a checkpoint: its presence marks it complete
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
LR_SCALING_RULES = ("none", "linear", "sqrt")
SEED = 0  # data order, validation split and LoRA initialisation
MAX_GRAD_NORM = 1.0  # gradient clipping, the HF Trainer's default
MIN_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak learning rate
ADAM_BETAS = (0.9, 0.999)  # torch's defaults; the sqrt rule's fuller form changes them (see below)
EVAL_POINTS = 10  # validation loss is computed about this many times per run, plus before the first step
TIMING_WARMUP_STEPS = 2  # steps left out of the steady-state tokens/s
KEEP_CHECKPOINTS = 2  # older checkpoints are deleted: one holds weights and optimizer (16 B/param)
ACCURACY_MAX_RECORDS = 256  # validation prompts answered greedily for the arithmetic accuracy
GENERATION_BATCH = 64


class TrainError(ValueError):
    """Training cannot run as configured; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# Configuration.


@dataclass
class TrainConfig:
    """Everything one training run needs, plain values only (it is passed to every process)."""

    model: str  # 'tiny', a local HF directory, or a preset name (random weights, synthetic data: benchmarks)
    data_path: str  # JSONL file; '' = the arithmetic sample records built in memory
    data_description: str  # where the data came from, for the report
    output_dir: str  # checkpoints/, final/ and the result JSON
    input_field: str = "input"
    output_field: str = "output"
    use_chat_template: bool = False
    max_seq_length: int | str = AUTO
    length_percentile: float = 100.0
    padding: str = "packing"
    validation_fraction: float = 0.1
    micro_batch_size: int | str = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    lr_scaling: str = "none"
    base_batch: int = 0
    epochs: int = 1
    max_steps: int = 0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    lora_rank: int = 0
    dtype: str = "fp32"
    tf32: bool = False
    grad_checkpointing: bool = False
    torch_compile: bool = False
    attn_implementation: str = "sdpa"
    dataloader_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    save_every_steps: int = 0
    processes: int = 1
    profile: str = "cpu"
    peak_bf16_tflops: float = 0.0
    peak_fp16_tflops: float = 0.0
    usd_per_gpu_hour: float = 0.0
    plan_settings: dict = field(default_factory=dict)  # the profile's memory facts the planner reads
    seed: int = SEED
    stop_after_steps: int | None = None  # end this invocation early, as if interrupted (resume tests, spot machines)
    synthetic_examples: int = 512  # preset models only: random sequences of max_seq_length tokens


def config_from_params(params, run_dir: str | Path) -> TrainConfig:
    """A TrainConfig from a validated params profile (or a notebook's parameters) and the run folder."""
    missing = [key for key in PARAMS_USED if key not in params]
    if missing:
        raise TrainError(f"training needs the parameter(s) {', '.join(missing)}; declare them in the notebook's "
                         "parameters cell or add them to the params file")
    run_dir = Path(run_dir)
    data_path, description = resolve_data_path(params["train_data_path"], params["output_path"], run_dir)
    output_dir = Path(params["train_output_dir"]) if params["train_output_dir"] else run_dir / TRAINING_DIR_NAME
    plan_keys = ("gpu_count", "gpu_memory_gib", "cuda_overhead_gib", "safety_margin")
    return TrainConfig(
        model=params["model"], data_path=data_path, data_description=description, output_dir=str(output_dir),
        input_field=params["input_field"], output_field=params["output_field"],
        use_chat_template=params["use_chat_template"], max_seq_length=params["max_seq_length"],
        length_percentile=params["length_percentile"], padding=params["padding"],
        validation_fraction=params["validation_fraction"], micro_batch_size=params["micro_batch_size"],
        gradient_accumulation_steps=params["gradient_accumulation_steps"], learning_rate=params["learning_rate"],
        lr_scaling=params["lr_scaling"], base_batch=params["base_batch"], epochs=params["epochs"],
        max_steps=params["max_steps"], warmup_steps=params["warmup_steps"], weight_decay=params["weight_decay"],
        optimizer=params["optimizer"], lora_rank=params["lora_rank"], dtype=params["dtype"], tf32=params["tf32"],
        grad_checkpointing=params["grad_checkpointing"], torch_compile=params["torch_compile"],
        attn_implementation=params["attn_implementation"], dataloader_workers=params["dataloader_workers"],
        pin_memory=params["pin_memory"], prefetch_factor=params["prefetch_factor"],
        save_every_steps=params["save_every_steps"], processes=params["train_processes"],
        profile=params["profile"], peak_bf16_tflops=params["peak_bf16_tflops"],
        peak_fp16_tflops=params["peak_fp16_tflops"], usd_per_gpu_hour=params["usd_per_gpu_hour"],
        plan_settings={key: params[key] for key in plan_keys},
    )


def resolve_data_path(train_data_path: str, output_path: str, run_dir: Path) -> tuple[str, str]:
    """(path, description). '' means notebook 02's teacher outputs (its ``output_path``, or
    generations.jsonl in this run folder) when they exist, else the shipped arithmetic sample
    (built in memory if the file is absent)."""
    from workbook import generate
    if train_data_path:
        path = Path(train_data_path).expanduser()
        if not path.is_file():
            raise TrainError(f"train_data_path {train_data_path!r}: no such file. Point it at a JSONL file of "
                             "input/output records, or leave it '' for notebook 02's outputs / the shipped sample.")
        return str(path), f"{path} (train_data_path)"
    teacher = generate.resolve_output_path(output_path, run_dir)
    if teacher.is_file():
        return str(teacher), f"{teacher} (notebook 02's teacher outputs)"
    if arithmetic.SAMPLE_PROMPTS_PATH.is_file():
        return str(arithmetic.SAMPLE_PROMPTS_PATH), (f"{arithmetic.SAMPLE_PROMPTS_PATH} (the shipped sample: "
                                                     f"notebook 02 wrote no {teacher})")
    return "", "arithmetic.sample_records() (the shipped sample's records, built in memory)"


def is_preset_model(model: str) -> bool:
    """True for a preset architecture name (not 'tiny', not a directory): random weights, no tokenizer."""
    from workbook import presets, tiny_model
    if model == tiny_model.TINY_MODEL_NAME or Path(model).expanduser().is_dir():
        return False
    presets.load_config(model)  # raises with the list of presets for an unknown name
    return True


# ----------------------------------------------------------------------------------------------
# Learning rate.


def scaled_learning_rate(learning_rate: float, base_batch: int, effective_batch: int, rule: str) -> float:
    """The learning rate for ``effective_batch`` when ``learning_rate`` was tuned at ``base_batch``.

    Heuristics, not laws; they are applied only when the effective batch differs from the base
    (``base_batch`` 0 means "tuned at this run's batch": unchanged):
    - ``linear``: lr x (effective / base). Goyal et al. 2017 (SGD, ImageNet), with warmup; it holds
      up to a data-dependent critical batch size (McCandlish et al. 2018), not beyond.
    - ``sqrt``: lr x sqrt(effective / base), the rule usually quoted for Adam. Its fuller form
      (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"),
      for a batch multiplied by k: lr x sqrt(k), 1 - beta1 and 1 - beta2 multiplied by k, eps
      divided by sqrt(k). Only the learning rate is changed here; the betas stay at ADAM_BETAS.
    Seed 004's table (batch 512 -> 5e-4 from 3e-4 at 128) is neither rule: sqrt gives 6e-4.
    """
    if rule not in LR_SCALING_RULES:
        raise TrainError(f"lr_scaling {rule!r}: expected one of {', '.join(LR_SCALING_RULES)}")
    if rule == "none" or base_batch <= 0 or effective_batch == base_batch:
        return learning_rate
    ratio = effective_batch / base_batch
    return learning_rate * (ratio if rule == "linear" else math.sqrt(ratio))


def learning_rate_at(step: int, peak: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps`` to ``peak``, then cosine decay to MIN_LR_FRACTION x peak.
    ``step`` is the 0-based index of the optimizer step about to be taken."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ----------------------------------------------------------------------------------------------
# Data: from the configured file to tokenized training and validation examples.


@dataclass
class PreparedData:
    """The tokenized data set, split, truncated, with everything the report says about it."""

    train: list[sft_data.TokenizedExample]
    validation: list[sft_data.TokenizedExample]
    validation_records: list[dict]  # the validation records as read (for the accuracy check)
    max_seq_length: int
    max_seq_length_rule: str  # how it was chosen
    length_stats: dict  # of all examples, before truncation
    lengths: list[int]  # every example's token length before truncation (for the histogram)
    truncation: dict
    tokenize_report: dict
    source: str
    pad_token_id: int

    def summary(self) -> dict:
        return {
            "source": self.source,
            "examples": {"train": len(self.train), "validation": len(self.validation)},
            "token_lengths": self.length_stats,
            "max_seq_length": self.max_seq_length,
            "max_seq_length_rule": self.max_seq_length_rule,
            "truncation": self.truncation,
            "formatting": self.tokenize_report,
        }


def read_records(path: str) -> tuple[list[dict], list[str]]:
    """(records, "file:line" of each) from a JSON-lines file (workbook.data's reader: a bad line
    stops with its file and line); '' gives the arithmetic sample records."""
    from workbook import data
    if not path:
        records = arithmetic.sample_records()
        return records, [f"sample record {index + 1}" for index in range(len(records))]
    numbered, _ = data.read_jsonl(path, on_bad_line=data.FAIL)
    if not numbered:
        raise TrainError(f"{path}: no records; it must hold one JSON object per line")
    return [record for _, record in numbered], [f"{path}:{number}" for number, _ in numbered]


def load_tokenizer(config: TrainConfig):
    """The model's tokenizer (None for a preset: random weights have no tokenizer). Never touches a GPU."""
    if is_preset_model(config.model):
        return None
    from transformers import AutoTokenizer

    from workbook import tiny_model
    return AutoTokenizer.from_pretrained(tiny_model.resolve_model_path(config.model))


def prepare_data(config: TrainConfig, tokenizer=None) -> PreparedData:
    """Read, split, tokenize and truncate the data; choose max_seq_length. CPU only, deterministic."""
    if is_preset_model(config.model):
        return synthetic_data(config)
    tokenizer = tokenizer or load_tokenizer(config)
    records, sources = read_records(config.data_path)
    train_index, validation_index = sft_data.split_validation(len(records), config.validation_fraction, config.seed)
    examples, report = sft_data.tokenize_pairs(
        records, tokenizer, use_chat_template=config.use_chat_template, input_field=config.input_field,
        output_field=config.output_field, sources=sources)
    by_source = {example.source: example for example in examples}
    lengths = [example.length for example in examples]
    model_limit = getattr(tokenizer, "model_max_length", None)
    max_len, rule = _choose_max_seq_length(config, lengths, _model_max_positions(config, model_limit))
    train, truncation = sft_data.truncate([by_source[sources[i]] for i in train_index if sources[i] in by_source], max_len)
    validation, validation_truncation = sft_data.truncate(
        [by_source[sources[i]] for i in validation_index if sources[i] in by_source], max_len)
    if not train:
        raise TrainError(f"no training example left (of {len(records)} records, {len(validation_index)} held out for "
                         "validation, the rest skipped or dropped): add data or lower validation_fraction")
    truncation_summary = {
        "max_seq_length": max_len,
        "truncated": truncation.truncated + validation_truncation.truncated,
        "dropped_without_response": truncation.dropped + validation_truncation.dropped,
        "tokens_cut": truncation.tokens_cut + validation_truncation.tokens_cut,
    }
    return PreparedData(
        train=train, validation=validation,
        validation_records=[records[i] for i in validation_index if sources[i] in by_source],
        max_seq_length=max_len, max_seq_length_rule=rule, length_stats=sft_data.length_statistics(lengths),
        lengths=lengths, truncation=truncation_summary,
        tokenize_report={"chat_template": report.chat_template, "examples": report.examples,
                         "skipped": len(report.skipped), "skipped_first": report.skipped[:5],
                         "input_field": config.input_field, "output_field": config.output_field},
        source=config.data_description,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )


def _model_max_positions(config: TrainConfig, tokenizer_limit: int | None) -> int | None:
    from workbook import presets
    config_limit = getattr(presets.load_config(_model_source(config.model)), "max_position_embeddings", None)
    limits = [limit for limit in (config_limit, tokenizer_limit) if isinstance(limit, int) and 0 < limit < 10**9]
    return min(limits) if limits else None


def _model_source(model: str) -> str:
    from workbook import tiny_model
    return model if model == tiny_model.TINY_MODEL_NAME else str(Path(model).expanduser())


def _choose_max_seq_length(config: TrainConfig, lengths: list[int], model_limit: int | None) -> tuple[int, str]:
    if config.max_seq_length == AUTO:
        chosen = sft_data.auto_max_seq_length(lengths, config.length_percentile)
        rule = (f"auto: smallest multiple of {sft_data.SEQUENCE_LENGTH_MULTIPLE} covering the "
                f"{config.length_percentile:g}th percentile ({sft_data.length_percentile(lengths, config.length_percentile)} tokens)")
        if model_limit and chosen > model_limit:
            rule += f", capped at the model's {model_limit} positions"
            chosen = model_limit
        return chosen, rule
    chosen = int(config.max_seq_length)
    if model_limit and chosen > model_limit:
        raise TrainError(f"max_seq_length {chosen} exceeds the model's {model_limit} positions; "
                         f"set max_seq_length <= {model_limit} or 'auto'")
    return chosen, "set in params"


def synthetic_data(config: TrainConfig) -> PreparedData:
    """Random token sequences of exactly max_seq_length tokens, all carrying loss: for throughput
    benchmarks of preset architectures (random weights, no tokenizer). Nothing here is learnable."""
    if config.max_seq_length == AUTO:
        raise TrainError(f"model {config.model!r} is a preset (random weights, synthetic data): set max_seq_length "
                         "to the sequence length to benchmark, e.g. --set max_seq_length=2048")
    from workbook import presets
    vocab = presets.load_config(config.model).vocab_size
    length = int(config.max_seq_length)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(0, vocab, (config.synthetic_examples, length), generator=generator).tolist()
    examples = [sft_data.TokenizedExample(row, list(row), f"synthetic {index + 1}") for index, row in enumerate(ids)]
    held = max(1, round(len(examples) * config.validation_fraction)) if config.validation_fraction else 0
    lengths = [length] * len(examples)
    return PreparedData(
        train=examples[held:], validation=examples[:held], validation_records=[], max_seq_length=length,
        max_seq_length_rule="set in params (synthetic sequences of exactly this length)",
        length_stats=sft_data.length_statistics(lengths), lengths=lengths,
        truncation={"max_seq_length": length, "truncated": 0, "dropped_without_response": 0, "tokens_cut": 0},
        tokenize_report={"synthetic": True, "examples": len(examples)},
        source=f"{len(examples)} random sequences of {length} tokens (preset {config.model}: random weights)",
        pad_token_id=0,
    )


# ----------------------------------------------------------------------------------------------
# The run's plan: batch sizes, steps, learning rate, padding.


@dataclass
class RunPlan:
    processes: int
    micro_batch_size: int
    micro_batch_rule: str
    gradient_accumulation_steps: int
    effective_batch_rows: int  # rows (packed or single examples) per optimizer step, all processes
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    learning_rate: float  # after lr_scaling
    learning_rate_rule: str
    padding_fraction: float  # of the first epoch's batches actually used
    padding_comparison: dict  # the same data under each padding choice
    rows: int  # rows of the training set (packed rows, or examples)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_run(config: TrainConfig, prepared: PreparedData, processes: int | None = None) -> RunPlan:
    """Micro-batch ('auto': the planner's largest at max_seq_length), steps and learning rate.

    Pure arithmetic on the prepared data: every process computes the same plan.
    """
    processes = processes or config.processes
    lengths = [example.length for example in prepared.train]
    rows = sft_data.plan_rows(lengths, config.padding, prepared.max_seq_length)
    if config.micro_batch_size == AUTO:
        fits = planning.resolve_batch_size(_plan_settings(config), "train", seq_len=prepared.max_seq_length)
        # Never so large that an epoch has no optimizer step (the tiny model on an H200 fits ~10^5 rows).
        one_step = max(1, len(rows) // (config.gradient_accumulation_steps * processes))
        micro = min(fits, one_step)
        micro_rule = (f"auto: the memory planner's largest micro-batch at {prepared.max_seq_length} tokens ({fits})"
                      + (f", capped at {micro} so that an epoch ({len(rows)} rows) has an optimizer step"
                         if micro < fits else ""))
    else:
        micro, micro_rule = int(config.micro_batch_size), "set in params"
    first_epoch = sft_data.epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=micro,
                                               seed=config.seed, epoch=0)
    per_step = config.gradient_accumulation_steps * processes
    steps_per_epoch = len(first_epoch) // per_step
    if steps_per_epoch == 0:
        raise TrainError(
            f"the training split gives {len(first_epoch)} micro-batch(es) of {micro} rows, but one optimizer step "
            f"needs {per_step} (gradient_accumulation_steps {config.gradient_accumulation_steps} x {processes} "
            "process(es)): lower micro_batch_size or gradient_accumulation_steps, or add data")
    total = config.max_steps if config.max_steps > 0 else config.epochs * steps_per_epoch
    effective = micro * per_step
    learning_rate = scaled_learning_rate(config.learning_rate, config.base_batch, effective, config.lr_scaling)
    if learning_rate == config.learning_rate:
        lr_rule = "as set (no scaling: " + ("lr_scaling none" if config.lr_scaling == "none" or config.base_batch <= 0
                                           else f"effective batch equals base_batch {config.base_batch}") + ")"
    else:
        lr_rule = (f"{config.lr_scaling} scaling of {config.learning_rate:g} from base_batch {config.base_batch} "
                   f"to effective batch {effective} (a heuristic)")
    used = first_epoch[:steps_per_epoch * per_step]
    return RunPlan(
        processes=processes, micro_batch_size=micro, micro_batch_rule=micro_rule,
        gradient_accumulation_steps=config.gradient_accumulation_steps, effective_batch_rows=effective,
        micro_batches_per_epoch=len(first_epoch), steps_per_epoch=steps_per_epoch, total_steps=total,
        learning_rate=learning_rate, learning_rate_rule=lr_rule,
        padding_fraction=sft_data.padding_fraction(used, lengths, config.padding, prepared.max_seq_length),
        padding_comparison=sft_data.padding_comparison(lengths, prepared.max_seq_length, micro, config.seed),
        rows=len(rows),
    )


def _plan_settings(config: TrainConfig) -> dict:
    """What the memory planner reads: this run's settings over the profile's facts (a config built
    by hand, without a profile, plans against this machine's RAM like the cpu profile)."""
    profile = {"gpu_count": 0, "gpu_memory_gib": 0.0, "cuda_overhead_gib": 0.0, "safety_margin": 0.05,
               **config.plan_settings}
    return {**profile, "model": _model_source(config.model), "dtype": config.dtype,
            "micro_batch_size": config.micro_batch_size, "grad_checkpointing": config.grad_checkpointing,
            "lora_rank": config.lora_rank, "optimizer": config.optimizer}


# ----------------------------------------------------------------------------------------------
# FLOPs.


def model_flops_coefficients(model_config, lora: bool) -> tuple[int, int]:
    """(per-token coefficient, per-token-squared coefficient): an example of n tokens costs
    ``a x n + b x n^2`` FLOPs for forward and backward (torchtitan's convention, see the module docstring)."""
    from workbook import presets
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    meta = presets.build_on_meta_device(model_config)
    total = sum(parameter.numel() for parameter in meta.parameters())
    embedding = meta.get_input_embeddings().weight.numel()
    tied = meta.get_output_embeddings() is not None and \
        meta.get_output_embeddings().weight is meta.get_input_embeddings().weight
    matmul_parameters = total if tied else total - embedding
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = (4 if lora else 6) * matmul_parameters
    return per_token, 12 * text.num_hidden_layers * heads * head_dim


# ----------------------------------------------------------------------------------------------
# The training function every process runs.


def train(config: TrainConfig, prepared: PreparedData | None = None) -> dict:
    """Fine-tune as configured; every process of a run calls this. Returns the result (also written
    to ``<output_dir>/training_result.json`` by the main process).

    Resumes from the newest complete checkpoint in ``<output_dir>/checkpoints`` when one exists
    (its settings must match), saves one every ``save_every_steps``, and saves the final model with
    its tokenizer to ``<output_dir>/final`` (LoRA: the adapters).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    started = time.perf_counter()
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[config.dtype], cpu=not torch.cuda.is_available(),
                              dynamo_backend="inductor" if config.torch_compile else None)
    try:
        device = accelerator.device
        tf32_applied = _set_tf32(config.tf32, device)
        fsdp = accelerator.distributed_type == DistributedType.FSDP
        tokenizer = load_tokenizer(config)
        prepared = prepared or prepare_data(config, tokenizer)
        run = plan_run(config, prepared, accelerator.num_processes)
        output_dir = Path(config.output_dir)
        if accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)  # identical LoRA initialisation in every process
        model, model_description, lora = _load_model(config, device)
        total_parameters = sum(p.numel() for p in model.parameters())
        trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer, optimizer_description = _build_optimizer(model, config, run.learning_rate,
                                                            fused=device.type == "cuda" and not fsdp)
        model, optimizer = accelerator.prepare(model, optimizer)

        fingerprint = _fingerprint(config, prepared, run)
        start_step, history, eval_history, accuracy_before = 0, [], [], None
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is not None:
            state = json.loads((checkpoint / STATE_FILE).read_text())
            if state["fingerprint"] != fingerprint:
                differences = ", ".join(f"{key} {value} (now {fingerprint[key]})" for key, value in state["fingerprint"].items()
                                        if fingerprint.get(key) != value)
                raise TrainError(f"{checkpoint} was saved by a run with other settings or data: {differences}. "
                                 "Resume with the same settings, or set train_output_dir to a new folder")
            accelerator.load_state(str(checkpoint))
            start_step, history, eval_history = state["step"], state["history"], state["eval_history"]
            accuracy_before = state.get("accuracy_before")
            _print(accelerator, f"resuming from {checkpoint} at step {start_step} of {run.total_steps}")

        per_token_flops, per_square_flops = model_flops_coefficients(_unwrap(accelerator, model).config, lora)
        collator = sft_data.Collator(config.padding, prepared.max_seq_length, prepared.pad_token_id,
                                     flatten=config.padding == "packing" and config.attn_implementation == "flash_attention_2")
        train_lengths = [example.length for example in prepared.train]
        rows = sft_data.plan_rows(train_lengths, config.padding, prepared.max_seq_length)
        validation_batches = _validation_batches(prepared, config, run, collator, accelerator)
        accuracy_enabled = tokenizer is not None and not fsdp
        if start_step == 0:
            if accuracy_enabled:
                accuracy_before = _accuracy(accelerator, model, tokenizer, prepared, config)
            if validation_batches is not None:
                eval_history.append({"step": 0, "eval_loss": _evaluate(model, validation_batches, accelerator)})

        eval_every = max(1, math.ceil(run.total_steps / EVAL_POINTS))
        stop_at = run.total_steps if config.stop_after_steps is None else min(run.total_steps, config.stop_after_steps)
        progress = _progress_bar(accelerator, run.total_steps, start_step)
        world = accelerator.num_processes
        step = start_step
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model.train()
        step_started = time.perf_counter()
        while step < stop_at:
            epoch, step_in_epoch = divmod(step, run.steps_per_epoch)
            loader = _epoch_loader(config, prepared, rows, run, collator, epoch, step_in_epoch,
                                   accelerator.process_index, world, device)
            iterator = iter(loader)
            for _ in range(step_in_epoch, run.steps_per_epoch):
                micro_batches = [next(iterator) for _ in range(run.gradient_accumulation_steps)]
                local_targets = sum(float(batch["target_tokens"]) for batch in micro_batches)
                # Loss tokens of the whole effective batch; stays on the device (no synchronisation here).
                global_targets = accelerator.reduce(torch.tensor(local_targets, device=device, dtype=torch.float64),
                                                    "sum").clamp(min=1.0)
                loss_sum = torch.zeros((), device=device, dtype=torch.float64)
                for index, batch in enumerate(micro_batches):
                    last = index == len(micro_batches) - 1
                    with contextlib.nullcontext() if last else accelerator.no_sync(model):
                        batch_loss = _loss_sum(model, batch, device)
                        # The mean over every loss token of the effective batch: DDP averages gradients
                        # over processes, hence x world.
                        accelerator.backward(batch_loss * world / global_targets.to(batch_loss.dtype))
                    loss_sum += batch_loss.detach().double()
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                learning_rate = learning_rate_at(step, run.learning_rate, config.warmup_steps, run.total_steps)
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                host_counts = torch.tensor([sum(float(b["tokens"]) for b in micro_batches),
                                            sum(float(b["length_squares"]) for b in micro_batches)], dtype=torch.float64)
                counts = torch.cat([loss_sum.reshape(1), host_counts.to(device)])
                loss_total, tokens, squares = accelerator.reduce(counts, "sum").tolist()  # synchronizes: the step's end
                global_targets = global_targets.item()
                now = time.perf_counter()
                seconds, step_started = now - step_started, now
                step += 1
                record = {"step": step, "loss": loss_total / global_targets, "learning_rate": learning_rate,
                          "grad_norm": float(grad_norm) if grad_norm is not None else None,
                          "tokens": int(tokens), "loss_tokens": int(global_targets), "seconds": seconds,
                          "tokens_per_second": tokens / seconds if seconds > 0 else None,
                          "flops": per_token_flops * tokens + per_square_flops * squares}
                history.append(record)
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second'] or 0:,.0f}")
                if validation_batches is not None and (step % eval_every == 0 or step == run.total_steps):
                    eval_history.append({"step": step, "eval_loss": _evaluate(model, validation_batches, accelerator)})
                    step_started = time.perf_counter()  # evaluation is not training time
                if config.save_every_steps and step % config.save_every_steps == 0:
                    _save_checkpoint(accelerator, output_dir, step, fingerprint, history, eval_history, accuracy_before)
                    step_started = time.perf_counter()
                if step >= stop_at:
                    break
        progress.close()
        finished = step >= run.total_steps
        memory_measured = _measured_peak_memory(device, accelerator)
        accuracy_after = _accuracy(accelerator, model, tokenizer, prepared, config) if accuracy_enabled else None
        final_dir = None
        if finished and tokenizer is not None:
            final_dir = _save_final(accelerator, model, tokenizer, output_dir)
        wall_seconds = time.perf_counter() - started
        result = _result(config, prepared, run, accelerator, history, eval_history, start_step, step, finished,
                         model_description, total_parameters, trainable_parameters, optimizer_description,
                         tf32_applied, memory_measured, accuracy_before, accuracy_after, wall_seconds,
                         final_dir, fsdp)
        if accelerator.is_main_process:
            (output_dir / RESULT_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n")
        accelerator.wait_for_everyone()
        return result
    finally:
        accelerator.end_training()
        _reset_accelerate_state()


def _print(accelerator, text: str) -> None:
    if accelerator.is_main_process:
        print(text, flush=True)


def _unwrap(accelerator, model):
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def _set_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 for float32 matmuls and convolutions on CUDA; returns whether it applies. It changes only
    float32 matmuls: under bf16 autocast the matmuls already run in bf16 (seed 003's "8x" is not it)."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def _load_model(config: TrainConfig, device: torch.device):
    """(model on device, description, lora?) with checkpointing and LoRA applied as configured.

    Full fine-tuning keeps fp32 master weights (bf16/fp16 run under autocast: the planner's
    "mixed precision"); LoRA freezes the base in ``dtype`` and trains fp32 adapters (PEFT's default).
    """
    from transformers import AutoModelForCausalLM

    from workbook import finder, presets, tiny_model
    lora = config.lora_rank > 0
    weights_dtype = finder.TORCH_DTYPES[config.dtype] if lora else torch.float32
    if is_preset_model(config.model):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(presets.load_config(config.model), dtype=weights_dtype,
                                                     attn_implementation=config.attn_implementation)
        description = f"{config.model}: preset architecture, random {_dtype_name(weights_dtype)} weights built on {device}"
    else:
        path = tiny_model.resolve_model_path(config.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype,
                                                     attn_implementation=config.attn_implementation).to(device)
        description = f"{config.model}: weights from {path}, {_dtype_name(weights_dtype)}"
    model.config.use_cache = False  # training: a cache would also disable packed-sequence masks
    if config.grad_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        try:
            import peft
        except ImportError:
            raise TrainError("lora_rank > 0 needs peft (pinned in requirements.txt: pip install peft==0.21.2); "
                             "or set lora_rank: 0 for a full fine-tune") from None
        from workbook.memory import DEFAULT_LORA_TARGET_MODULES
        lora_config = peft.LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, lora_dropout=0.0,
                                      target_modules=list(DEFAULT_LORA_TARGET_MODULES), task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora_config)
        description += f", LoRA rank {config.lora_rank} (alpha {2 * config.lora_rank}) on {', '.join(DEFAULT_LORA_TARGET_MODULES)}"
    return model, description, lora


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _build_optimizer(model, config: TrainConfig, learning_rate: float, *, fused: bool):
    """AdamW (fused kernel on CUDA) or bitsandbytes' 8-bit AdamW; weight decay on matrices only
    (not on norms and biases, the usual practice)."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    if config.optimizer == "adamw-8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise TrainError("optimizer 'adamw-8bit' needs the optional package bitsandbytes (CUDA only); "
                             "install a pinned version, or set optimizer: adamw") from None
        return (bitsandbytes.optim.AdamW8bit(groups, lr=learning_rate, betas=ADAM_BETAS),
                "bitsandbytes AdamW8bit")
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=ADAM_BETAS, fused=fused or None)
    return optimizer, f"torch AdamW ({'fused' if fused else 'foreach'})"


def _loss_sum(model, batch: dict, device: torch.device) -> torch.Tensor:
    """Sum of the next-token cross-entropy over the batch's loss tokens, in float32."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    targets = batch["targets"].to(device, non_blocking=True)
    # No attention mask and no cache: position ids that restart mark packed examples (module docstring).
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             ignore_index=sft_data.IGNORE_INDEX, reduction="sum")


class _RankBatches(torch.utils.data.Sampler):
    """This process's micro-batches of one epoch from ``first_step`` on: step s takes global
    micro-batches s x A x W ... (s + 1) x A x W - 1, process r every W-th of them, so any split of
    the same effective batch over processes and accumulation sees the same examples per step."""

    def __init__(self, micro_batches, first_step, steps, accumulation, rank, world):
        self.batches = [micro_batches[s * accumulation * world + k * world + rank]
                        for s in range(first_step, steps) for k in range(accumulation)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _epoch_loader(config, prepared, rows, run, collator, epoch, first_step, rank, world, device):
    lengths = [example.length for example in prepared.train]
    micro_batches = sft_data.epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=run.micro_batch_size,
                                                 seed=config.seed, epoch=epoch)
    sampler = _RankBatches(micro_batches, first_step, run.steps_per_epoch, run.gradient_accumulation_steps, rank, world)
    workers = config.dataloader_workers
    return torch.utils.data.DataLoader(
        sft_data.SftDataset(prepared.train), batch_sampler=sampler, collate_fn=collator, num_workers=workers,
        pin_memory=config.pin_memory and device.type == "cuda",
        prefetch_factor=config.prefetch_factor if workers > 0 else None)


def _validation_batches(prepared, config, run, collator, accelerator):
    """This process's share of the validation micro-batches (collated once), every process the same
    count (DDP/FSDP forwards are collective): short shares are topped up with a loss-free copy."""
    if not prepared.validation:
        return None
    lengths = [example.length for example in prepared.validation]
    rows = sft_data.plan_rows(lengths, config.padding, prepared.max_seq_length)
    batches = sft_data.epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=run.micro_batch_size,
                                           seed=config.seed, epoch=0, shuffle=False)
    world, rank = accelerator.num_processes, accelerator.process_index
    share = [collator([[prepared.validation[i] for i in row] for row in batch]) for batch in batches[rank::world]]
    while len(share) < math.ceil(len(batches) / world):
        filler = dict(collator([[prepared.validation[i] for i in row] for row in batches[0]]))
        filler["targets"] = torch.full_like(filler["targets"], sft_data.IGNORE_INDEX)
        share.append(filler)
    return share


def _evaluate(model, batches, accelerator) -> float:
    """Mean next-token loss over every validation loss token of all processes."""
    model.eval()
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            totals[0] += _loss_sum(model, batch, accelerator.device).double()
            totals[1] += (batch["targets"] != sft_data.IGNORE_INDEX).sum()
    model.train()
    loss, count = accelerator.reduce(totals, "sum").tolist()
    return loss / max(count, 1.0)


def arithmetic_references(records: list[dict], input_field: str) -> list[str] | None:
    """The true answers when every record's input is a question of the arithmetic task (from the
    task itself, not from the record's output, which may be a teacher's mistake); else None."""
    answers = {problem.question: arithmetic.answer_text(problem.answer) for problem in arithmetic.all_problems()}
    questions = [record.get(input_field) for record in records]
    if not questions or any(question not in answers for question in questions):
        return None
    return [answers[question] for question in questions]


def _accuracy(accelerator, model, tokenizer, prepared, config) -> dict | None:
    """Greedy answers to (up to ACCURACY_MAX_RECORDS) validation prompts, scored against the task's
    true answers; computed by the main process while the others wait. None if not the arithmetic task."""
    records = prepared.validation_records[:ACCURACY_MAX_RECORDS]
    references = arithmetic_references(records, config.input_field)
    result = None
    if references is not None and accelerator.is_main_process:
        from workbook import tiny_model
        unwrapped = _unwrap(accelerator, model)
        was_training = unwrapped.training
        unwrapped.eval()
        prompts = [sft_data.prompt_ids(tokenizer, r[config.input_field], use_chat_template=config.use_chat_template)
                   for r in records]
        with accelerator.autocast():
            texts = greedy_completions(unwrapped, tokenizer, prompts, tiny_model.MAX_NEW_TOKENS)
        unwrapped.train(was_training)
        scored = [{"output": reference} for reference in references]
        result = {"accuracy": arithmetic.accuracy(scored, texts), "records": len(records),
                  "examples": [{"input": r[config.input_field], "answer": t, "reference": ref}
                               for r, t, ref in list(zip(records, texts, references))[:5]]}
    accelerator.wait_for_everyone()
    return result


def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    """Greedy continuation of each prompt (token ids, formatted as in training), special tokens removed."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(prompts), GENERATION_BATCH):
        chunk = prompts[start:start + GENERATION_BATCH]
        width = max(len(p) for p in chunk)
        # Left padding so every prompt ends where generation starts.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.no_grad():
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=pad, use_cache=True)
        texts += tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    return texts


def _progress_bar(accelerator, total: int, initial: int):
    from tqdm import tqdm
    # Plain text (not the notebook widget): it reads the same in a terminal, papermill's log and Lab.
    return tqdm(total=total, initial=initial, desc="training", unit="step", mininterval=1.0,
                disable=not accelerator.is_main_process, file=sys.stdout, dynamic_ncols=False)


def _measured_peak_memory(device, accelerator) -> dict:
    if device.type != "cuda":
        return {"peak_bytes": None, "note": "not measured: no GPU (CPU memory has no resettable high-water mark)"}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    non_pytorch = total - free - torch.cuda.memory_reserved(device)
    local = torch.tensor([torch.cuda.max_memory_reserved(device) + non_pytorch,
                          torch.cuda.max_memory_allocated(device)], device=device, dtype=torch.float64)
    peak, allocated = local.tolist()
    gathered = accelerator.reduce(local, "max").tolist()
    return {"peak_bytes": int(gathered[0]), "peak_allocated_bytes": int(gathered[1]),
            "rank0_peak_bytes": int(peak), "rank0_peak_allocated_bytes": int(allocated),
            "note": "max over processes of torch.cuda.max_memory_reserved + memory outside PyTorch's allocator"}


def _fingerprint(config: TrainConfig, prepared: PreparedData, run: RunPlan) -> dict:
    """What a checkpoint must agree on to be resumed: the data (hashed) and every setting that
    changes which examples a step sees or how far the schedule has gone. Not the process count: a
    step sees the same examples for any split of the effective batch over processes and
    accumulation, so a DDP run may resume on fewer or more GPUs with the same effective batch."""
    data = hashlib.sha256(json.dumps([e.input_ids for e in prepared.train]).encode()).hexdigest()[:16]
    return {"model": config.model, "data": data, "max_seq_length": prepared.max_seq_length, "padding": config.padding,
            "micro_batch_size": run.micro_batch_size, "effective_batch_rows": run.effective_batch_rows,
            "learning_rate": run.learning_rate, "total_steps": run.total_steps,
            "warmup_steps": config.warmup_steps, "lora_rank": config.lora_rank, "optimizer": config.optimizer,
            "dtype": config.dtype, "seed": config.seed}


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (one whose state file was written), or None."""
    folder = Path(output_dir) / "checkpoints"
    complete = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file()) if folder.is_dir() else []
    return complete[-1] if complete else None


def _save_checkpoint(accelerator, output_dir, step, fingerprint, history, eval_history, accuracy_before):
    """accelerate's state (model, optimizer, scaler, RNG) and ours; the state file goes last."""
    target = checkpoint_dir(output_dir, step)
    accelerator.save_state(str(target))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "fingerprint": fingerprint, "history": history, "eval_history": eval_history, "accuracy_before": accuracy_before}
        (target / STATE_FILE).write_text(json.dumps(state, default=str) + "\n")
        older = sorted(p for p in target.parent.glob("step-*") if p != target)
        for stale in older[:max(0, len(older) - (KEEP_CHECKPOINTS - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()


def _save_final(accelerator, model, tokenizer, output_dir: Path) -> str:
    """The trained model in Hugging Face format with its tokenizer (LoRA: adapters only)."""
    final = output_dir / "final"
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP: every process calls it
    if accelerator.is_main_process:
        _unwrap(accelerator, model).save_pretrained(final, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(final)
    accelerator.wait_for_everyone()
    return str(final)


def _result(config, prepared, run, accelerator, history, eval_history, start_step, step, finished,
            model_description, total_parameters, trainable_parameters, optimizer_description, tf32_applied,
            memory_measured, accuracy_before, accuracy_after, wall_seconds, final_dir, fsdp) -> dict:
    from workbook import gpu
    processes = accelerator.num_processes
    on_gpu = accelerator.device.type == "cuda"
    this_run = history[start_step:] if len(history) > start_step else []
    warm = this_run[TIMING_WARMUP_STEPS:] if len(this_run) > TIMING_WARMUP_STEPS else this_run
    seconds = sum(r["seconds"] for r in warm)
    tokens_per_second = sum(r["tokens"] for r in warm) / seconds if seconds else None
    all_seconds = sum(r["seconds"] for r in this_run)
    overall = sum(r["tokens"] for r in this_run) / all_seconds if all_seconds else None
    achieved_tflops = sum(r["flops"] for r in warm) / seconds / 1e12 if seconds else None
    peak = {"bf16": config.peak_bf16_tflops, "fp16": config.peak_fp16_tflops}.get(config.dtype, 0.0)
    if not on_gpu:
        mfu, mfu_note = None, "n/a: CPU run (no GPU peak to measure against)"
    elif not peak:
        mfu, mfu_note = None, f"n/a: profile {config.profile} has no dense {config.dtype} peak (fp32 runs have none)"
    else:
        mfu = achieved_tflops / (peak * processes) if achieved_tflops else None
        mfu_note = f"against {peak:g} dense {config.dtype} TFLOP/s x {processes} GPU(s) (profile {config.profile})"
    try:
        predicted = planning.plan(_plan_settings(config), mode="train", batch_size=run.micro_batch_size,
                                  seq_len=prepared.max_seq_length, sharding="fsdp" if fsdp else "none").total_bytes
    except ValueError as error:  # e.g. a model the planner does not support
        predicted = None
        memory_measured["prediction_error"] = str(error)
    gpus = processes if on_gpu else 0
    gpu_hours = wall_seconds * gpus / 3600
    # The same examples come back every epoch, so per-epoch means compare like with like; one step's
    # loss mostly says which examples it drew.
    epoch_losses = [[r["loss"] for r in history[e * run.steps_per_epoch:(e + 1) * run.steps_per_epoch]]
                    for e in range(math.ceil(len(history) / run.steps_per_epoch))]
    eval_before = next((e["eval_loss"] for e in eval_history if e["step"] == 0), None)
    return {
        "status": "finished" if finished else f"stopped at step {step} of {run.total_steps} (stop_after_steps)",
        "model": config.model, "model_description": model_description,
        "parameters": total_parameters, "trainable_parameters": trainable_parameters,
        "data": prepared.summary(),
        "plan": run.to_dict(),
        "settings": {
            "dtype": config.dtype, "mixed_precision": MIXED_PRECISION[config.dtype],
            "tf32": {"requested": config.tf32, "applied": tf32_applied},
            "grad_checkpointing": config.grad_checkpointing, "torch_compile": config.torch_compile,
            "attn_implementation": config.attn_implementation, "padding": config.padding,
            "dataloader_workers": config.dataloader_workers,
            "pin_memory": {"requested": config.pin_memory, "applied": config.pin_memory and on_gpu},
            "prefetch_factor": config.prefetch_factor if config.dataloader_workers else None,
            "micro_batch_size": run.micro_batch_size, "gradient_accumulation_steps": run.gradient_accumulation_steps,
            "processes": processes, "distributed_type": accelerator.distributed_type.value,
            "optimizer": optimizer_description, "weight_decay": config.weight_decay,
            "learning_rate": run.learning_rate, "learning_rate_rule": run.learning_rate_rule,
            "warmup_steps": config.warmup_steps, "lora_rank": config.lora_rank, "max_grad_norm": MAX_GRAD_NORM,
            "schedule": f"linear warmup, cosine to {MIN_LR_FRACTION:g} x peak", "seed": config.seed,
        },
        "steps": {"total": run.total_steps, "resumed_from": start_step, "reached": step},
        "loss": {"first_step": history[0]["loss"] if history else None,
                 "last_step": history[-1]["loss"] if history else None,
                 "epoch_means": [sum(losses) / len(losses) for losses in epoch_losses],
                 "eval_before": eval_before, "eval_after": eval_history[-1]["eval_loss"] if eval_history else None},
        "accuracy": {"before": accuracy_before, "after": accuracy_after,
                     "note": "greedy answers to validation prompts scored against the arithmetic task's true answers"
                     if accuracy_after else "n/a: the validation inputs are not the arithmetic task's questions"
                     + (" (or FSDP: generation skipped)" if fsdp else "")},
        "throughput": {
            "tokens_per_second": tokens_per_second, "tokens_per_second_overall": overall,
            "tokens_per_second_per_process": tokens_per_second / processes if tokens_per_second else None,
            "what": f"non-padding tokens of all processes per second of training steps, first {TIMING_WARMUP_STEPS} "
                    "step(s) of this invocation left out of the steady-state figure",
            "achieved_tflops": achieved_tflops, "mfu": mfu, "mfu_note": mfu_note,
            "flops_convention": "torchtitan: 6 x matmul params x n + 12 x layers x heads x head_dim x n^2 per example "
                                "of n tokens (LoRA: 4 x params); recomputation not counted",
        },
        "memory": {"measured": memory_measured, "predicted_peak_bytes": predicted,
                   "prediction": f"planner at micro-batch {run.micro_batch_size}, {prepared.max_seq_length} tokens"},
        "time": {"wall_seconds": wall_seconds, "training_seconds": all_seconds, "gpus": gpus,
                 "gpu_hours": gpu_hours, "usd_per_gpu_hour": config.usd_per_gpu_hour,
                 "cost_usd": gpu_hours * config.usd_per_gpu_hour},
        "history": history, "eval_history": eval_history,
        "output": {"output_dir": config.output_dir, "final_model_dir": final_dir,
                   "checkpoint": str(latest_checkpoint(config.output_dir) or "") or None},
        "versions": gpu.software_versions(),
    }


def _reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state, so a notebook can train again (another process count,
    another precision) without restarting its kernel."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# ----------------------------------------------------------------------------------------------
# Launching: one process in-process, several through accelerate's notebook_launcher.


def launch(config: TrainConfig, prepared: PreparedData | None = None) -> dict:
    """Run `train` in ``config.processes`` processes and return the main process's result.

    One process runs here. Several are forked by accelerate's ``notebook_launcher`` (DDP; gloo on
    CPU, NCCL on GPUs), so nothing in this process may have initialised CUDA before (the notebook
    never asks torch.cuda anything). Inside a launch (``accelerate launch``, ``torchrun``) this
    process is one of the launched ones and runs `train` directly.
    """
    if config.processes == 1 or inside_launcher():
        return train(config, prepared)
    from accelerate import notebook_launcher
    if torch.cuda.is_initialized():  # asks, without initialising it
        raise TrainError("CUDA is already initialised in this process, so it cannot fork one training process per "
                         "GPU: restart the kernel and run this notebook from the top, or launch from the shell with "
                         "`accelerate launch -m workbook.train --params ... --run-dir ...`")
    result_path = Path(config.output_dir) / RESULT_FILE
    result_path.unlink(missing_ok=True)
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    notebook_launcher(train, args=(config, prepared), num_processes=config.processes, use_port=port)
    if not result_path.is_file():
        raise TrainError(f"the {config.processes} training processes ended without writing {result_path}; "
                         "see their output above")
    return json.loads(result_path.read_text())


def inside_launcher() -> bool:
    """True in a process started by torchrun, accelerate launch or notebook_launcher (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def summary_lines(result: dict) -> list[str]:
    """A few lines a person reads after a run (CLI and notebook)."""
    throughput, loss, time_ = result["throughput"], result["loss"], result["time"]
    tokens = throughput["tokens_per_second"]
    lines = [f"{result['status']}: {result['steps']['reached']} of {result['steps']['total']} steps, "
             f"{result['model_description']}",
             "training loss by epoch (mean per response token): "
             + " -> ".join(f"{value:.4f}" for value in loss["epoch_means"]) if loss["epoch_means"] else "no step ran",
             f"tokens/s {tokens:,.0f} (non-padding, steady state); MFU "
             + (f"{throughput['mfu']:.1%}" if throughput["mfu"] is not None else throughput["mfu_note"])
             if tokens else "tokens/s: not measured",
             f"wall {time_['wall_seconds']:.1f} s, cost ${time_['cost_usd']:.2f}"]
    if loss["eval_before"] is not None:
        lines.append(f"validation loss {loss['eval_before']:.4f} -> {loss['eval_after']:.4f}")
    accuracy = result["accuracy"]
    if accuracy["after"]:
        lines.append(f"arithmetic accuracy on {accuracy['after']['records']} validation prompts: "
                     f"{accuracy['before']['accuracy']:.1%} before -> {accuracy['after']['accuracy']:.1%} after"
                     if accuracy["before"] else f"accuracy after: {accuracy['after']['accuracy']:.1%}")
    if result["output"]["final_model_dir"]:
        lines.append(f"final model: {result['output']['final_model_dir']}")
    return lines


def cli_main(params_arg: str, overrides: list[str]) -> int:
    """`workbook train --params FILE [--set key=value ...]`: train into a new run folder (or
    train_output_dir); train_processes > 1 forks that many processes here (one per GPU)."""
    from workbook import notebook, runner
    params = runner.resolve_params(params_arg, overrides, log=lambda line: print(line, file=sys.stderr))[0]
    run_dir = notebook.new_run_dir(params["profile"])
    return _run_and_report(params, run_dir, created=True)


def _run_and_report(params, run_dir: Path, created: bool = False) -> int:
    try:
        config = config_from_params(params, run_dir)
        prepared = prepare_data(config)
        print(f"data: {prepared.source}; {len(prepared.train)} train / {len(prepared.validation)} validation examples; "
              f"max_seq_length {prepared.max_seq_length} ({prepared.max_seq_length_rule}); "
              f"{prepared.truncation['truncated']} truncated", flush=True)
        result = launch(config, prepared)
    except (TrainError, sft_data.DataError, memory.DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # only if still empty: leave no folder behind for a run that never started
        return 2
    (Path(run_dir) / "training_metrics.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    for line in summary_lines(result):
        print(line)
    print(f"metrics: {Path(run_dir) / 'training_metrics.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m workbook.train`: the entry point for `accelerate launch` and `torchrun`, one
    process per GPU; every process gets the same --run-dir."""
    from workbook import runner
    parser = argparse.ArgumentParser(prog="python -m workbook.train", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="auto", help="'auto', a profile name or a params file")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override a parameter")
    parser.add_argument("--run-dir", help="run folder shared by all processes (required with several processes)")
    args = parser.parse_args(argv)
    params = runner.resolve_params(args.params, args.set, log=lambda line: print(line, file=sys.stderr))[0]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.run_dir:
        print("error: pass --run-dir DIR: every process of the launch must write to the same folder", file=sys.stderr)
        return 2
    if args.run_dir:
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        from workbook import notebook
        run_dir = notebook.new_run_dir(params["profile"])
    if not inside_launcher():
        return _run_and_report(params, run_dir, created=not args.run_dir)
    try:  # one of the launched processes: the launcher made them, train here
        result = train(config_from_params(params, run_dir))
    except (TrainError, sft_data.DataError, memory.DoesNotFitError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        (run_dir / "training_metrics.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        print("\n".join(summary_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
