"""A training run's settings: the validated params become one typed ``TrainConfig``, once.

Every later step (data, run plan, memory plan, the loop, the report) reads the config, never the
params again; the planner is asked with the config's own fields and its ``Budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workbook import arithmetic, job_keys
from workbook.generation.files import OutputFiles, resolve_input_path, resolve_output_path
from workbook.params import AUTO, SCHEMA
from workbook.planner.profile import Budget

PARAMS_USED = job_keys.TRAIN
TRAINING_DIR_NAME = "training"  # train_output_dir '' -> <run folder>/training/
RESULT_FILE = "training_result.json"
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
PRECISIONS = ("mixed", "bf16")  # autocast over fp32 master weights | pure bf16 weights, gradients and AdamW states
SEED = 0  # data order, validation split and LoRA initialisation
TIMING_WARMUP_STEPS = 2  # steps left out of the steady-state tokens/s
MAX_GRAD_NORM = 1.0  # gradient clipping, the HF Trainer's default
ADAM_BETAS = (0.9, 0.999)  # torch's defaults; the sqrt rule's fuller form changes them (run_plan.scaled_learning_rate)


class TrainError(ValueError):
    """Training cannot run as configured; the message says what to change."""


class TrainingDiverged(TrainError):
    """The loss stopped being finite: the run stops at that step (a benchmark records the point so)."""


@dataclass
class TrainConfig:
    """Everything one training run needs, plain values only (it is passed to every process)."""

    model: str  # 'tiny', a local HF directory, or a preset name (random weights, synthetic data: benchmarks)
    data_path: str  # JSONL file; '' = the arithmetic sample records built in memory
    data_description: str  # where the data came from, for the report
    output_dir: str  # checkpoints/, final/ and the result JSON
    on_bad_line: str = "fail"  # a line that is not a JSON object: 'fail' stops at file:line, 'skip' leaves it out (listed)
    input_field: str = "input"
    output_field: str = "output"
    use_chat_template: bool = False
    max_seq_length: int | str = AUTO
    length_percentile: float = 100.0
    padding: str = "packing"
    validation_fraction: float = 0.1
    eval_prompts_path: str = ""  # held-out questions scored before and after ('' = the validation split)
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
    lora_targets: str = ""  # '' = every linear projection (planner.shape.choose_lora_targets)
    dtype: str = "fp32"
    tf32: bool = False
    grad_checkpointing: bool = False
    torch_compile: bool = False
    attn_implementation: str = "sdpa"
    dataloader_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    save_every_steps: int = 0
    loss_chunk_tokens: int = 0  # 0: full logits; N: the loss over chunks of N positions (chunked_loss)
    precision: str = "mixed"  # 16-bit dtypes: 'mixed' (autocast, fp32 master weights) or 'bf16' (pure bf16 training)
    offload_activations: bool = False  # saved activations to host memory in forward, back in backward (offload)
    report_to: str = "none"  # none | tensorboard | wandb: per-step metrics through accelerate's trackers (tracking)
    processes: int = 1
    peer_timeout_seconds: float = SCHEMA["peer_timeout_seconds"].default  # a process waits this long for the others at an exchange (process_group)
    profile: str = "cpu"
    peak_bf16_tflops: float = 0.0
    peak_fp16_tflops: float = 0.0
    usd_per_gpu_hour: float = 0.0
    budget: Budget = field(default_factory=Budget)  # the memory the planner plans against (default: this machine's RAM)
    seed: int = SEED
    stop_after_steps: int | None = None  # end this invocation early, as if interrupted (resume tests, spot machines)
    # Run only these steps of the plan (ascending), each with the rows the run gives it: the forecast's pilot.
    run_only_steps: tuple[int, ...] = ()
    # Run only these steps of the plan (ascending), each with the rows the run gives it: the forecast's pilot.
    run_only_steps: tuple[int, ...] = ()
    synthetic_examples: int = 512  # preset models only: random sequences of max_seq_length tokens


def accelerate_mixed_precision(config: TrainConfig) -> str:
    """accelerate's ``mixed_precision`` for the run: autocast for 16-bit dtypes under precision 'mixed',
    none for fp32 and for pure bf16 (the weights are bf16 themselves)."""
    if config.precision not in PRECISIONS:
        raise TrainError(f"precision {config.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if config.precision == "bf16":
        if config.dtype != "bf16":
            raise TrainError(f"precision: bf16 trains bf16 weights and needs dtype: bf16 (dtype is {config.dtype}); "
                             "set dtype: bf16, or precision: mixed")
        return "no"
    return MIXED_PRECISION[config.dtype]


def config_from_params(params, run_dir: str | Path) -> TrainConfig:
    """A TrainConfig from a validated params profile (or a notebook's parameters) and the run folder."""
    problem = job_keys.missing(params, "train")
    if problem:
        raise TrainError(problem)
    run_dir = Path(run_dir)
    data_path, description = resolve_data_path(params["train_data_path"], params["output_path"], run_dir,
                                               verified=bool(params["verifier"]))
    output_dir = Path(params["train_output_dir"]) if params["train_output_dir"] else run_dir / TRAINING_DIR_NAME
    return TrainConfig(
        model=params["model"], data_path=data_path, data_description=description, output_dir=str(output_dir),
        on_bad_line=params["on_bad_line"],
        input_field=params["input_field"], output_field=params["output_field"],
        use_chat_template=params["use_chat_template"], max_seq_length=params["max_seq_length"],
        length_percentile=params["length_percentile"], padding=params["padding"],
        validation_fraction=params["validation_fraction"],
        eval_prompts_path=resolve_eval_path(params["eval_prompts_path"]), micro_batch_size=params["micro_batch_size"],
        gradient_accumulation_steps=params["gradient_accumulation_steps"], learning_rate=params["learning_rate"],
        lr_scaling=params["lr_scaling"], base_batch=params["base_batch"], epochs=params["epochs"],
        max_steps=params["max_steps"], warmup_steps=params["warmup_steps"], weight_decay=params["weight_decay"],
        optimizer=params["optimizer"], lora_rank=params["lora_rank"], lora_targets=params["lora_targets"], dtype=params["dtype"], tf32=params["tf32"],
        grad_checkpointing=params["grad_checkpointing"], torch_compile=params["torch_compile"],
        attn_implementation=params["attn_implementation"], dataloader_workers=params["dataloader_workers"],
        pin_memory=params["pin_memory"], prefetch_factor=params["prefetch_factor"],
        save_every_steps=params["save_every_steps"], processes=params["train_processes"],
        peer_timeout_seconds=params["peer_timeout_seconds"],
        loss_chunk_tokens=params["loss_chunk_tokens"], report_to=params["report_to"],
        precision=params["precision"], offload_activations=params["offload_activations"],
        profile=params["profile"], peak_bf16_tflops=params["peak_bf16_tflops"],
        peak_fp16_tflops=params["peak_fp16_tflops"], usd_per_gpu_hour=params["usd_per_gpu_hour"],
        budget=Budget.from_params(params),
    )


def resolve_eval_path(eval_prompts_path: str) -> str:
    """The held-out questions' file, found as a prompts file is (working directory, then the
    repository root); '' stays '' (the validation split is scored)."""
    if not eval_prompts_path:
        return ""
    path = resolve_input_path(eval_prompts_path)
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise TrainError(f"eval_prompts_path {eval_prompts_path!r}: {what}. Point it at a JSONL file of "
                         "arithmetic questions, or set it to '' to score the validation split.")
    return str(path.resolve())  # absolute: launched processes may start elsewhere


def resolve_data_path(train_data_path: str, output_path: str, run_dir: Path,
                      verified: bool = False) -> tuple[str, str]:
    """(path, description). '' means notebook 02's teacher outputs (its ``output_path``, or
    generations.jsonl in this run folder) when they exist: the ones its verifier accepted when
    ``verified`` (rejection sampling), else all of them; without them the shipped arithmetic sample
    (built in memory if the file is absent)."""
    if train_data_path:
        path = Path(train_data_path).expanduser()
        if path.is_dir():
            raise TrainError(f"train_data_path {train_data_path!r}: a folder, not a file. Point it at a JSONL file of "
                             "input/output records.")
        if not path.is_file():
            raise TrainError(f"train_data_path {train_data_path!r}: no such file. Point it at a JSONL file of "
                             "input/output records, or leave it '' for notebook 02's outputs / the shipped sample.")
        return str(path), f"{path} (train_data_path)"
    teacher = resolve_output_path(output_path, run_dir)
    accepted = OutputFiles(teacher).accepted
    if verified and accepted.is_file():
        return str(accepted), f"{accepted} (notebook 02's teacher outputs its verifier accepted)"
    if teacher.is_file():
        return str(teacher), f"{teacher} (notebook 02's teacher outputs)"
    if arithmetic.SAMPLE_PROMPTS_PATH.is_file():
        return str(arithmetic.SAMPLE_PROMPTS_PATH), (f"{arithmetic.SAMPLE_PROMPTS_PATH} (the shipped sample: "
                                                     f"notebook 02 wrote no {teacher})")
    return "", "arithmetic.sample_records() (the shipped sample's records, built in memory)"
