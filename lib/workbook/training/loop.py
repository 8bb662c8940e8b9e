"""The training function every process runs: one optimizer step is ~55 lines of ``train``.

Why a plain accelerate loop and not the Hugging Face Trainer: this workbook exists to measure what
each speed setting does, so the loop must own every number it reports and be short enough to read.
It normalises the loss over the response tokens of the whole effective batch (every micro-batch of
every process), so gradient accumulation and 1 vs N processes give the same gradient
(tests/test_train.py checks it); it counts non-padding tokens and model FLOPs per example and times
each step end to end. With the Trainer these would be callbacks around a loop we do not see,
configured by ~100 arguments that change between the transformers releases we support (5.17 to
5.23). accelerate still does what is hard: DDP/FSDP wrapping from the launcher's config, mixed
precision, gradient scaling, ``no_sync``, ``save_state``/``load_state`` (model, optimizer, scaler,
RNG) and ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from workbook import gpu, models, process_group, runtime
from workbook.planner.architectures import model_attention
from workbook.training import batches, checkpoints, evaluation, packed_attention, report, tracking
from workbook.training.config import (
    ADAM_BETAS, MAX_GRAD_NORM, RESULT_FILE, TrainConfig, TrainError, TrainingDiverged, accelerate_mixed_precision,
)
from workbook.training.offload import OffloadActivations, release_pinned_host_memory
from workbook.training.prepare import PreparedData, prepare_data
from workbook.training.run_plan import learning_rate_at, model_flops_coefficients, plan_run, warmup_note

EVAL_POINTS = 10  # validation loss is computed about this many times per run, plus before the first step


def train(config: TrainConfig, prepared: PreparedData | None = None) -> dict:
    """Fine-tune as configured; every process of a run calls this. Returns the result (also written
    to ``<output_dir>/training_result.json`` by the main process).

    Resumes from the newest complete checkpoint in ``<output_dir>/checkpoints`` when one exists
    (its settings must match), saves one every ``save_every_steps``, and saves the final model with
    its tokenizer to ``<output_dir>/final`` (LoRA: merged, or the adapters: ``lora_save``).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    started = time.perf_counter()
    _refuse_fsdp_on_cpu()
    accelerator = Accelerator(mixed_precision=accelerate_mixed_precision(config), cpu=not torch.cuda.is_available(),
                              dynamo_backend="inductor" if config.torch_compile else None,
                              kwargs_handlers=[InitProcessGroupKwargs(**process_group.init_options(
                                  config.peer_timeout_seconds))],
                              **tracking.accelerator_kwargs(config.report_to, config.output_dir))
    try:
        device = accelerator.device
        tf32_applied = _set_tf32(config.tf32, device)
        fsdp = accelerator.distributed_type == DistributedType.FSDP
        if fsdp and config.loss_chunk_tokens:
            # The chunked loss reads the output head's weight outside the model's forward, where
            # FSDP has resharded it.
            raise TrainError("loss_chunk_tokens > 0 does not run under FSDP yet; set loss_chunk_tokens: 0")
        tokenizer = models.load_tokenizer(config.model)
        prepared = prepared or prepare_data(config, tokenizer, log=lambda line: _print(accelerator, line))
        run = plan_run(config, prepared, accelerator.num_processes)
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)  # by every process: a node may have its own disk
        checkpoints.choose_where_to_save(accelerator, output_dir, fsdp=fsdp, saves_checkpoints=config.save_every_steps > 0)
        tracking.start(accelerator, config)
        torch.manual_seed(config.seed)  # identical LoRA initialisation in every process
        model, model_description, lora = load_training_model(config, device, prepared.max_seq_length)
        total_parameters = sum(p.numel() for p in model.parameters())
        trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer, optimizer_description = build_optimizer(model, config, run.learning_rate,
                                                            fused=device.type == "cuda" and not fsdp)
        model, optimizer = accelerator.prepare(model, optimizer)

        fingerprint = checkpoints.fingerprint(config, prepared, run)
        start_step, history, eval_history, accuracy_before = 0, [], [], None
        checkpoint = checkpoints.agreed_checkpoint(accelerator, output_dir)
        if checkpoint is not None:
            state = checkpoints.resumable_state(checkpoint, fingerprint)
            try:
                accelerator.load_state(str(checkpoint))
            except Exception as error:  # any truncated or missing file: name the checkpoint, keep it
                raise checkpoints.damaged(checkpoint, f"{type(error).__name__}: {str(error)[:300]}") from error
            start_step, history, eval_history = state["step"], state["history"], state["eval_history"]
            accuracy_before = state.get("accuracy_before")
            _print(accelerator, f"resuming from {checkpoint} at step {start_step} of {run.total_steps}")

        per_token_flops, per_square_flops = model_flops_coefficients(unwrap(accelerator, model).config, lora)
        collator = batches.Collator(config.padding, prepared.max_seq_length, prepared.pad_token_id,
                                    flatten=config.padding == "packing" and config.attn_implementation == "flash_attention_2")
        train_lengths = [example.length for example in prepared.train]
        rows = batches.plan_rows(train_lengths, config.padding, prepared.max_seq_length)
        validation_batches = evaluation.validation_batches(prepared, config, run, collator, accelerator)
        accuracy_enabled = tokenizer is not None and not fsdp
        if start_step == 0:
            if accuracy_enabled:
                accuracy_before = evaluation.accuracy(accelerator, unwrap(accelerator, model), tokenizer, prepared, config)
            if validation_batches is not None:
                eval_history.append({"step": 0, "eval_loss": evaluation.evaluate(model, validation_batches, accelerator, config.loss_chunk_tokens)})

        short_run = warmup_note(config.warmup_steps, run.total_steps, run.learning_rate)
        if short_run:
            _print(accelerator, f"note: {short_run}")
        eval_every = max(1, math.ceil(run.total_steps / EVAL_POINTS))
        stop_at = run.total_steps if config.stop_after_steps is None else min(run.total_steps, config.stop_after_steps)
        if config.run_only_steps:
            stop_at = min(stop_at, max(config.run_only_steps) + 1)
        progress = _progress_bar(accelerator, run.total_steps, start_step)
        world = accelerator.num_processes
        # On CPU the activations are in host memory already: nothing to offload.
        offloading = ((lambda: OffloadActivations(model)) if config.offload_activations and device.type == "cuda"
                      else contextlib.nullcontext)
        step = start_step
        runtime.reset_peak_memory(device)
        model.train()
        step_started = time.perf_counter()
        while step < stop_at:
            if config.run_only_steps:  # the forecast's pilot: the next of its steps, served as the run serves it
                step = min(s for s in config.run_only_steps if s >= step)
            epoch = step // run.steps_per_epoch
            epoch_end = min(stop_at, (epoch + 1) * run.steps_per_epoch)
            in_epoch = [s - epoch * run.steps_per_epoch for s in (
                [s for s in config.run_only_steps if step <= s < epoch_end] if config.run_only_steps else range(step, epoch_end))]
            loader = _epoch_loader(config, prepared, rows, run, collator, epoch, in_epoch,
                                   accelerator.process_index, world, device)
            iterator = iter(loader)
            for step_in_epoch in in_epoch:
                step = epoch * run.steps_per_epoch + step_in_epoch
                micro_batches = [next(iterator) for _ in range(run.gradient_accumulation_steps)]
                learning_rate = learning_rate_at(step, run.learning_rate, config.warmup_steps, run.total_steps)
                loss_sum, global_targets, grad_norm = optimizer_step(
                    accelerator, model, optimizer, micro_batches, learning_rate, config.loss_chunk_tokens, offloading)
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
                if not math.isfinite(record["loss"]):  # the same reduced loss on every process: all stop together
                    raise TrainingDiverged(
                        f"the loss is {record['loss']} at step {step} (learning rate {learning_rate:g}, grad norm "
                        f"{record['grad_norm']}): training diverged and no final model is saved (checkpoints saved "
                        f"before it are kept in {output_dir}); lower learning_rate, or check the data and dtype")
                history.append(record)
                if config.report_to != "none":
                    accelerator.log(tracking.step_metrics(record, gpu.dense_peak_tflops(config, config.dtype), world, device), step=step)
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second'] or 0:,.0f}")
                if validation_batches is not None and (step % eval_every == 0 or step == run.total_steps):
                    eval_history.append({"step": step, "eval_loss": evaluation.evaluate(model, validation_batches, accelerator, config.loss_chunk_tokens)})
                    step_started = time.perf_counter()  # evaluation is not training time
                if config.save_every_steps and step % config.save_every_steps == 0:
                    checkpoints.save(accelerator, output_dir, step, fingerprint, history, eval_history, accuracy_before)
                    step_started = time.perf_counter()
                if step >= stop_at:
                    break
        progress.close()
        finished = step >= run.total_steps
        memory_measured = report.measured_peak_memory(device, accelerator)
        accuracy_after = (evaluation.accuracy(accelerator, unwrap(accelerator, model), tokenizer, prepared, config)
                          if accuracy_enabled else None)
        final_dir = None
        if finished and tokenizer is not None:
            final_dir = checkpoints.save_final(accelerator, model, unwrap(accelerator, model), tokenizer, output_dir,
                                               config.lora_save)
        wall_seconds = time.perf_counter() - started
        result = report.result(config, prepared, run, accelerator, history, eval_history, start_step, step, finished,
                               model_description, total_parameters, trainable_parameters, optimizer_description,
                               tf32_applied, memory_measured, accuracy_before, accuracy_after, wall_seconds,
                               final_dir, fsdp)
        if accelerator.is_main_process:
            (output_dir / RESULT_FILE).write_text(json.dumps(result, indent=2, default=str) + "\n")
        accelerator.wait_for_everyone()
        return result
    finally:
        accelerator.end_training()
        reset_accelerate_state()
        if config.offload_activations:
            release_pinned_host_memory()


