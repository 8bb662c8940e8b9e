"""A training run's settings: the validated params become one typed ``TrainConfig``, once.

Every later step (data, run plan, memory plan, the loop, the report) reads the config, never the
params again; the planner is asked with the config's own fields and its ``Budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workbook import arithmetic, job_keys
from workbook.generation.files import OutputFiles, resolve_input_path, resolve_output_path
from workbook.job_settings import TrainFields, train_fields
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


# The TrainFields field held resolved (an absolute path), not copied from its key as given.
RESOLVED_FIELDS = ("eval_prompts_path",)


@dataclass
class TrainConfig(TrainFields):
    """Everything one training run needs, plain values only (it is passed to every process). The
    fields read from params keys (each starting at its key's schema default) are declared, torch-free,
    in ``workbook.job_settings.TrainFields``; these are the run's own."""

    data_path: str  # JSONL file; '' = the arithmetic sample records built in memory
    data_description: str  # where the data came from, for the report
    output_dir: str  # checkpoints/, final/ and the result JSON
    budget: Budget = field(default_factory=Budget)  # the memory the planner plans against (default: this machine's RAM)
    seed: int = SEED
    stop_after_steps: int | None = None  # end this invocation early, as if interrupted (resume tests, spot machines)
    # Run only these steps of the plan (ascending), each with the rows the run gives it: the forecast's pilot.
    run_only_steps: tuple[int, ...] = ()
    synthetic_examples: int = 512  # preset models only: random sequences of max_seq_length tokens


def params_fields() -> dict[str, str]:
    """TrainConfig field -> the params key it is filled from (those ``config_from_params`` copies as they are)."""
    return {name: key for name, key in train_fields().items() if name not in RESOLVED_FIELDS}


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
