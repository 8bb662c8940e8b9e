"""Supervised fine-tuning examples: input/output pairs -> token ids with response-only labels, length
statistics, truncation and the validation split; ``batches`` makes rows and micro-batches of them.

Every function here is pure CPU work on token ids, so the notebook can show the data (lengths,
truncation, padding waste) before any process touches a GPU, and every training process can
rebuild exactly the same batches from the same seed::

    examples, report = tokenize_pairs(records, tokenizer, use_chat_template=False)
    lengths = [example.length for example in examples]
    stats = length_statistics(lengths)                            # min/median/p95/p99/max tokens
    max_len = auto_max_seq_length(lengths, percentile=100)        # smallest multiple of 64 covering it
    examples, truncation = truncate(examples, max_len)            # how many were cut: never hidden
    lengths = [example.length for example in examples]
    rows = plan_rows(lengths, "packing", max_len)                 # example indices per row
    micro_batches = epoch_micro_batches(rows, lengths, "packing", micro_batch_size=16, seed=0, epoch=0)
    collate = Collator("packing", max_len, tokenizer.pad_token_id)
    batch = collate([[examples[i] for i in row] for row in micro_batches[0]])   # tensors for one micro-batch

Formatting. Plain: the prompt is the input as the tokenizer encodes it (with its BOS), the response
is the output joined by one space (none when it already starts with whitespace) and ended by EOS.
Chat: the tokenizer's chat template renders one user turn (with the generation prompt) and the
assistant's reply; the response is whatever the template adds after the prompt (its end-of-turn
token included). Prompt and response are tokenized separately and concatenated, so the boundary
between "no loss" and "loss" is exact even for tokenizers that would merge across it.

Labels follow the Hugging Face convention (a copy of the input ids, -100 on prompt tokens). The
collator turns them into next-token targets *within each example*, so in a packed row the last
token of one example is never trained to predict the first token of the next.

Packing puts several examples in one row of ``max_seq_length`` tokens; ``position_ids`` restart
at 0 for every example, and examples in a row never attend to each other:
- sdpa and eager: transformers 5.x (``masking_utils.find_packed_sequence_indices``) turns restarting
  position ids into a block-causal mask, but only when no attention mask and no KV cache are
  passed, so the model must be called with ``use_cache=False`` (a model in train mode still builds a
  DynamicCache otherwise, and packing silently becomes attention across examples);
- flash_attention_2: transformers reads restarting position ids as variable-length sequences only
  for a batch of ONE row (``modeling_flash_attention_utils._is_packed_sequence``); with more rows
  it runs plain causal attention over each whole row. So for it the collator flattens a
  micro-batch into one row of micro_batch_size x max_seq_length tokens (``flatten=True``).
tests/test_train.py checks a packed row against its examples run alone, and both conditions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from workbook import prompt_format
from workbook.jsonl import DataError  # one error type for unusable data files and records

IGNORE_INDEX = -100  # label of tokens that carry no loss (PyTorch cross_entropy's default ignore_index)
SEQUENCE_LENGTH_MULTIPLE = 64  # `max_seq_length: auto` rounds up to this: tensor-core and kernel friendly


@dataclass
class TokenizedExample:
    """One input/output pair as token ids."""

    input_ids: list[int]
    labels: list[int]  # input_ids with IGNORE_INDEX on every prompt token
    source: str  # where it came from, e.g. "data.jsonl:12"

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def response_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class TokenizeReport:
    examples: int
    chat_template: bool
    skipped: list[str] = field(default_factory=list)  # "source: why", for records without a usable pair


# ----------------------------------------------------------------------------------------------
# Formatting and tokenization.


def plain_response_text(output: str) -> str:
    """The response as appended to the prompt in plain formatting: one space, unless the output
    already starts with whitespace (a teacher's " 68" stays " 68"; "68" becomes " 68")."""
    return output if output[:1].isspace() else " " + output


def tokenize_pairs(
    records: list[dict],
    tokenizer,
    *,
    use_chat_template: bool,
    input_field: str = "input",
    output_field: str = "output",
    sources: list[str] | None = None,
    strict: bool = False,
) -> tuple[list[TokenizedExample], TokenizeReport]:
    """Token ids and response-only labels for each record's (input, output) pair.

    Records whose input or output is missing, not a string, or empty are skipped and listed in the
    report (never silently); ``strict`` (on_bad_line: fail) stops at the first whose field is missing
    or not a string, a record the data's author got wrong (an empty one can be a teacher's real answer).
    ``sources`` names each record in messages (default "record <n>").
    """
    sources = sources or [f"record {index + 1}" for index in range(len(records))]
    report = TokenizeReport(examples=0, chat_template=use_chat_template)
    prompts, responses, kept_sources = [], [], []
    for record, source in zip(records, sources):
        prompt, response = record.get(input_field), record.get(output_field)
        problem = None
        for name, value in ((input_field, prompt), (output_field, response)):
            if not isinstance(value, str) or not value.strip():
                problem = f"field '{name}' is {'missing' if value is None else repr(value)[:40]}"
                if strict and not isinstance(value, str):
                    raise DataError(f"{source}: {problem}; every record needs '{input_field}' and '{output_field}' "
                                    "strings. Fix that record, set input_field / output_field to your data's field "
                                    "names, or set on_bad_line: skip to train without it (listed on the console)")
                break
        if problem:
            report.skipped.append(f"{source}: {problem}")
            continue
        prompts.append(prompt)
        responses.append(response)
        kept_sources.append(source)
    if not prompts:
        fields = f"'{input_field}' and '{output_field}'"
        raise DataError(f"no usable record: every record lacks a non-empty {fields} string "
                        f"(first problem: {report.skipped[0] if report.skipped else 'no records'}). "
                        "Set input_field / output_field to the field names of your data.")
    # The prompt's tokens exactly as the generation job (and evaluation after training) formats it.
    prompt_ids = prompt_format.prompt_token_ids(tokenizer, prompts, use_chat_template=use_chat_template)
    if use_chat_template:
        response_texts = _chat_replies(tokenizer, prompts, responses, kept_sources)
        response_ids = tokenizer(response_texts, add_special_tokens=False)["input_ids"]
    else:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: plain formatting ends every response with it. "
                            "Set the tokenizer's eos_token, or use_chat_template: true.")
        response_ids = [ids + [tokenizer.eos_token_id] for ids in
                        tokenizer([plain_response_text(r) for r in responses], add_special_tokens=False)["input_ids"]]
    examples = [
        TokenizedExample(list(p) + list(r), [IGNORE_INDEX] * len(p) + list(r), source)
        for p, r, source in zip(prompt_ids, response_ids, kept_sources)
    ]
    report.examples = len(examples)
    return examples, report