def optimizer_step(accelerator, model, optimizer, micro_batches: list[dict], learning_rate: float,
                   loss_chunk_tokens: int = 0, offloading=contextlib.nullcontext):
    """One optimizer step over one effective batch's ``micro_batches`` (forward and backward of each,
    clipping, AdamW, gradients set to None): the step ``train`` runs, and the one ``planner.trace``
    traces on fake tensors. Returns (this process's loss sum, the effective batch's loss tokens, both
    on the device, and the gradient norm before clipping)."""
    device, world = accelerator.device, accelerator.num_processes
    local_targets = sum(float(batch["target_tokens"]) for batch in micro_batches)
    # Loss tokens of the whole effective batch; stays on the device (no synchronisation here).
    global_targets = accelerator.reduce(torch.tensor(local_targets, device=device, dtype=torch.float64),
                                        "sum").clamp(min=1.0)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            with offloading():
                batch_loss = evaluation.loss_sum(model, batch, device, loss_chunk_tokens)
            # The mean over every loss token of the effective batch: DDP averages gradients
            # over processes, hence x world.
            accelerator.backward(batch_loss * world / global_targets.to(batch_loss.dtype))
        loss_sum += batch_loss.detach().double()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, global_targets, grad_norm


def _print(accelerator, text: str) -> None:
    if accelerator.is_main_process:
        print(text, flush=True)


