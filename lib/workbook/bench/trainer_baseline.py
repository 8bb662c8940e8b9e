"""The Hugging Face Trainer beside the workbook's loop (``bench_train_baselines: hf-trainer``): one
training point run by ``transformers.Trainer`` with everything the comparison does not measure held
the same, timed as the workbook times itself, and the ratio of the workbook's figures to it.

Held the same, from the point's own ``TrainConfig``:
- the model: ``training.loop.load_training_model`` (the same weights or seeded random init, the same
  attention path for packed rows, checkpointing switched on the same way when the point has it);
- the data: the workbook's prepared examples, packed rows and collator, the loop's micro-batch for
  each step in the loop's order, served by a DataLoader the Trainer does not resample
  (``get_train_dataloader`` overridden). ``labels`` are the collator's next-token targets moved one
  position right, so the model's own loss (the Trainer's path) scores the same targets;
- the DataLoader settings: the point's workers, prefetch and pinned memory (the profile's);
- the optimizer: AdamW (bitsandbytes' 8-bit AdamW where the point has ``adamw-8bit``) with the run's
  learning rate, ``ADAM_BETAS``, weight decay and ``MAX_GRAD_NORM``; cosine decay to
  ``MIN_LR_FRACTION`` of the peak with no warm-up, as the sweep's points (``cosine_with_min_lr``);
  bf16/fp16 autocast over fp32 weights on a GPU, fp32 on CPU;
- the clock: synchronized timestamps at each step's end (a TrainerCallback), the first
  TIMING_WARMUP_STEPS steps left out, counted by ``training.report.throughput`` like the loop's steps.

What still differs is written out in ``differences`` and travels with every result.
"""

from __future__ import annotations

import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers import __version__ as TRANSFORMERS_VERSION

from workbook import models, runtime
from workbook.training import batches
from workbook.training.config import ADAM_BETAS, MAX_GRAD_NORM, TIMING_WARMUP_STEPS, TrainConfig, TrainError
from workbook.training.examples import IGNORE_INDEX
from workbook.training.loop import data_loader, load_training_model, loader_settings, reset_accelerate_state
from workbook.training.prepare import prepare_data
from workbook.training.report import throughput
from workbook.training.run_plan import MIN_LR_FRACTION, model_flops_coefficients, plan_run

LABEL = f"HF Trainer (transformers {TRANSFORMERS_VERSION})"
SETTINGS = "the same batches and settings"  # how alike its run and the workbook's are
COUNTS = ("tokens", "length_squares")  # the collator's counts: recorded per step, never given to the model


def trainer_run(config: TrainConfig, work_dir: str) -> dict:
    """Train ``config``'s point with ``transformers.Trainer`` on this machine's default device and
    measure it: tokens/s and MFU (steady state), peak memory, and per step the tokens, loss tokens
    and loss the Trainer's forward saw. ``work_dir``: the Trainer's output_dir (it saves nothing)."""
    device, _, prepared, run, model, model_description, lora = point_setup(config, "HF Trainer")
    loader = data_loader(prepared, _StepBatches(config, prepared, run),
                         _LabelsCollator(batches.Collator(config.padding, prepared.max_seq_length, prepared.pad_token_id)),
                         config, device)
    arguments = TrainingArguments(**argument_values(config, run, work_dir, device))
    clock = StepClock(device)
    seen: list[dict] = []
    trainer = _RecordingTrainer(loader, seen, model=model, args=arguments, callbacks=[clock])
    measured = measured_training(trainer, seen, clock, config, model_flops_coefficients(model.config, lora), device)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    return {"loop": LABEL, **measured, "model": model_description,
            "how": how(config, run.learning_rate, arguments, optimizer), "differences": differences()}


def point_setup(config: TrainConfig, tool: str) -> tuple:
    """What a baseline trains ``config``'s point from, as the workbook's loop has it: (device, tokenizer,
    prepared data, run plan, model, its description, its LoRA rank); refuses settings no baseline mirrors."""
    unlike = _unsupported(config)
    if unlike:
        raise TrainError(f"the {tool} baseline mirrors the sweep's plain points; this config has {', '.join(unlike)}")
    device = runtime.default_device()
    tokenizer = models.load_tokenizer(config.model)
    prepared = prepare_data(config, tokenizer, log=lambda line: None)
    run = plan_run(config, prepared, processes=1)
    torch.manual_seed(config.seed)  # as the loop does before loading: the same random init for a preset
    model, model_description, lora = load_training_model(config, device, prepared.max_seq_length)
    return device, tokenizer, prepared, run, model, model_description, lora