def _chat_replies(tokenizer, prompts, responses, sources) -> list[str]:
    """Each reply's text as the chat template renders it after its prompt's generation prompt."""
    response_texts = []
    for prompt, response, source in zip(prompts, responses, sources):
        # Reply content is stripped, as Llama-3's template does (`| trim`): the template places it.
        assistant = {"role": "assistant", "content": response.strip()}
        prompt_text = prompt_format.chat_prompt_text(tokenizer, prompt)
        full_text = tokenizer.apply_chat_template(prompt_format.chat_messages(prompt) + [assistant], tokenize=False)
        if not full_text.startswith(prompt_text):
            raise DataError(f"{source}: the chat template renders the prompt differently once the reply follows "
                            "it, so the response tokens cannot be separated exactly; use use_chat_template: false.")
        response_texts.append(full_text[len(prompt_text):])
    return response_texts


# ----------------------------------------------------------------------------------------------
# Lengths: statistics, `auto` max_seq_length, truncation, validation split.


def length_percentile(lengths: list[int], percentile: float) -> int:
    """Nearest-rank percentile: the smallest length that ``percentile`` % of the examples do not exceed."""
    if not lengths:
        raise DataError("no examples to measure")
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    ordered = sorted(lengths)
    rank = math.ceil(percentile / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def length_statistics(lengths: list[int]) -> dict:
    """Token-length statistics (nearest-rank percentiles) of a data set: what max_seq_length must cover."""
    return {
        "examples": len(lengths),
        "min": min(lengths),
        "median": length_percentile(lengths, 50),
        "p95": length_percentile(lengths, 95),
        "p99": length_percentile(lengths, 99),
        "max": max(lengths),
        "mean": round(sum(lengths) / len(lengths), 2),
        "total_tokens": sum(lengths),
    }


def auto_max_seq_length(lengths: list[int], percentile: float = 100.0,
                        multiple: int = SEQUENCE_LENGTH_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` that covers the ``percentile`` % shortest examples.

    With the default 100 every example fits (seed 003 picked 1536 for a longest example of 1481
    tokens by hand: this is that rule, computed).
    """
    covered = length_percentile(lengths, percentile)
    return max(multiple, math.ceil(covered / multiple) * multiple)


@dataclass
class TruncationReport:
    max_seq_length: int
    truncated: int  # examples cut to max_seq_length (they keep their first max_seq_length tokens)
    dropped: int  # examples with no response token left after the cut (no loss possible): removed
    tokens_cut: int  # tokens removed by truncation

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def truncate(examples: list[TokenizedExample], max_seq_length: int) -> tuple[list[TokenizedExample], TruncationReport]:
    """Cut every example to ``max_seq_length`` tokens (the end of the response goes first)."""
    kept, truncated, dropped, cut = [], 0, 0, 0
    for example in examples:
        if example.length <= max_seq_length:
            kept.append(example)
            continue
        truncated += 1
        cut += example.length - max_seq_length
        short = TokenizedExample(example.input_ids[:max_seq_length], example.labels[:max_seq_length], example.source)
        if short.response_tokens == 0:
            dropped += 1
        else:
            kept.append(short)
    return kept, TruncationReport(max_seq_length, truncated, dropped, cut)


def split_validation(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, validation indices): a seeded random ``fraction`` held out.

    At least one example goes to each side when ``fraction > 0`` and there are two or more.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction!r}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = 0 if fraction == 0 or count < 2 else min(count - 1, max(1, round(count * fraction)))
    return sorted(order[held:]), sorted(order[:held])