def unwrap(accelerator, model):
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state, so a notebook can train again (another process count,
    another precision) without restarting its kernel."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _refuse_fsdp_on_cpu() -> None:
    """A TrainError when the launcher asks for FSDP (``accelerate launch --use_fsdp`` or an FSDP
    config) and there is no GPU. accelerate (1.15, ``AcceleratorState``) turns a run into FSDP only
    from a GPU-like process group (MULTI_GPU, MULTI_XPU, ...); from a CPU one (MULTI_CPU, gloo) it
    keeps DDP, so every process would silently hold the whole model; and FSDP1's plugin, with the
    launcher's default --fsdp_sync_module_states true, stops with "no available devices" instead."""
    from accelerate.utils import parse_flag_from_env
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and not torch.cuda.is_available():
        raise TrainError("FSDP was asked for (accelerate launch --use_fsdp or an FSDP config), but there is no GPU: "
                         "accelerate shards a model with FSDP only on GPUs, and on CPU would silently train DDP, every "
                         "process holding the whole model. On CPU, launch without --use_fsdp (DDP, also over several "
                         "nodes); for FSDP, run on GPUs")


def _set_tf32(enabled: bool, device: torch.device) -> bool:
    """TF32 for float32 matmuls and convolutions on CUDA; returns whether it applies. It changes only
    float32 matmuls: under bf16 autocast the matmuls already run in bf16 (seed 003's "8x" is not it)."""
    if device.type != "cuda":
        return False
    runtime.set_tf32(enabled)
    return enabled


