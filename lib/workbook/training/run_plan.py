"""The run's plan before any process starts: micro-batch ('auto': the planner's largest), steps,
learning rate (with its scaling rule and schedule), padding, the memory plan and the FLOPs per example.

Pure arithmetic on the prepared data: every process computes the same plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import psutil

from workbook import models, presets
from workbook.params import AUTO
from workbook.planner import Plan
from workbook.planner.profile import check_ram, train_plan
from workbook.training import batches, packed_attention
from workbook.training.config import TrainConfig, TrainError
from workbook.training.prepare import PreparedData

HOST_SHARE = 0.9  # of the host memory available when planning, for pinned offloaded activations
PINNED_ROUNDING = 2  # torch's pinned-memory cache rounds each block up to a power of two: up to 2x

LR_SCALING_RULES = ("none", "linear", "sqrt")
MIN_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak learning rate


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


def warmup_note(warmup_steps: int, total_steps: int, peak: float) -> str:
    """'' unless the warm-up outlasts the run, whose learning rate then never reaches its peak."""
    if warmup_steps < total_steps:
        return ""
    return (f"warmup_steps {warmup_steps} is not below the run's {total_steps} optimizer steps: the learning rate "
            f"rises the whole run and ends at {learning_rate_at(total_steps - 1, peak, warmup_steps, total_steps):g}, "
            f"{total_steps / warmup_steps:.0%} of its peak")


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
    rows = batches.plan_rows(lengths, config.padding, prepared.max_seq_length)
    if config.micro_batch_size == AUTO:
        fits, fits_rule = largest_micro_batch(config, prepared.max_seq_length)
        # Never so large that the data runs out of optimizer steps (the tiny model on an H200 fits ~10^5
        # rows): each epoch at least one, and a run that epochs decide at least warmup_steps + 1 in all,
        # so its learning rate leaves the warm-up and reaches its peak.
        needed = 1 if config.max_steps > 0 else max(1, math.ceil((config.warmup_steps + 1) / config.epochs))
        micro = min(fits, max(1, len(rows) // (config.gradient_accumulation_steps * processes * needed)))
        reason = (f"an epoch ({len(rows)} rows) has an optimizer step" if needed == 1 else
                  f"the {config.epochs} epoch(s) of {len(rows)} rows give at least warmup_steps + 1 = "
                  f"{config.warmup_steps + 1} optimizer steps")
        micro_rule = f"auto: {fits_rule}" + (f", capped at {micro} so that {reason}" if micro < fits else "")
    else:
        micro, micro_rule = int(config.micro_batch_size), "set in params"
    micro_rule += _micro_batch_check(config, micro, prepared.max_seq_length, config.processes)  # this node's
    first_epoch = batches.epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=micro,
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
    short_run = warmup_note(config.warmup_steps, total, learning_rate)
    lr_rule += f"; {short_run}" if short_run else ""
    used = first_epoch[:steps_per_epoch * per_step]
    return RunPlan(
        processes=processes, micro_batch_size=micro, micro_batch_rule=micro_rule,
        gradient_accumulation_steps=config.gradient_accumulation_steps, effective_batch_rows=effective,
        micro_batches_per_epoch=len(first_epoch), steps_per_epoch=steps_per_epoch, total_steps=total,
        learning_rate=learning_rate, learning_rate_rule=lr_rule,
        padding_fraction=batches.padding_fraction(used, lengths, config.padding, prepared.max_seq_length),
        padding_comparison=batches.padding_comparison(lengths, prepared.max_seq_length, micro, config.seed),
        rows=len(rows),
    )


def _micro_batch_check(config: TrainConfig, micro: int, seq_len: int, processes: int) -> str:
    """'' when the plan holds the micro-batch in each process. Over this machine's RAM (the cpu profile):
    ``check_ram``'s DoesNotFitError. Over a GPU's budget: a note in the run's micro-batch rule, not a
    refusal (FSDP, which the launcher decides, holds less per GPU; a step that does not fit raises out of memory)."""
    plan = memory_plan(config, micro, seq_len)
    check_ram(plan, "micro_batch_size", f"{micro} at {seq_len} tokens", processes)
    return "" if plan.fits else f" (over the memory plan: {plan.advice()})"


def largest_micro_batch(config: TrainConfig, seq_len: int) -> tuple[int, str]:
    """The planner's largest micro-batch at ``seq_len`` (DoesNotFitError when not even 1 fits), and the
    rule that chose it. Offloaded activations must also fit the host: pinned memory at most
    ``HOST_SHARE`` of what is available now, counted at ``PINNED_ROUNDING`` times their bytes, since
    torch's pinned-memory cache rounds each block up to a power of two (an 8B-shaped planned batch
    on an H200 offloads more than the 128 GiB of RAM such a machine has)."""
    plan = memory_plan(config, 1, seq_len).require_fit()
    fits, rule = plan.max_batch_size, f"the memory planner's largest micro-batch at {seq_len} tokens ({plan.max_batch_size})"
    per_row = plan.settings.get("offloaded_activation_bytes") or 0
    if per_row:
        available = psutil.virtual_memory().available
        host_rows = max(1, int(HOST_SHARE * available / (PINNED_ROUNDING * per_row)))
        if host_rows < fits:
            fits, rule = host_rows, (f"{rule}, capped at {host_rows} by host memory: offloaded activations take "
                                     f"{per_row / 2**30:.2f} GiB a row in pinned memory (up to {PINNED_ROUNDING}x "
                                     f"that), of {available / 2**30:.0f} GiB available")
    return fits, rule


def memory_plan(config: TrainConfig, micro_batch_size: int, seq_len: int, sharding: str = "none") -> Plan:
    """The planner's peak for this run's settings on the config's budget: the same question for the
    'auto' micro-batch and for the prediction the report puts beside the measured peak. Settings the
    planner refuses (LoRA targets that match no layer, precision bf16 without dtype bf16) are a TrainError."""
    try:
        return train_plan(models.model_source(config.model), config.budget, micro_batch_size=micro_batch_size,
                          seq_len=seq_len, dtype=config.dtype, grad_checkpointing=config.grad_checkpointing,
                          lora_rank=config.lora_rank, optimizer=config.optimizer, sharding=sharding,
                          lora_targets=config.lora_targets,
                          attn_implementation=packed_attention.training_attention_for(config, seq_len),
                          loss_chunk_tokens=config.loss_chunk_tokens, precision=config.precision,
                          offload_activations=config.offload_activations)
    except ValueError as error:
        raise TrainError(str(error)) from None


def model_flops_coefficients(model_config, lora: bool) -> tuple[int, int]:
    """(per-token coefficient, per-token-squared coefficient): an example of n tokens costs
    ``a x n + b x n^2`` FLOPs for forward and backward (torchtitan's convention, see the module docstring)."""
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