def measured_training(trainer, seen: list[dict], clock: "StepClock", config: TrainConfig, flops_coefficients,
                      device: torch.device) -> dict:
    """Run ``trainer`` (a Trainer whose compute_loss appends each step's tokens, length squares, loss
    tokens and loss to ``seen``) and measure it as the workbook's loop measures itself: tokens/s and
    MFU over the steps after the warm-up, peak memory, per-step figures, the hardware."""
    runtime.reset_peak_memory(device)
    try:
        trainer.train()
        peak = runtime.peak_memory(device)
    finally:
        reset_accelerate_state()  # the Trainer's Accelerator is process-wide state: the next point starts clean
    per_token_flops, per_square_flops = flops_coefficients
    steps = []
    for record, seconds in zip(seen, clock.step_seconds()):
        tokens, squares = int(record["tokens"]), int(record["length_squares"])
        steps.append({"tokens": tokens, "loss_tokens": int(record["loss_tokens"]), "loss": float(record["loss"]),
                      "seconds": seconds, "flops": per_token_flops * tokens + per_square_flops * squares})
    measured = throughput(steps, config, processes=1, on_gpu=device.type == "cuda")
    return {
        "steps": len(steps), "timed_steps": max(0, len(steps) - TIMING_WARMUP_STEPS),
        "tokens_per_second": measured["tokens_per_second"], "achieved_tflops": measured["achieved_tflops"],
        "mfu": measured["mfu"], "mfu_note": measured["mfu_note"],
        "peak_memory_bytes": peak.total_bytes if peak else None,
        "peak_memory_note": None if peak else runtime.NOT_MEASURED_ON_CPU,
        "final_loss": steps[-1]["loss"] if steps else None,
        "step_tokens": [s["tokens"] for s in steps], "step_loss_tokens": [s["loss_tokens"] for s in steps],
        "step_losses": [s["loss"] for s in steps], "hardware": runtime.device_description(device),
    }


def versus(trainer: dict, workbook: dict | None, settings: str = SETTINGS) -> dict:
    """The workbook's point over a baseline's (the Trainer's, or TRL's): tokens/s ratio (above 1: the
    workbook is faster), peak memory ratio (below 1: it needs less; None where not measured, CPU) and
    the final losses; ``settings`` says how alike the two runs are."""
    if not workbook or workbook.get("skipped") or not trainer.get("tokens_per_second"):
        return {"tokens_per_second_ratio": None, "peak_memory_ratio": None,
                "note": "no workbook point with the same settings was measured in this run"}
    memory = (workbook["peak_memory_bytes"] / trainer["peak_memory_bytes"]
              if workbook.get("peak_memory_bytes") and trainer.get("peak_memory_bytes") else None)
    return {"tokens_per_second_ratio": workbook["tokens_per_second"] / trainer["tokens_per_second"],
            "peak_memory_ratio": memory,
            "workbook_tokens_per_second": workbook["tokens_per_second"],
            "workbook_peak_memory_bytes": workbook.get("peak_memory_bytes"),
            "workbook_final_loss": workbook.get("final_loss"), "trainer_final_loss": trainer.get("final_loss"),
            "settings": settings,
            "note": f"workbook / {trainer['loop']} on {settings}" + ("" if memory else
                                                                  f"; peak memory {runtime.NOT_MEASURED_ON_CPU}")}


def how(config: TrainConfig, learning_rate: float, arguments: TrainingArguments, optimizer) -> str:
    """One line a reader can check the comparison against."""
    precision = f"{config.dtype} autocast over fp32 weights" if arguments.bf16 or arguments.fp16 else "fp32"
    kernel = " fused" if optimizer.defaults.get("fused") else ""
    return (f"transformers.Trainer.train(), {config.max_steps} steps of the workbook's micro-batches of "
            f"{config.micro_batch_size} {config.padding} rows; {precision}; "
            f"{type(optimizer).__module__.split('.')[0]} {type(optimizer).__name__}{kernel} "
            f"(optim {getattr(arguments.optim, 'value', arguments.optim)}), "
            f"lr {learning_rate:g} cosine to {MIN_LR_FRACTION:g}x, betas {ADAM_BETAS}, weight decay "
            f"{config.weight_decay:g}, clip {MAX_GRAD_NORM:g}; checkpointing {config.grad_checkpointing}, "
            f"torch.compile {config.torch_compile}; tokens/s over the steps after the first {TIMING_WARMUP_STEPS}, "
            "from synchronized timestamps at each step's end")


