"""A training run's settings: the validated params become one typed ``TrainConfig``, once.

Every later step (data, run plan, memory plan, the loop, the report) reads the config, never the
params again; the planner is asked with the config's own fields and its ``Budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from workbook import arithmetic, job_keys
from workbook.generation.files import OutputFiles, resolve_input_path, resolve_output_path
from workbook.params import SCHEMA, default as _default
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


# TrainConfig fields filled from a params key of another name; the other fields that share a key's name
# are filled from that key, except these: resolved from their key (paths) or no params key at all.
PARAMS_KEY_OF = {"processes": "train_processes"}
NOT_FROM_PARAMS = ("data_path", "output_dir", "eval_prompts_path", "seed", "budget")


@dataclass
class TrainConfig:
    """Everything one training run needs, plain values only (it is passed to every process). A field
    named as a params key (or in ``PARAMS_KEY_OF``) takes that key's schema default."""

    model: str  # 'tiny', a local HF directory, or a preset name (random weights, synthetic data: benchmarks)
    data_path: str  # JSONL file; '' = the arithmetic sample records built in memory
    data_description: str  # where the data came from, for the report
    output_dir: str  # checkpoints/, final/ and the result JSON
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
    budget: Budget = field(default_factory=Budget)  # the memory the planner plans against (default: this machine's RAM)
    seed: int = SEED
    stop_after_steps: int | None = None  # end this invocation early, as if interrupted (resume tests, spot machines)
    # Run only these steps of the plan (ascending), each with the rows the run gives it: the forecast's pilot.
    run_only_steps: tuple[int, ...] = ()
    synthetic_examples: int = 512  # preset models only: random sequences of max_seq_length tokens


def params_fields() -> dict[str, str]:
    """TrainConfig field -> the params key it is filled from (those ``config_from_params`` copies as they are)."""
    return {f.name: PARAMS_KEY_OF.get(f.name, f.name) for f in fields(TrainConfig)
            if f.name not in NOT_FROM_PARAMS and PARAMS_KEY_OF.get(f.name, f.name) in SCHEMA}


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
        data_path=data_path, data_description=description, output_dir=str(output_dir),
        eval_prompts_path=resolve_eval_path(params["eval_prompts_path"]), budget=Budget.from_params(params),
        **{name: params[key] for name, key in params_fields().items()},
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
