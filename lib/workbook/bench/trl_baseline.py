"""TRL's SFTTrainer beside the workbook's loop (``bench_train_baselines: trl-sft``): what most people
fine-tuning on prompt/response pairs run, on the same job, with its own batching.

Held the same as the HF Trainer baseline holds it (``trainer_baseline``): the model object (weights or
seeded random init, the attention path for packed rows), the learning rate, its schedule, AdamW
settings, clipping, precision, steps and micro-batch, and the clock (synchronized timestamps at each
step's end, the first TIMING_WARMUP_STEPS left out). The data are the workbook's own tokenized
examples (``input_ids``, and the response tokens as TRL's ``completion_mask``), so both train on the
same tokens and the same loss tokens. What TRL does its own way, and is therefore what this measures:
best-fit-decreasing packing into rows of ``max_seq_length``, a padding-free batch (the micro-batch's
rows flattened into one sequence with position ids), its loss (log-probabilities of the loss
positions only, through its fused LM head, in tiles: the full logits never exist) and its per-step
metrics (entropy and token accuracy, read back every step).
"""

from __future__ import annotations

import dataclasses

import importlib.util

from workbook.bench.trainer_baseline import StepClock, argument_values, measured_training, point_setup
from workbook.training.config import TIMING_WARMUP_STEPS, TrainConfig
from workbook.training.examples import IGNORE_INDEX
from workbook.training.run_plan import model_flops_coefficients

NAME = "trl-sft"  # its bench_train_baselines value
SETTINGS = "the same examples, each packing and batching them its own way"


def label() -> str:
    return f"TRL SFTTrainer (trl {_trl_version()})"


def missing() -> str | None:
    """Why TRL cannot run here (it, or the ``datasets`` it needs, is not installed), or None."""
    absent = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if absent:
        return (f"not measured: {' and '.join(absent)} not installed here (pip install -r requirements.txt; a GPU "
                "image without pip: carry the wheels of trl, datasets, dill and multiprocess, "
                "outputs/reference/README.md)")
    return None


def sft_run(config: TrainConfig, work_dir: str) -> dict:
    """Train ``config``'s point with TRL's SFTTrainer on this machine's default device and measure it
    as ``trainer_baseline.trainer_run`` measures the Trainer; also ``epoch_rows`` and ``epoch_tokens``,
    the rows TRL packed and their tokens (equal to the examples' when it dropped and cut nothing)."""
    from datasets import Dataset
    from trl import SFTConfig

    device, tokenizer, prepared, run, model, model_description, lora = point_setup(config, "TRL SFTTrainer")
    examples = Dataset.from_dict({
        "input_ids": [example.input_ids for example in prepared.train],
        "completion_mask": [[int(label != IGNORE_INDEX) for label in example.labels] for example in prepared.train]})
    # TRL turns checkpointing on by default; load_training_model has already set it as the point asks.
    # transformers 5.23 renamed the argument (the old name warns); 5.17, the GPU image's, has only the old.
    checkpointing = ("activation_checkpointing" if "activation_checkpointing" in
                     {field.name for field in dataclasses.fields(SFTConfig)} else "gradient_checkpointing")
    arguments = SFTConfig(**argument_values(config, run, work_dir, device), **{checkpointing: False},
                          packing=True, packing_strategy="bfd", max_length=prepared.max_seq_length,
                          completion_only_loss=True)
    clock = StepClock(device)
    seen: list[dict] = []
    trainer = _recording_sft_trainer(seen, model=model, args=arguments, train_dataset=examples,
                                   processing_class=tokenizer or stand_in_tokenizer(prepared.pad_token_id),
                                   callbacks=[clock])
    measured = measured_training(trainer, seen, clock, config, model_flops_coefficients(model.config, lora), device)
    return {
        "loop": label(), **measured, "model": model_description,
        "epoch_rows": len(trainer.train_dataset),
        "epoch_tokens": sum(len(row) for row in trainer.train_dataset["input_ids"]),
        "examples_tokens": sum(example.length for example in prepared.train),
        "how": (f"trl.SFTTrainer.train(), {run.total_steps} steps of {run.micro_batch_size} rows packed by TRL "
                f"(best-fit decreasing, up to {prepared.max_seq_length} tokens a row, padding-free) from the "
                f"workbook's {len(prepared.train)} tokenized examples, loss on their response tokens; "
                + ("bf16/fp16 autocast over fp32 weights" if arguments.bf16 or arguments.fp16 else "fp32")
                + f"; the Trainer's AdamW (optim {getattr(arguments.optim, 'value', arguments.optim)}) with the "
                "workbook's learning rate, schedule, betas, decay and clipping; checkpointing "
                f"{config.grad_checkpointing}, torch.compile {config.torch_compile}; tokens/s over the steps "
                f"after the first {TIMING_WARMUP_STEPS}, from synchronized timestamps at each step's end"),
        "differences": differences(),
    }


def stand_in_tokenizer(pad_token_id: int):
    """A preset's (random weights: no tokenizer) stand-in for SFTTrainer, which reads only its pad and
    end-of-sequence tokens (the examples come tokenized) and, given none, fetches the model's from the
    Hub: gated, and no network on a rented GPU. Two tokens, the pad at the synthetic rows' pad id."""
    from tokenizers import Tokenizer, models as tokenizer_models
    from transformers import PreTrainedTokenizerFast
    pad, end = "<pad>", "</s>"
    vocabulary = {pad: pad_token_id, end: pad_token_id + 1}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tokenizer_models.WordLevel(vocabulary, unk_token=pad)),
                                   pad_token=pad, eos_token=end)


def differences() -> list[str]:
    return [
        "batches: TRL packs the examples itself (best-fit decreasing into rows of max_seq_length, shuffled by its "
        "sampler) and flattens a micro-batch's rows into one padding-free sequence; the workbook packs first-fit "
        "decreasing into rows of the same length, padded, shuffled by its own seed: the same examples, other "
        "micro-batches, so the losses compare, not match",
        "loss: TRL's fused LM head scores only the loss positions, in tiles (the full logits never exist: less "
        "memory, fewer LM-head FLOPs than the workbook's full logits; its MFU counts the same model FLOPs per "
        "token as the workbook's)",
        "per step TRL also computes the entropy and token accuracy of the loss positions and reads them back "
        "to the host (.item()), as it does in every run",
    ]


def _recording_sft_trainer(seen: list[dict], **kwargs):
    """TRL's SFTTrainer, appending to ``seen`` what each step's forward saw (device tensors, read once
    training is over). Defined on first use: TRL imports for seconds, and only a sweep that asks pays that."""
    from trl import SFTTrainer

    class RecordingSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            starts = inputs["cu_seq_lens_q"]  # each example's bounds in the flattened, padding-free sequence
            record = {"tokens": inputs["input_ids"].numel(), "length_squares": starts.diff().pow(2).sum(),
                      "loss_tokens": inputs["labels"][..., 1:].ne(IGNORE_INDEX).sum()}
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
            seen.append({**record, "loss": (loss[0] if return_outputs else loss).detach()})
            return loss

    return RecordingSFTTrainer(**kwargs)


def _trl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("trl")
    except PackageNotFoundError:
        return "not installed"
