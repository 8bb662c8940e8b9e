"""The data a run trains on: read, split, tokenize, truncate, with everything the report says about
it; synthetic rows for preset architectures (random weights, benchmarks). CPU only, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbook import arithmetic, decoding, jsonl, models, presets
from workbook.params import AUTO
from workbook.training import examples as sft_examples
from workbook.training.config import TrainConfig, TrainError

LISTED_IN_CONSOLE = 3  # left-out lines and records a console line names (the result's data summary lists 5)
VALIDATION_ACCURACY_RECORDS = 256  # validation prompts answered greedily for the accuracy (an eval file: all of it)


@dataclass
class PreparedData:
    """The tokenized data set, split, truncated, with everything the report says about it."""

    train: list[sft_examples.TokenizedExample]
    validation: list[sft_examples.TokenizedExample]
    accuracy_records: list[dict]  # records answered greedily before and after training (the accuracy check)
    max_seq_length: int
    max_seq_length_rule: str  # how it was chosen
    length_stats: dict  # of all examples, before truncation
    lengths: list[int]  # every example's token length before truncation (for the histogram)
    truncation: dict
    tokenize_report: dict
    source: str
    pad_token_id: int
    skipped_lines: list[str] = field(default_factory=list)  # "file:line: why" of each line on_bad_line: skip left out
    accuracy_source: str = "validation prompts"  # what accuracy_records are, for the report

    def summary(self) -> dict:
        return {
            "source": self.source,
            "examples": {"train": len(self.train), "validation": len(self.validation)},
            "bad_lines": {"skipped": len(self.skipped_lines), "skipped_first": self.skipped_lines[:5]},
            "token_lengths": self.length_stats,
            "max_seq_length": self.max_seq_length,
            "max_seq_length_rule": self.max_seq_length_rule,
            "truncation": self.truncation,
            "formatting": self.tokenize_report,
        }


def read_records(path: str, on_bad_line: str = jsonl.FAIL) -> tuple[list[dict], list[str], list[str]]:
    """(records, "file:line" of each, "file:line: why" of each bad line left out) from a JSON-lines
    file, read by workbook.jsonl with the on_bad_line policy; '' gives the arithmetic sample records."""
    if not path:
        records = arithmetic.sample_records()
        return records, [f"sample record {index + 1}" for index in range(len(records))], []
    jsonl.check_policy("on_bad_line", on_bad_line)
    numbered, bad_lines = jsonl.read_jsonl(path, on_bad_line=jsonl.SKIP)
    if bad_lines and on_bad_line == jsonl.FAIL:
        # Raised here rather than by the reader: training has no failures file, it lists skipped lines itself.
        raise jsonl.DataError(f"{bad_lines[0].describe()}. Fix or remove that line, or set on_bad_line: skip to "
                              "train without it (skipped lines are listed on the console and in the run's metrics).")
    skipped = [bad_line.describe() for bad_line in bad_lines]
    if not numbered:
        bad = f" (every non-blank line is bad: {listing(skipped, len(skipped))})" if skipped else ""
        raise TrainError(f"{path}: no records{bad}; it must hold one JSON object per line")
    return [record for _, record in numbered], [f"{path}:{number}" for number, _ in numbered], skipped


def listing(items: list[str], total: int) -> str:
    """The first LISTED_IN_CONSOLE of ``items`` joined, and how many more of ``total`` there are."""
    shown = items[:LISTED_IN_CONSOLE]
    return "; ".join(shown) + (f"; and {total - len(shown)} more" if total > len(shown) else "")


def left_out_lines(prepared: PreparedData) -> list[str]:
    """A console line for each kind of input left out of training: bad lines (on_bad_line: skip)
    and records without a usable input/output pair; empty when nothing was left out."""
    lines = []
    if prepared.skipped_lines:
        lines.append(f"skipped {len(prepared.skipped_lines)} bad line(s) (on_bad_line: skip): "
                     f"{listing(prepared.skipped_lines, len(prepared.skipped_lines))}")
    report = prepared.tokenize_report
    if report.get("skipped"):
        lines.append(f"left out {report['skipped']} record(s) without a non-empty '{report['input_field']}' and "
                     f"'{report['output_field']}' string: {listing(report['skipped_first'], report['skipped'])}")
    return lines


def prepare_data(config: TrainConfig, tokenizer=None, log=print) -> PreparedData:
    """Read, split, tokenize and truncate the data; choose max_seq_length. CPU only, deterministic.
    ``log`` gets a line for each kind of input left out (``left_out_lines``)."""
    if models.is_preset(config.model):
        return synthetic_data(config)
    tokenizer = tokenizer or models.load_tokenizer(config.model)
    records, sources, skipped_lines = read_records(config.data_path, config.on_bad_line)
    train_index, validation_index = sft_examples.split_validation(len(records), config.validation_fraction, config.seed)
    examples, report = sft_examples.tokenize_pairs(
        records, tokenizer, use_chat_template=config.use_chat_template, input_field=config.input_field,
        output_field=config.output_field, sources=sources, strict=config.on_bad_line == jsonl.FAIL)
    by_source = {example.source: example for example in examples}
    lengths = [example.length for example in examples]
    model_limit = getattr(tokenizer, "model_max_length", None)
    max_len, rule = _choose_max_seq_length(config, lengths, _model_max_positions(config, model_limit))
    train, truncation = sft_examples.truncate([by_source[sources[i]] for i in train_index if sources[i] in by_source], max_len)
    validation, validation_truncation = sft_examples.truncate(
        [by_source[sources[i]] for i in validation_index if sources[i] in by_source], max_len)
    if not train:
        cut = truncation.dropped + validation_truncation.dropped
        why = (f"; {cut} lost every response token to max_seq_length {max_len} ({rule}): raise max_seq_length"
               if cut else ": add data or lower validation_fraction")
        raise TrainError(f"no training example left (of {len(records)} records, {len(validation_index)} held out for "
                         f"validation, the rest skipped or dropped){why}")
    truncation_summary = {
        "max_seq_length": max_len,
        "truncated": truncation.truncated + validation_truncation.truncated,
        "dropped_without_response": truncation.dropped + validation_truncation.dropped,
        "tokens_cut": truncation.tokens_cut + validation_truncation.tokens_cut,
    }
    prepared = PreparedData(
        train=train, validation=validation,
        accuracy_records=[records[i] for i in validation_index if sources[i] in by_source][:VALIDATION_ACCURACY_RECORDS],
        max_seq_length=max_len, max_seq_length_rule=rule, length_stats=sft_examples.length_statistics(lengths),
        lengths=lengths, truncation=truncation_summary,
        tokenize_report={"chat_template": report.chat_template, "examples": report.examples,
                         "skipped": len(report.skipped), "skipped_first": report.skipped[:5],
                         "input_field": config.input_field, "output_field": config.output_field},
        source=config.data_description,
        pad_token_id=decoding.pad_token_id(None, tokenizer),
        skipped_lines=skipped_lines,
    )
    if config.eval_prompts_path:
        prepared.accuracy_records = held_out_records(config)
        prepared.accuracy_source = f"held-out prompts of {config.eval_prompts_path}"
    for line in left_out_lines(prepared):
        log(line)
    return prepared


def held_out_records(config: TrainConfig) -> list[dict]:
    """The records of ``eval_prompts_path``, read before any model loads; every one must be a
    question of the arithmetic task (the only task whose true answers the workbook knows)."""
    records, sources, _ = read_records(config.eval_prompts_path, jsonl.FAIL)
    for record, source in zip(records, sources):
        if arithmetic.parse_question(record.get(config.input_field)) is None:
            raise TrainError(f"{source}: eval_prompts_path holds held-out questions scored against their true "
                             f"answers, and its '{config.input_field}' is not a question of the arithmetic task "
                             "(\"What is 12 + 34?\"); point it at such a file, or set it to '' to score the "
                             "validation split")
    return records


def _model_max_positions(config: TrainConfig, tokenizer_limit: int | None) -> int | None:
    config_limit = getattr(presets.load_config(models.model_source(config.model)), "max_position_embeddings", None)
    limits = [limit for limit in (config_limit, tokenizer_limit) if isinstance(limit, int) and 0 < limit < 10**9]
    return min(limits) if limits else None


def _choose_max_seq_length(config: TrainConfig, lengths: list[int], model_limit: int | None) -> tuple[int, str]:
    if config.max_seq_length == AUTO:
        chosen = sft_examples.auto_max_seq_length(lengths, config.length_percentile)
        rule = (f"auto: smallest multiple of {sft_examples.SEQUENCE_LENGTH_MULTIPLE} covering the "
                f"{config.length_percentile:g}th percentile ({sft_examples.length_percentile(lengths, config.length_percentile)} tokens)")
        if model_limit and chosen > model_limit:
            rule += f", capped at the model's {model_limit} positions"
            chosen = model_limit
        return chosen, rule
    chosen = int(config.max_seq_length)
    if model_limit and chosen > model_limit:
        raise TrainError(f"max_seq_length {chosen} exceeds the model's {model_limit} positions; "
                         f"set max_seq_length <= {model_limit} or 'auto'")
    return chosen, "set in params"


def synthetic_documents(length: int) -> list[int]:
    """The lengths of the documents one synthetic row of ``length`` tokens holds: a half, a quarter and
    two eighths, as packed SFT rows hold several examples (whose position ids restart, so the attention
    keeps each to itself: the path packing takes, and the one the planner plans); first-fit decreasing
    packs them back into full rows. One document where ``length`` is too short to split."""
    quarter, eighth = length // 4, length // 8
    return [length - quarter - 2 * eighth, quarter, eighth, eighth] if eighth else [length]


def synthetic_data(config: TrainConfig) -> PreparedData:
    """Random token sequences of exactly max_seq_length tokens, all carrying loss, each cut into
    ``synthetic_documents``: for throughput benchmarks of preset architectures (random weights, no
    tokenizer). Nothing here is learnable."""
    if config.max_seq_length == AUTO:
        raise TrainError(f"model {config.model!r} is a preset (random weights, synthetic data): set max_seq_length "
                         "to the sequence length to benchmark, e.g. --set max_seq_length=2048")
    vocab = presets.load_config(config.model).vocab_size
    length = int(config.max_seq_length)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(0, vocab, (config.synthetic_examples, length), generator=generator).tolist()
    pieces = synthetic_documents(length)
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    sequences = [[sft_examples.TokenizedExample(row[start:start + size], row[start:start + size],
                                                f"synthetic {index + 1}.{piece + 1}")
                  for piece, (start, size) in enumerate(zip(starts, pieces))] for index, row in enumerate(ids)]
    held_sequences = max(1, round(len(sequences) * config.validation_fraction)) if config.validation_fraction else 0
    held = held_sequences * len(pieces)  # whole sequences held out: validation rows are full rows too
    examples = [example for documents in sequences for example in documents]
    lengths = [example.length for example in examples]
    return PreparedData(
        train=examples[held:], validation=examples[:held], accuracy_records=[], max_seq_length=length,
        max_seq_length_rule="set in params (synthetic sequences of exactly this length)",
        length_stats=sft_examples.length_statistics(lengths), lengths=lengths,
        truncation={"max_seq_length": length, "truncated": 0, "dropped_without_response": 0, "tokens_cut": 0},
        tokenize_report={"synthetic": True, "examples": len(examples)},
        source=(f"{len(sequences)} random sequences of {length} tokens, each {len(pieces)} documents of "
                f"{', '.join(map(str, pieces))} tokens (preset {config.model}: random weights)"),
        pad_token_id=0,
    )