def load_training_model(config: TrainConfig, device: torch.device, seq_len: int, load=models.load_model):
    """(model on device, description, lora?) with checkpointing and LoRA applied as configured.
    ``load`` is ``models.load_model`` or a function like it (the trace builds the model on meta).

    Full fine-tuning keeps fp32 master weights (bf16/fp16 run under autocast: the planner's
    "mixed precision"); LoRA freezes the base in ``dtype`` and trains fp32 adapters (PEFT's default).
    """
    lora = config.lora_rank > 0
    pure = lora or config.precision == "bf16"  # else fp32 master weights under autocast
    # Packed rows: an attention path with no seq x seq mask where there is one (training/packed_attention.py).
    attention = packed_attention.training_attention_for(config, seq_len)
    packed_attention.register()
    loaded = load(config.model, config.dtype if pure else "fp32", device,
                  attn_implementation=model_attention(attention))
    model, description = loaded.model, f"{loaded.description}, attention {attention}"
    model.config.use_cache = False  # training: a cache would also disable packed-sequence masks
    if config.grad_checkpointing:
        models.enable_gradient_checkpointing(model)
    if lora:
        try:
            targets = models.lora_targets(model, config.lora_targets)
            model = models.with_lora(model, config.lora_rank, config.lora_targets)
        except ValueError as error:  # lora_targets naming no layer of this model
            raise TrainError(str(error)) from None
        except ImportError:
            raise TrainError("lora_rank > 0 needs peft (pinned in requirements.txt: pip install peft==0.21.2); "
                             "or set lora_rank: 0 for a full fine-tune") from None
        description += (f", LoRA rank {config.lora_rank} (alpha {2 * config.lora_rank}) on "
                        f"{', '.join(targets.names)}")
        if targets.unmatched:
            description += f" (WARNING: lora_targets {', '.join(targets.unmatched)} match no Linear layer)"

    return model, description, lora


def build_optimizer(model, config: TrainConfig, learning_rate: float, *, fused: bool):
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


class _RankBatches(torch.utils.data.Sampler):
    """This process's micro-batches of one epoch's ``steps``: step s takes global micro-batches
    s x A x W ... (s + 1) x A x W - 1, process r every W-th of them, so any split of the same
    effective batch over processes and accumulation sees the same examples per step."""

    def __init__(self, micro_batches, steps, accumulation, rank, world):
        self.batches = [micro_batches[s * accumulation * world + k * world + rank]
                        for s in steps for k in range(accumulation)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _epoch_loader(config, prepared, rows, run, collator, epoch, steps, rank, world, device):
    lengths = [example.length for example in prepared.train]
    micro_batches = batches.epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=run.micro_batch_size,
                                                 seed=config.seed, epoch=epoch)
    sampler = _RankBatches(micro_batches, steps, run.gradient_accumulation_steps, rank, world)
    return data_loader(prepared, sampler, collator, config, device)


def data_loader(prepared, batch_sampler, collator, config, device) -> torch.utils.data.DataLoader:
    """The prepared examples served in ``batch_sampler``'s micro-batches with ``config``'s loader settings."""
    return torch.utils.data.DataLoader(batches.SftDataset(prepared.train), batch_sampler=batch_sampler,
                                       collate_fn=collator, **loader_settings(config, device))


def loader_settings(config, device) -> dict:
    """DataLoader's workers, pinning (only where there is a GPU to copy to) and prefetch (only with workers)."""
    workers = config.dataloader_workers
    return {"num_workers": workers, "pin_memory": config.pin_memory and device.type == "cuda",
            "prefetch_factor": config.prefetch_factor if workers > 0 else None}


def _progress_bar(accelerator, total: int, initial: int):
    from tqdm import tqdm
    # Plain text (not the notebook widget): it reads the same in a terminal, papermill's log and Lab.
    return tqdm(total=total, initial=initial, desc="training", unit="step", mininterval=1.0,
                disable=not accelerator.is_main_process, file=sys.stdout, dynamic_ncols=False)