def differences() -> list[str]:
    return [
        "loss: the model's own (transformers' ForCausalLMLoss: logits upcast to fp32, summed over the step's "
        "loss tokens, divided by their count, which the Trainer counts first); the workbook computes the same "
        "mean itself",
        "optimizer: the Trainer's default AdamW implementation (TrainingArguments.optim); the workbook's is "
        "torch AdamW, fused on CUDA, torch's default kernel on CPU; weight decay exempts norms and biases by name "
        "in the Trainer, every 1-D tensor in the workbook (the same tensors on Llama-style models)",
        "data: the same micro-batches, but through accelerate's prepared DataLoader (the Trainer's path), which "
        "moves each batch to the device one ahead; the workbook's loop moves each batch itself",
        "per step the Trainer also estimates FLOPs (floating_point_ops), accumulates the loss on the device and "
        "runs its callbacks; its logging and progress bar are off here, and nothing is evaluated or saved",
    ]


def _unsupported(config: TrainConfig) -> list[str]:
    """Settings the baseline does not mirror (the sweep asks it for plain points only)."""
    checks = {"gradient accumulation": config.gradient_accumulation_steps != 1,
              "several processes": config.processes != 1,
              "learning-rate warm-up (the Trainer's ramp is one step behind the loop's)": config.warmup_steps != 0,
              f"precision {config.precision}": config.precision != "mixed",
              "a chunked loss": config.loss_chunk_tokens > 0, "activation offloading": config.offload_activations,
              f"attention {config.attn_implementation}": config.attn_implementation != "sdpa"}
    return [name for name, applies in checks.items() if applies]


class _StepBatches(torch.utils.data.Sampler):
    """The loop's micro-batch for each step, in order (one process, no accumulation): step s is
    micro-batch s mod steps_per_epoch of epoch s div steps_per_epoch, each epoch shuffled from the seed."""

    def __init__(self, config: TrainConfig, prepared, run):
        lengths = [example.length for example in prepared.train]
        rows = batches.plan_rows(lengths, config.padding, prepared.max_seq_length)
        epochs = {}
        self.batches = []
        for step in range(run.total_steps):
            epoch, index = divmod(step, run.steps_per_epoch)
            if epoch not in epochs:
                epochs[epoch] = batches.epoch_micro_batches(rows, lengths, config.padding, seed=config.seed,
                                                            micro_batch_size=run.micro_batch_size, epoch=epoch)
            self.batches.append(epochs[epoch][index])

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class _LabelsCollator:
    """The workbook's collator, giving ``labels`` the model shifts back into its targets (the last
    position of a row is never a target: an example's last token or padding) and the counts."""

    def __init__(self, collator: batches.Collator):
        self.collator = collator

    def __call__(self, rows):
        batch = self.collator(rows)
        labels = torch.full_like(batch["targets"], IGNORE_INDEX)
        labels[:, 1:] = batch["targets"][:, :-1]
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "labels": labels,
                **{key: batch[key] for key in COUNTS}}


class _RecordingTrainer(Trainer):
    """The Trainer, fed ``loader`` as it is, recording what each step's forward saw in ``seen``
    (device tensors, read once training is over: no extra synchronization per step)."""

    def __init__(self, loader, seen: list[dict], **kwargs):
        super().__init__(**kwargs)
        self.workbook_loader, self.seen = loader, seen

    def get_train_dataloader(self):
        return self.accelerator.prepare(self.workbook_loader)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        counts = {key: inputs.pop(key) for key in COUNTS}
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.seen.append({**counts, "loss_tokens": inputs["labels"][..., 1:].ne(IGNORE_INDEX).sum(),
                          "loss": (loss[0] if return_outputs else loss).detach()})
        return loss


class StepClock(TrainerCallback):
    """Synchronized timestamps at the start of training and at each optimizer step's end."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def on_train_begin(self, args, state, control, **kwargs):
        runtime.synchronize(self.device)
        self.times.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        runtime.synchronize(self.device)
        self.times.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        return [end - start for start, end in zip(self.times, self.times[1:])]


def argument_values(config: TrainConfig, run, work_dir: str, device: torch.device) -> dict:
    """TrainingArguments' values for ``config``'s run (TRL's SFTConfig takes the same ones)."""
    on_gpu = device.type == "cuda"
    return dict(
        output_dir=work_dir, max_steps=run.total_steps, per_device_train_batch_size=run.micro_batch_size,
        gradient_accumulation_steps=1, learning_rate=run.learning_rate, weight_decay=config.weight_decay,
        adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": MIN_LR_FRACTION},
        warmup_steps=config.warmup_steps, seed=config.seed,
        bf16=on_gpu and config.dtype == "bf16", fp16=on_gpu and config.dtype == "fp16",
        tf32=config.tf32 if on_gpu else None, torch_compile=config.torch_compile,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        # The loop's DataLoader settings, for TRL, which builds its own loader from them.
        **{f"dataloader_{name}": value for name, value in loader_settings(config, device).items()},
        **({"optim": "adamw_bnb_8bit"} if config.optimizer == "adamw-8bit" else {}))
