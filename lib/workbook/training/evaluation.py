"""How well the model does while it trains: validation loss over every process's share, and (on the
arithmetic task) greedy answers scored against the task's true answers."""

from __future__ import annotations

import math

import torch

from workbook import arithmetic, decoding, prompt_format, tiny_model
from workbook.training import packed_attention
from workbook.training.batches import epoch_micro_batches, loss_sum, plan_rows
from workbook.training.examples import IGNORE_INDEX

GENERATION_BATCH = 64


def validation_batches(prepared, config, run, collator, accelerator):
    """This process's share of the validation micro-batches (collated once), every process the same
    count (DDP/FSDP forwards are collective): short shares are topped up with a loss-free copy."""
    if not prepared.validation:
        return None
    lengths = [example.length for example in prepared.validation]
    rows = plan_rows(lengths, config.padding, prepared.max_seq_length)
    batches = epoch_micro_batches(rows, lengths, config.padding, micro_batch_size=run.micro_batch_size,
                                  seed=config.seed, epoch=0, shuffle=False)
    world, rank = accelerator.num_processes, accelerator.process_index
    share = [collator([[prepared.validation[i] for i in row] for row in batch]) for batch in batches[rank::world]]
    while len(share) < math.ceil(len(batches) / world):
        filler = dict(collator([[prepared.validation[i] for i in row] for row in batches[0]]))
        filler["targets"] = torch.full_like(filler["targets"], IGNORE_INDEX)
        share.append(filler)
    return share


def evaluate(model, batches, accelerator, loss_chunk_tokens: int = 0) -> float:
    """Mean next-token loss over every validation loss token of all processes."""
    model.eval()
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            totals[0] += loss_sum(model, batch, accelerator.device, loss_chunk_tokens).double()
            totals[1] += (batch["targets"] != IGNORE_INDEX).sum()
    model.train()
    loss, count = accelerator.reduce(totals, "sum").tolist()
    return loss / max(count, 1.0)


def arithmetic_references(records: list[dict], input_field: str) -> list[str] | None:
    """The true answers when every record's input is a question of the arithmetic task (from the
    task itself, not from the record's output, which may be a teacher's mistake); else None."""
    problems = [arithmetic.parse_question(record.get(input_field)) for record in records]
    if not problems or any(problem is None for problem in problems):
        return None
    return [arithmetic.answer_text(problem.answer) for problem in problems]


def accuracy(accelerator, model, tokenizer, prepared, config) -> dict | None:
    """Greedy answers to ``prepared.accuracy_records`` (validation prompts, or the held-out file of
    eval_prompts_path), scored against the task's true answers; computed by the main process while
    the others wait. None if not the arithmetic task. ``model`` is the unwrapped model (no DDP
    wrapper: only the main process generates)."""
    records = prepared.accuracy_records
    references = arithmetic_references(records, config.input_field)
    result = None
    if references is not None and accelerator.is_main_process:
        was_training = model.training
        model.eval()
        prompts = prompt_format.prompt_token_ids(tokenizer, [r[config.input_field] for r in records],
                                                 use_chat_template=config.use_chat_template)
        with accelerator.autocast(), packed_attention.generation_attention(model):
            texts = decoding.greedy_completions(model, tokenizer, prompts, tiny_model.MAX_NEW_TOKENS,
                                              batch_size=GENERATION_BATCH)
        model.train(was_training)
        scored = [{"output": reference} for reference in references]
        result = {"accuracy": arithmetic.accuracy(scored, texts), "records": len(records),
                  "of": prepared.accuracy_source,
                  "examples": [{"input": r[config.input_field], "answer": t, "reference": ref}
                               for r, t, ref in list(zip(records, texts, references))[:5]]}
    accelerator.wait_for_everyone()
    return result
