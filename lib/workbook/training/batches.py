"""Training batches that waste as little as possible on padding: packed rows or length-grouped
micro-batches, the same for every process from the same seed, and the collator that turns them into
tensors (next-token targets within each example; ``examples`` explains packing and the masks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from workbook.jsonl import DataError
from workbook.training.chunked_loss import loss_sum_chunked
from workbook.training.examples import IGNORE_INDEX, TokenizedExample

# Length-grouped batching sorts lengths inside windows of this many micro-batches (as the HF
# Trainer's LengthGroupedSampler does with its "megabatch" of 50): similar lengths meet, the order
# stays random.
LENGTH_GROUP_WINDOW = 50
PADDINGS = ("packing", "length_grouped")


def plan_rows(lengths: list[int], padding: str, max_seq_length: int) -> list[tuple[int, ...]]:
    """Example indices per row. ``packing``: first-fit decreasing into rows of ``max_seq_length``
    tokens; ``length_grouped``: one example per row (grouping happens per epoch, see below)."""
    _check_padding(padding)
    if padding == "length_grouped":
        return [(index,) for index in range(len(lengths))]
    too_long = [index for index, length in enumerate(lengths) if length > max_seq_length]
    if too_long:
        raise DataError(f"{len(too_long)} example(s) are longer than max_seq_length={max_seq_length}; truncate first")
    rows: list[list[int]] = []
    free: list[int] = []  # tokens left per row
    open_rows: list[int] = []  # rows with room left, in order: a full row takes nothing more
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        for position, row in enumerate(open_rows):  # first fit, a linear scan over the rows not yet full
            if free[row] >= length:
                rows[row].append(index)
                free[row] -= length
                if not free[row]:
                    del open_rows[position]
                break
        else:
            rows.append([index])
            free.append(max_seq_length - length)
            if free[-1]:
                open_rows.append(len(rows) - 1)
    return [tuple(row) for row in rows]


def epoch_micro_batches(rows: list[tuple[int, ...]], lengths: list[int], padding: str, *,
                        micro_batch_size: int, seed: int, epoch: int, shuffle: bool = True) -> list[list[tuple[int, ...]]]:
    """The micro-batches (lists of rows) of one epoch, in order. Same seed and epoch, same batches,
    in every process.

    Packed rows are shuffled and cut into micro-batches. Length-grouped rows are shuffled, sorted by
    length inside windows of LENGTH_GROUP_WINDOW micro-batches, cut into micro-batches, and the
    micro-batches shuffled, except that the longest comes first: if anything runs out of memory it
    does so at the first step, not hours later.
    """
    _check_padding(padding)
    order = list(range(len(rows)))
    generator = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        generator.shuffle(order)
    if padding == "packing":
        return [[rows[i] for i in order[start:start + micro_batch_size]]
                for start in range(0, len(order), micro_batch_size)]
    row_length = [sum(lengths[i] for i in row) for row in rows]
    window = micro_batch_size * LENGTH_GROUP_WINDOW
    batches = []
    for start in range(0, len(order), window):
        group = sorted(order[start:start + window], key=lambda i: -row_length[i])
        batches += [group[b:b + micro_batch_size] for b in range(0, len(group), micro_batch_size)]
    if shuffle:
        longest = max(range(len(batches)), key=lambda b: row_length[batches[b][0]])
        batches.insert(0, batches.pop(longest))
        rest = batches[1:]
        generator.shuffle(rest)
        batches = batches[:1] + rest
    return [[rows[i] for i in batch] for batch in batches]


def micro_batch_width(micro_batch: list[tuple[int, ...]], lengths: list[int], padding: str, max_seq_length: int) -> int:
    """Tokens per row of this micro-batch once padded: the fixed row length when packing (one shape
    for every step, which torch.compile likes), the longest row when length grouping."""
    if padding == "packing":
        return max_seq_length
    return max(sum(lengths[i] for i in row) for row in micro_batch)


def padding_fraction(micro_batches: list[list[tuple[int, ...]]], lengths: list[int], padding: str,
                     max_seq_length: int) -> float:
    """Padding tokens / all token positions over these micro-batches (0: no waste)."""
    positions = real = 0
    for batch in micro_batches:
        positions += len(batch) * micro_batch_width(batch, lengths, padding, max_seq_length)
        real += sum(lengths[i] for row in batch for i in row)
    return 1 - real / positions if positions else 0.0


def padding_comparison(lengths: list[int], max_seq_length: int, micro_batch_size: int, seed: int) -> dict:
    """Padding fraction of one epoch under each choice, and under plain pad-to-max_seq_length
    (random batches padded to the full length, what a fixed `max_length` tokenizer call does)."""
    result = {}
    for padding in PADDINGS:
        rows = plan_rows(lengths, padding, max_seq_length)
        batches = epoch_micro_batches(rows, lengths, padding, micro_batch_size=micro_batch_size, seed=seed, epoch=0)
        result[padding] = padding_fraction(batches, lengths, padding, max_seq_length)
    result["pad_to_max_seq_length"] = 1 - sum(lengths) / (len(lengths) * max_seq_length) if lengths else 0.0
    return result


def _check_padding(padding: str) -> None:
    if padding not in PADDINGS:
        raise ValueError(f"padding {padding!r}: expected one of {', '.join(PADDINGS)}")


# ----------------------------------------------------------------------------------------------
# Tensors.


class SftDataset(torch.utils.data.Dataset):
    """Indexed by a row (a tuple of example indices); returns that row's examples for `collate`.

    Used with a batch sampler that yields micro-batches of rows, so DataLoader workers, pinned
    memory and prefetching apply as for any data set.
    """

    def __init__(self, examples: list[TokenizedExample]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, row: tuple[int, ...]) -> list[TokenizedExample]:
        return [self.examples[index] for index in row]


@dataclass
class Collator:
    """Micro-batch of rows -> tensors: input_ids, position_ids and next-token targets, plus counts.

    ``targets[t]`` is the token that position t must predict (``labels[t + 1]`` of the same
    example), IGNORE_INDEX where there is none: prompt positions, each example's last token, padding.
    """

    padding: str
    max_seq_length: int
    pad_token_id: int
    flatten: bool = False  # one row of all the micro-batch's tokens (flash-attention-2 packing, see above)

    def __call__(self, rows: list[list[TokenizedExample]]) -> dict[str, torch.Tensor]:
        if self.padding == "packing":
            width = self.max_seq_length
        else:
            width = max(sum(example.length for example in row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        tokens = length_squares = 0
        for r, row in enumerate(rows):
            start = 0
            for example in row:
                n = example.length
                input_ids[r, start:start + n] = torch.tensor(example.input_ids)
                targets[r, start:start + n - 1] = torch.tensor(example.labels[1:])
                position_ids[r, start:start + n] = torch.arange(n)
                start += n
                tokens += n
                length_squares += n * n
            # Padding continues as one more "sequence" of its own (positions from 0 when packing,
            # continuing when not, so an unpacked row keeps plain causal positions).
            if self.padding == "packing":
                position_ids[r, start:] = torch.arange(width - start)
            else:
                position_ids[r, start:] = torch.arange(start, width)
        if self.flatten:
            input_ids, position_ids, targets = (t.reshape(1, -1) for t in (input_ids, position_ids, targets))
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "targets": targets,
            "tokens": torch.tensor(tokens),  # non-padding input tokens
            "target_tokens": (targets != IGNORE_INDEX).sum(),  # tokens that carry loss
            "length_squares": torch.tensor(length_squares),  # sum of n_i^2: the attention FLOPs term
        }


def loss_sum(model, batch: dict, device: torch.device, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """Sum of the next-token cross-entropy over the batch's loss tokens, in float32.

    ``loss_chunk_tokens`` > 0: over chunks of that many positions, never all logits at once
    (``chunked_loss``); the same value and gradients."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    targets = batch["targets"].to(device, non_blocking=True)
    # No attention mask and no cache: position ids that restart mark packed examples (module docstring).
    if loss_chunk_tokens > 0:
        return loss_sum_chunked(model, input_ids, position_ids, targets, loss_chunk_tokens)
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
