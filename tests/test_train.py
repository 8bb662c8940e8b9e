"""Training: loss on response tokens only, packing without attention across examples, `auto`
sequence length, overfitting, exact resume, and 2 processes giving the 1-process losses."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from workbook import arithmetic, cli, jsonl, params, planner, runner, training
from workbook.training import batches as sft_batches, checkpoints, cli as training_cli, examples as sft_examples
from workbook.training import config as config_module, run_folder, run_plan
from workbook.paths import NOTEBOOKS_DIR, REPO_ROOT
from workbook import prompt_format
from workbook.tiny_model import EOS_ID, EOT_ID

PAD_ID = EOS_ID  # the tiny tokenizer has no pad token, as Llama 3's: an end id is lent (decoding.pad_token_id)

IGNORE = sft_examples.IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def ids_of(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` alone, no special token added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


# What these tests train with besides the schema's defaults (those of a GPU run): the CPU's dtype and
# loading, no chat template (the records are plain text), no checkpoints unless a test asks.
CPU_TEST_SETTINGS = dict(dtype="fp32", tf32=False, dataloader_workers=0, pin_memory=False, use_chat_template=False,
                         save_every_steps=0)


def make_config(tmp_path, data_path="", **changes) -> training.TrainConfig:
    settings = dict(model="tiny", data_path=data_path, data_description="test data", output_dir=str(tmp_path / "out"),
                    validation_fraction=0.0, micro_batch_size=2, learning_rate=1e-3, max_steps=2, warmup_steps=0,
                    **CPU_TEST_SETTINGS)
    settings.update(changes)
    return training.TrainConfig(**settings)


# ----------------------------------------------------------------------------------------------
# Data: labels, packing, lengths.


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat_template"])
def test_only_response_tokens_carry_loss_token_by_token(tokenizer, chat):
    records = [{"input": "What is 23 + 45?", "output": "68"}, {"input": "What is 1 + 2?", "output": " 3"}]
    (first, second), _ = sft_examples.tokenize_pairs(records, tokenizer, use_chat_template=chat)
    prompt = prompt_format.prompt_token_ids(tokenizer, ["What is 23 + 45?"], use_chat_template=chat)[0]
    # Plain: one space joins them and end of text ends it, " 68<|end_of_text|>". Chat: the template's reply,
    # "68<|eot_id|>"; its role headers belong to the prompt and carry no loss.
    response = ids_of(tokenizer, "68") + [EOT_ID] if chat else ids_of(tokenizer, " 68") + [EOS_ID]
    assert first.input_ids == prompt + response
    assert first.labels == [IGNORE] * len(prompt) + response
    # " 3" is not given a second space; a chat reply is trimmed.
    assert tokenizer.decode(second.input_ids).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n3<|eot_id|>" if chat else "What is 1 + 2? 3<|end_of_text|>")
    second_response = ids_of(tokenizer, "3") + [EOT_ID] if chat else ids_of(tokenizer, " 3") + [EOS_ID]

    batch = sft_batches.Collator("packing", 64, PAD_ID)([[first, second]])
    # Position t predicts token t + 1 of the same example, and only where that token is a response token.
    expected = [IGNORE] * (len(prompt) - 1) + response + [IGNORE]
    expected += [IGNORE] * (len(second.input_ids) - len(second_response) - 1) + second_response + [IGNORE]
    expected += [IGNORE] * (64 - len(expected))
    assert batch["targets"][0].tolist() == expected  # the first example's end token never predicts the next BOS
    positions = batch["position_ids"][0].tolist()
    assert positions[:first.length] == list(range(first.length))
    assert positions[first.length:first.length + second.length] == list(range(second.length))
    assert int(batch["tokens"]) == first.length + second.length
    assert int(batch["target_tokens"]) == len(response) + len(second_response)


def test_records_without_a_usable_pair_are_listed_not_silently_dropped(tokenizer):
    records = [{"input": "What is 1 + 1?", "output": "2"}, {"input": "What is 2 + 2?"}, {"question": "x", "output": "y"}]
    examples, report = sft_examples.tokenize_pairs(records, tokenizer, use_chat_template=False,
                                               sources=["f.jsonl:1", "f.jsonl:2", "f.jsonl:3"])
    assert len(examples) == 1
    assert report.skipped == ["f.jsonl:2: field 'output' is missing", "f.jsonl:3: field 'input' is missing"]


@pytest.mark.parametrize("bad", [{"input": "What is 2 + 2?"}, {"input": "What is 2 + 2?", "output": 4},
                                 {"input": None, "output": "4"}], ids=["missing", "a number", "null"])
def test_on_bad_line_fail_stops_at_a_record_without_its_fields_and_names_it(tmp_path, bad):
    # It used to leave the record out and train on, exit 0: 'fail' is the default, and the user's data is wrong.
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"input": "What is 1 + 1?", "output": "2"}, bad] * 3)
    with pytest.raises(jsonl.DataError, match=r"pairs.jsonl:2: field '(input|output)' is .*on_bad_line: skip"):
        training.prepare_data(make_config(tmp_path, path))
    assert len(training.prepare_data(make_config(tmp_path, path, on_bad_line="skip")).train) == 3


# flex_attention is what packed rows run on CUDA. Its forward runs on CPU too, so the BlockMask transformers
# builds from the restarts is checked here, through torch's eager flex attention: compiling the mask and the
# kernel for CPU takes 40 s on a cold cache and checks a CPU kernel the GPU never runs.
@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_a_packed_row_gives_the_logits_and_loss_of_its_examples_run_alone(tiny_model_path, tokenizer, attention,
                                                                          monkeypatch):
    if attention == "flex_attention":
        import transformers.integrations.flex_attention as flex_integration
        import transformers.masking_utils as masking_utils
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        monkeypatch.setattr(masking_utils, "create_block_mask",
                            lambda *args, **kwargs: create_block_mask(*args, **{**kwargs, "_compile": False}))
        monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention",
                            lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention).eval()
    records = [{"input": "What is 23 + 45?", "output": "68"}, {"input": "What is 7 - 3?", "output": "4"},
               {"input": "What is 99 + 99?", "output": "198"}]
    examples, _ = sft_examples.tokenize_pairs(records, tokenizer, use_chat_template=False)
    packed = sft_batches.Collator("packing", 64, PAD_ID)([examples])
    with torch.no_grad():
        packed_logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        start, alone_loss = 0, 0.0
        for example in examples:
            alone = sft_batches.Collator("length_grouped", 64, PAD_ID)([[example]])
            logits = model(input_ids=alone["input_ids"], position_ids=alone["position_ids"], use_cache=False).logits
            torch.testing.assert_close(packed_logits[0, start:start + example.length], logits[0], atol=2e-5, rtol=1e-5)
            alone_loss += float(sft_batches.loss_sum(model, alone, torch.device("cpu")))
            start += example.length
        packed_loss = float(sft_batches.loss_sum(model, packed, torch.device("cpu")))
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)


def test_flex_attention_under_mixed_precision_takes_autocasts_dtype_as_sdpa_does(tiny_model_path, monkeypatch):
    """Mixed precision: fp32 weights under bf16 autocast. The rotary embedding turns query and key back
    into fp32 while value stays bf16; flex attention (packed rows on CUDA) is not covered by autocast in
    every torch release, so it is registered to take all three in bf16, as sdpa does: the same logits."""
    import transformers.integrations.flex_attention as flex_integration
    import transformers.masking_utils as masking_utils
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from workbook.training import packed_attention
    dtypes = []

    def eager_flex(query, key, value, training=False, **kwargs):  # eager on CPU, as in the test above
        dtypes.append({query.dtype, key.dtype, value.dtype})
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(masking_utils, "create_block_mask",
                        lambda *args, **kwargs: create_block_mask(*args, **{**kwargs, "_compile": False}))
    monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", eager_flex)
    packed_attention.register()
    ids = torch.randint(3, 20, (1, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(20), torch.arange(12)])[None]  # two packed examples
    logits = {}
    for attention in ("flex_attention", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # no flex backward on CPU
            logits[attention] = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    assert dtypes and all(seen == {torch.bfloat16} for seen in dtypes)
    # bf16 rounding: 10 of 10,240 logits of the BPE tiny model differ by up to 0.16 (its logits run larger)
    torch.testing.assert_close(logits["flex_attention"], logits["sdpa"], atol=0.25, rtol=0.05)


def test_packing_reaches_every_attention_kernel_as_separate_sequences(tiny_model_path, tokenizer):
    from transformers.modeling_flash_attention_utils import _is_packed_sequence
    from transformers.masking_utils import find_packed_sequence_indices
    records = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(6)]
    examples, _ = sft_examples.tokenize_pairs(records, tokenizer, use_chat_template=False)
    rows = [examples[:3], examples[3:]]
    batch = sft_batches.Collator("packing", 64, PAD_ID)(rows)
    # sdpa/eager: the mask builder sees the restarts in every row (only without attention mask and cache).
    assert find_packed_sequence_indices(batch["position_ids"])[0, -1] >= 3
    # flash-attention-2 only unpacks a batch of one row: two rows would silently attend across examples...
    assert not _is_packed_sequence(batch["position_ids"], batch_size=2)
    flat = sft_batches.Collator("packing", 64, PAD_ID, flatten=True)(rows)
    assert flat["input_ids"].shape == (1, 128) and _is_packed_sequence(flat["position_ids"], batch_size=1)
    # ...and the flattened row means the same as the two rows (checked with sdpa, which runs on CPU).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        two_rows = float(sft_batches.loss_sum(model, batch, torch.device("cpu")))
        one_row = float(sft_batches.loss_sum(model, flat, torch.device("cpu")))
    assert one_row == pytest.approx(two_rows, rel=1e-5)


@pytest.mark.parametrize("chunk_tokens", [7, 64, 1000])  # not dividing the 128 positions, one row, all of them
def test_the_chunked_loss_equals_the_full_loss_in_value_and_gradients(tiny_model_path, tokenizer, chunk_tokens):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).train()
    records = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(6)]
    examples, _ = sft_examples.tokenize_pairs(records, tokenizer, use_chat_template=False)
    batch = sft_batches.Collator("packing", 64, PAD_ID)([examples[:3], examples[3:]])  # prompt and padding: ignored
    losses, gradients = {}, {}
    for chunk in (0, chunk_tokens):
        model.zero_grad()
        loss = sft_batches.loss_sum(model, batch, torch.device("cpu"), loss_chunk_tokens=chunk)
        (loss * 0.25).backward()  # the loop scales the sum (by the batch's loss tokens): backward must carry that
        losses[chunk] = loss.item()
        gradients[chunk] = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert losses[chunk_tokens] == pytest.approx(losses[0], rel=1e-6)
    for name, gradient in gradients[0].items():
        # fp32 sums in another order (chunks, and two threads): 2e-6 apart on gradients of ~0.03
        torch.testing.assert_close(gradients[chunk_tokens][name], gradient, atol=1e-5, rtol=1e-4, msg=name)


def test_the_chunked_loss_computes_logits_only_where_a_target_carries_loss():
    # Prompt tokens, padding and each example's last token carry no loss: their logits are work thrown
    # away (a fifth of a Llama-3.2-1B step per prompt token). Forward, backward's recompute, and the two
    # gradient matmuls: 4 x 2 x H x V FLOPs per loss position, none for the others.
    from torch.utils.flop_counter import FlopCounterMode
    from workbook.training.chunked_loss import ChunkedCrossEntropy
    positions, hidden_size, vocab, kept = 96, 16, 50, 20
    hidden = torch.randn(positions, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.full((positions,), -100)
    targets[torch.randperm(positions)[:kept]] = torch.randint(0, vocab, (kept,))
    with FlopCounterMode(display=False) as counter:
        loss = ChunkedCrossEntropy.apply(hidden, weight, targets, 7, torch.float32)
        loss.backward()
    assert counter.get_total_flops() == 4 * 2 * kept * hidden_size * vocab
    full = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)


def test_a_run_with_the_chunked_loss_trains_as_the_full_loss_does(tmp_path):
    path = arithmetic_pairs(tmp_path)
    full = training.train(make_config(tmp_path / "full", path))
    chunked = training.train(make_config(tmp_path / "chunked", path, loss_chunk_tokens=16))
    assert [r["loss"] for r in chunked["history"]] == pytest.approx([r["loss"] for r in full["history"]], rel=1e-5)
    assert chunked["settings"]["loss"] == ("chunked cross-entropy, 16 loss positions per chunk, no logits where no "
                                           "target carries loss (pure PyTorch)")


def test_packed_training_without_a_mask_gives_the_losses_of_the_4d_mask_path(tmp_path, monkeypatch):
    from workbook.training import packed_attention
    path = arithmetic_pairs(tmp_path)
    no_mask = training.train(make_config(tmp_path / "no_mask", path, max_steps=3))
    assert no_mask["model_description"].endswith("attention document_sdpa")  # packing on CPU: per-example sdpa, no mask
    # The fallback: transformers' block-causal 4D mask from the restarting position ids, through sdpa.
    monkeypatch.setattr(packed_attention, "training_attention_for", lambda config, seq_len: "sdpa_block_mask")
    masked = training.train(make_config(tmp_path / "masked", path, max_steps=3))
    assert masked["model_description"].endswith("attention sdpa_block_mask")
    assert [r["loss"] for r in no_mask["history"]] == pytest.approx([r["loss"] for r in masked["history"]], rel=1e-5)


@pytest.mark.slow
def test_a_compiled_run_trains_as_the_eager_one_does(tmp_path):
    # The GPU sweep's compile points go through accelerate's inductor backend; on CPU it compiles in about
    # 20 s, so what breaks under dynamo (the chunked loss, checkpointing, the mask-free packed attention)
    # shows here first.
    path = arithmetic_pairs(tmp_path)
    settings = {"max_steps": 3, "loss_chunk_tokens": 32, "grad_checkpointing": True}
    eager = training.train(make_config(tmp_path / "eager", path, **settings))
    torch._dynamo.utils.counters.clear()
    compiled = training.train(make_config(tmp_path / "compiled", path, torch_compile=True, **settings))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert [r["loss"] for r in compiled["history"]] == pytest.approx([r["loss"] for r in eager["history"]], rel=1e-4)


def test_auto_max_seq_length_covers_the_data_and_truncation_is_reported(tmp_path, tokenizer):
    assert sft_examples.auto_max_seq_length([10, 50, 64, 65, 130, 200]) == 256
    assert sft_examples.auto_max_seq_length([10, 50, 64, 65, 130, 200], percentile=50) == 64
    records = [{"input": f"Question {i}?", "output": "x" * (3 * i + 1)} for i in range(60)]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    prepared = training.prepare_data(make_config(tmp_path, path, use_chat_template=False, validation_fraction=0.1))
    longest = prepared.length_stats["max"]
    assert prepared.max_seq_length % 64 == 0 and longest <= prepared.max_seq_length < longest + 64
    assert prepared.truncation["truncated"] == 0
    assert all(e.length <= prepared.max_seq_length for e in prepared.train + prepared.validation)
    assert (len(prepared.train), len(prepared.validation)) == (54, 6)

    half = training.prepare_data(make_config(tmp_path, path, length_percentile=50.0))
    too_long = sum(length > half.max_seq_length for length in half.lengths)
    assert too_long > 0 and half.truncation["truncated"] == too_long  # counted, never hidden
    assert half.max_seq_length == sft_examples.auto_max_seq_length(half.lengths, 50)


def test_packing_and_length_grouping_use_every_example_once_and_report_their_padding():
    lengths = [5 + (i * 37) % 58 for i in range(200)]
    rows = sft_batches.plan_rows(lengths, "packing", 64)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    batches = sft_batches.epoch_micro_batches(rows, lengths, "packing", micro_batch_size=8, seed=0, epoch=1)
    assert sorted(row for batch in batches for row in batch) == sorted(rows)
    assert sft_batches.padding_fraction(batches, lengths, "packing", 64) == pytest.approx(1 - sum(lengths) / (len(rows) * 64))
    # Each epoch has its own order, the same again for the same seed and epoch (a resume rebuilds it).
    again = lambda epoch: sft_batches.epoch_micro_batches(rows, lengths, "packing", micro_batch_size=8, seed=0, epoch=epoch)
    assert again(1) == batches and again(2) != batches

    single = sft_batches.plan_rows(lengths, "length_grouped", 64)
    grouped = sft_batches.epoch_micro_batches(single, lengths, "length_grouped", micro_batch_size=8, seed=0, epoch=0)
    assert sorted(i for batch in grouped for row in batch for i in row) == list(range(200))
    widths = [max(lengths[i] for row in batch for i in row) for batch in grouped]
    assert widths[0] == max(lengths)  # the longest batch first: an out-of-memory shows at step 1
    comparison = sft_batches.padding_comparison(lengths, 64, 8, seed=0)
    assert comparison["length_grouped"] < comparison["pad_to_max_seq_length"]
    assert comparison["packing"] < comparison["pad_to_max_seq_length"]


def test_truncation_keeps_the_prompt_cuts_the_end_of_the_response_and_drops_examples_left_without_one():
    example = lambda prompt, response, source: sft_examples.TokenizedExample(
        list(range(prompt + response)), [IGNORE] * prompt + list(range(prompt, prompt + response)), source)
    long_answer, exact, no_answer_left = example(6, 4, "a"), example(5, 3, "b"), example(9, 2, "c")
    kept, report = sft_examples.truncate([long_answer, exact, no_answer_left], 8)
    # The model still sees the whole question and learns the start of the answer, not its end.
    assert kept[0].input_ids == list(range(8)) and kept[0].labels == [IGNORE] * 6 + [6, 7]
    assert kept[1] is exact  # exactly max_seq_length tokens: untouched, not counted as truncated
    # Cut inside the prompt, "c" has no loss token left: it is removed, and the report says so.
    assert [e.source for e in kept] == ["a", "b"]
    assert report.to_dict() == {"max_seq_length": 8, "truncated": 2, "dropped": 1, "tokens_cut": 2 + 3}


def test_length_statistics_use_nearest_rank_percentiles_that_cover_the_examples():
    lengths = list(range(1, 11))
    # p95 of ten examples is the longest one: nine of them (90%) do not reach 95%.
    assert [sft_examples.length_percentile(lengths, p) for p in (10, 50, 95, 100)] == [1, 5, 10, 10]
    stats = sft_examples.length_statistics([10, 10, 40])
    assert (stats["min"], stats["median"], stats["max"], stats["mean"], stats["total_tokens"]) == (10, 10, 40, 20, 60)


def test_a_validation_split_holds_out_at_least_one_example_and_leaves_at_least_one_to_train_on():
    train, validation = sft_examples.split_validation(5, 0.05, seed=0)  # 5% of 5 rounds to 0: one is held out anyway
    assert len(validation) == 1 and sorted(train + validation) == list(range(5))
    train, validation = sft_examples.split_validation(3, 0.9, seed=0)
    assert (len(train), len(validation)) == (1, 2)
    assert sft_examples.split_validation(5, 0.0, seed=0) == (list(range(5)), [])


def test_first_fit_packing_fills_a_row_exactly_and_takes_an_example_of_exactly_max_seq_length():
    # Longest first: 64 fills a row alone; 24 completes the 40's row exactly rather than opening the 30's.
    assert sft_batches.plan_rows([40, 24, 64, 30], "packing", 64) == [(2,), (0, 1), (3,)]
    with pytest.raises(jsonl.DataError, match="longer than max_seq_length=64"):
        sft_batches.plan_rows([65], "packing", 64)


@pytest.mark.parametrize("padding", sft_batches.PADDINGS)
def test_the_last_partial_micro_batch_of_an_epoch_is_trained_on_not_dropped(padding):
    lengths = [10 + i for i in range(21)]
    rows = sft_batches.plan_rows(lengths, padding, 30)
    batches = sft_batches.epoch_micro_batches(rows, lengths, padding, micro_batch_size=len(rows) // 3 + 1, seed=0, epoch=0)
    assert sorted(row for batch in batches for row in batch) == sorted(rows)  # each row once, the remainder too


def test_the_collator_pads_each_row_to_the_longest_and_positions_padding_as_the_docstring_says():
    short = sft_examples.TokenizedExample([5, 6, 7], [IGNORE, 6, 7], "short")
    long = sft_examples.TokenizedExample([5, 6, 7, 8, 9], [IGNORE, IGNORE, 7, 8, 9], "long")
    # Length grouping: the micro-batch is as wide as its longest row, whichever row that is.
    grouped = sft_batches.Collator("length_grouped", 64, PAD_ID)([[short], [long]])
    assert grouped["input_ids"].tolist() == [[5, 6, 7, PAD_ID, PAD_ID], [5, 6, 7, 8, 9]]
    assert grouped["position_ids"][0].tolist() == [0, 1, 2, 3, 4]  # an unpacked row keeps plain causal positions
    assert grouped["targets"][0].tolist() == [6, 7, IGNORE, IGNORE, IGNORE]
    # Packing: padding is one more sequence of its own, its positions restarting at 0.
    packed = sft_batches.Collator("packing", 10, PAD_ID)([[short, long]])
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    # The attention-FLOPs term counts each example's own length squared, never the row's or the padding's.
    assert int(packed["length_squares"]) == int(grouped["length_squares"]) == 3 * 3 + 5 * 5
    assert int(packed["tokens"]) == 8


def test_a_bad_line_in_the_training_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": \n')
    with pytest.raises(jsonl.DataError, match=r"pairs.jsonl:2: not valid JSON.*set on_bad_line: skip") as error:
        training.prepare_data(make_config(tmp_path, str(path)))
    assert "failures file" not in str(error.value)  # training writes none: it lists skipped lines itself


def test_on_bad_line_skip_trains_without_bad_lines_and_says_what_it_left_out(tmp_path):
    good = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(6)]
    lines = [json.dumps(record) for record in good[:3]] + ['{"input": "cut off', "[1, 2]"]
    lines += [json.dumps(record) for record in good[3:]] + [json.dumps({"input": "What is 9 + 9?", "output": ""})]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    console = []
    prepared = training.prepare_data(make_config(tmp_path, str(path), on_bad_line="skip"), log=console.append)
    assert len(prepared.train) == 6  # every good record, nothing else
    skipped_line, empty_output_line = console
    assert skipped_line.startswith(f"skipped 2 bad line(s) (on_bad_line: skip): {path}:4: not valid JSON (")
    assert skipped_line.endswith(f"; {path}:5: a JSON list, not an object")
    assert empty_output_line == (f"left out 1 record(s) without a non-empty 'input' and 'output' string: "
                                 f"{path}:9: field 'output' is ''")
    summary = prepared.summary()  # what training_metrics.json keeps
    assert summary["bad_lines"]["skipped"] == 2 and summary["bad_lines"]["skipped_first"][1].startswith(f"{path}:5:")
    assert summary["formatting"]["skipped"] == 1

    path.write_text('{"input": "cut off\n')
    with pytest.raises(training.TrainError, match=r"no records \(every non-blank line is bad: .*pairs.jsonl:1"):
        training.prepare_data(make_config(tmp_path, str(path), on_bad_line="skip"))


def test_the_bad_line_policy_comes_from_the_params(tmp_path):
    profile = params.load_all()["cpu"]
    assert training.config_from_params(profile, tmp_path).on_bad_line == "fail"
    assert training.config_from_params({**profile, "on_bad_line": "skip"}, tmp_path).on_bad_line == "skip"


def test_held_out_questions_are_read_before_the_model_loads_and_must_be_the_arithmetic_task(tmp_path):
    profile = params.load_all()["cpu"]
    config = training.config_from_params(profile, tmp_path)  # the shipped held-out file, found from the repo root
    assert config.eval_prompts_path == str(arithmetic.VARIANT_HELD_OUT_PATH)
    prepared = training.prepare_data(dataclasses.replace(config, data_path=arithmetic_pairs(tmp_path)))
    assert prepared.accuracy_records == arithmetic.load_prompts(arithmetic.VARIANT_HELD_OUT_PATH)
    assert prepared.accuracy_source == f"held-out prompts of {arithmetic.VARIANT_HELD_OUT_PATH}"
    assert training.config_from_params({**profile, "eval_prompts_path": ""}, tmp_path).eval_prompts_path == ""

    with pytest.raises(training.TrainError, match=r"eval_prompts_path 'nope.jsonl': no such file"):
        training.config_from_params({**profile, "eval_prompts_path": "nope.jsonl"}, tmp_path)
    with pytest.raises(training.TrainError, match=r"eval_prompts_path '.*': a folder, not a file"):
        training.config_from_params({**profile, "eval_prompts_path": str(tmp_path)}, tmp_path)
    other_task = write_jsonl(tmp_path / "questions.jsonl", [{"input": "What is 1 + 2?"}, {"input": "Name a colour."}])
    with pytest.raises(training.TrainError, match=r"questions.jsonl:2: eval_prompts_path holds held-out questions"):
        training.prepare_data(dataclasses.replace(config, data_path=arithmetic_pairs(tmp_path),
                                                  eval_prompts_path=other_task))


# ----------------------------------------------------------------------------------------------
# Learning rate, FLOPs, params.


def test_learning_rate_scaling_heuristics_apply_only_when_the_effective_batch_changes():
    assert run_plan.scaled_learning_rate(3e-4, 128, 512, "linear") == pytest.approx(1.2e-3)
    assert run_plan.scaled_learning_rate(3e-4, 128, 512, "sqrt") == pytest.approx(6e-4)  # not seed 004's 5e-4
    assert run_plan.scaled_learning_rate(3e-4, 128, 512, "none") == 3e-4
    assert run_plan.scaled_learning_rate(3e-4, 0, 512, "sqrt") == 3e-4  # base 0: tuned at this run's batch
    assert run_plan.scaled_learning_rate(3e-4, 512, 512, "linear") == 3e-4
    with pytest.raises(training.TrainError, match="lr_scaling 'cube'"):
        run_plan.scaled_learning_rate(3e-4, 128, 512, "cube")


def test_model_flops_follow_torchtitan_with_the_tied_output_projection_counted():
    from workbook import presets
    tiny = presets.load_config("tiny")
    per_token, per_square = run_plan.model_flops_coefficients(tiny, lora=False)
    assert per_token == 6 * presets.count_parameters(tiny)  # tied: the one matrix is the lm_head's matmul
    assert per_square == 12 * 4 * 4 * 32  # layers x heads x head_dim
    llama_8b = presets.load_config("llama-3.1-8b")  # untied: the input embedding table costs no FLOPs
    per_token, per_square = run_plan.model_flops_coefficients(llama_8b, lora=True)
    assert per_token == 4 * (presets.count_parameters(llama_8b) - 128256 * 4096)
    assert per_square == 12 * 32 * 32 * 128


def test_every_profile_gives_a_training_config_and_notebook_03_declares_every_key(tmp_path):
    import papermill
    declared = set(papermill.inspect_notebook(str(NOTEBOOKS_DIR / "03_training.ipynb")))
    assert set(training.PARAMS_USED) <= declared
    for name, profile in params.load_all().items():
        config = training.config_from_params(profile, tmp_path)
        assert config.output_dir == str(tmp_path / "training")
        assert config.processes == (8 if name == "h100x8" else 1), name
    # The schema's choices are the ones the code implements.
    assert params.SCHEMA["optimizer"].choices == planner.OPTIMIZERS
    assert params.SCHEMA["attn_implementation"].choices == planner.ATTENTION_IMPLEMENTATIONS
    assert params.SCHEMA["padding"].choices == sft_batches.PADDINGS
    assert params.SCHEMA["lr_scaling"].choices == run_plan.LR_SCALING_RULES


def test_a_training_configs_defaults_are_the_schemas_and_every_key_it_takes_reaches_it(tmp_path):
    # No second set of defaults: a TrainConfig built in code (a benchmark point, a test) trains as a
    # profile that leaves the key out would.
    defaults = params.defaults()
    config = training.TrainConfig(model="tiny", data_path="", data_description="", output_dir="")
    taken = config_module.params_fields()
    assert {"epochs", "micro_batch_size", "warmup_steps", "use_chat_template", "learning_rate"} <= set(taken)
    assert taken["processes"] == "train_processes"
    for name, key in taken.items():
        assert getattr(config, name) == defaults[key], name
    # Each field comes from its key: a profile with every such key changed gives a config with each changed.
    changed = {**defaults, "epochs": 7, "micro_batch_size": 3, "warmup_steps": 5, "use_chat_template": False,
               "learning_rate": 3e-4, "train_processes": 2, "dtype": "fp32", "report_to": "tensorboard",
               "peer_timeout_seconds": 30.0, "eval_prompts_path": ""}
    built = training.config_from_params(changed, tmp_path)
    assert {name: getattr(built, name) for name in taken} == {name: changed[key] for name, key in taken.items()}
    # ... and every key a training config takes is one the train job declares it reads.
    assert set(taken.values()) <= set(training.PARAMS_USED)


def test_a_preset_trains_on_synthetic_sequences_of_exactly_max_seq_length(tmp_path):
    with pytest.raises(training.TrainError, match="set max_seq_length"):
        training.prepare_data(make_config(tmp_path, model="llama-3.2-1b", max_seq_length="auto"))
    prepared = training.prepare_data(make_config(tmp_path, model="llama-3.2-1b", max_seq_length=128,
                                              synthetic_examples=16, validation_fraction=0.25))
    # 16 sequences, 4 held out, each cut into documents of 64, 32, 16 and 16 tokens: packed SFT rows, whose
    # position ids restart at each document (the attention path packing takes, and the one planned).
    assert (len(prepared.train), len(prepared.validation)) == (12 * 4, 4 * 4)
    assert sorted(e.length for e in prepared.train[:4]) == [16, 16, 32, 64]
    assert max(max(e.input_ids) for e in prepared.train) < 128256 and prepared.tokenize_report["synthetic"]
    lengths = [e.length for e in prepared.train]
    rows = sft_batches.plan_rows(lengths, "packing", 128)
    # Packed back into 12 full rows (first-fit decreasing: two halves, four quarters or eight eighths a row).
    assert len(rows) == 12 and all(sum(lengths[i] for i in row) == 128 and len(row) >= 2 for row in rows)
    position_ids = sft_batches.Collator("packing", 128, 0)([[prepared.train[i] for i in rows[0]]])["position_ids"]
    assert (position_ids[0] == 0).sum() == len(rows[0])


def test_a_preset_architecture_trains_with_random_weights_for_benchmarks(tmp_path, monkeypatch):
    # What a GPU session runs as `--set model=llama-3.2-1b max_seq_length=2048`, shrunk to a CPU-sized preset.
    from workbook import presets
    small = {**presets.PRESETS["Llama-3.2-1B"], "_name_or_path": "test/Small-Llama", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 512}
    monkeypatch.setitem(presets.PRESETS, "Small-Llama", small)
    result = training.train(make_config(tmp_path, model="small-llama", max_seq_length=64, synthetic_examples=8,
                                     validation_fraction=0.25))
    assert result["status"] == "finished" and result["model_description"].startswith("small-llama: preset architecture")
    assert all(r["tokens"] == 2 * 64 for r in result["history"])  # full rows: nothing to pad
    assert result["output"]["final_model_dir"] is None  # random weights are not worth saving
    assert result["accuracy"]["after"] is None and result["loss"]["eval_before"] is not None


# ----------------------------------------------------------------------------------------------
# Training runs (tiny model, a few steps each).


def test_loss_falls_when_overfitting_a_few_examples(tmp_path):
    words = ["zebra", "quartz", "violin", "meadow", "copper", "lantern", "orbit", "thimble"]
    path = write_jsonl(tmp_path / "few.jsonl", [{"input": f"Word {i}:", "output": w} for i, w in enumerate(words)])
    config = make_config(tmp_path, path, micro_batch_size=4, learning_rate=3e-3, max_steps=0, epochs=15)
    result = training.train(config)
    epochs = result["loss"]["epoch_means"]  # one step per epoch: all 8 examples in 2 packed rows
    assert len(epochs) == 15 and result["steps"]["reached"] == 15
    assert epochs[-1] < 0.5 * epochs[0] and epochs[-1] == min(epochs), epochs  # measured: 6.6 -> 2.2 nats
    assert result["throughput"]["tokens_per_second"] > 0
    assert result["throughput"]["mfu"] is None and result["throughput"]["mfu_note"].startswith("n/a")
    final = tmp_path / "out" / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()


def test_the_before_and_after_figures_are_measured_after_training_not_carried_over(tmp_path):
    # The tiny model answers the arithmetic task well; trained on answers that are all one too high,
    # its validation loss on such answers falls and its accuracy against the true answers collapses.
    wrong = [{**r, "output": str(int(r["output"]) + 1)} for r in arithmetic.sample_records()[:64]]
    path = write_jsonl(tmp_path / "wrong.jsonl", wrong)
    result = training.train(make_config(tmp_path, path, validation_fraction=0.25, micro_batch_size=8,
                                        learning_rate=1e-3, max_steps=12, use_chat_template=True))
    assert result["loss"]["eval_after"] < result["loss"]["eval_before"]
    accuracy = result["accuracy"]
    assert accuracy["before"]["records"] == accuracy["after"]["records"] == 16
    assert accuracy["before"]["accuracy"] >= 0.75 and accuracy["after"]["accuracy"] <= 0.25, accuracy


def test_mfu_is_the_achieved_flops_over_every_gpus_dense_peak_after_the_warm_up_steps():
    from types import SimpleNamespace
    from workbook.training import report
    # 8 GPUs at the H100's dense bf16 peak; the first steps (compilation, warm-up) are slow and left out.
    warm_up = [{"tokens": 1000, "seconds": 10.0, "flops": 1e15}] * report.TIMING_WARMUP_STEPS
    steps = warm_up + [{"tokens": 1000, "seconds": 1.0, "flops": 1e15}] * 4
    config = SimpleNamespace(peak_bf16_tflops=989.5, peak_fp16_tflops=989.5, dtype="bf16", profile="h100x8")
    figures = report.throughput(steps, config, processes=8, on_gpu=True)
    assert figures["achieved_tflops"] == pytest.approx(1000.0)
    assert figures["mfu"] == pytest.approx(1000 / (989.5 * 8))
    assert "989.5 dense bf16 TFLOP/s x 8 GPU(s)" in figures["mfu_note"]
    fp32 = report.throughput(steps, SimpleNamespace(**{**vars(config), "dtype": "fp32"}), processes=8, on_gpu=True)
    assert fp32["mfu"] is None and "no dense fp32 peak" in fp32["mfu_note"]


def test_lora_trains_adapters_of_the_size_the_planner_counts_and_saves_only_them(tmp_path, tiny_model_path):
    path = arithmetic_pairs(tmp_path)
    # lora_save: adapters (the default, merged, is tested in test_real_tokenizer.py).
    result = training.train(make_config(tmp_path, path, lora_rank=4, learning_rate=1e-2, max_steps=3,
                                        lora_save="adapters"))
    assert result["status"] == "finished" and "LoRA rank 4" in result["model_description"]
    final = tmp_path / "out" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "tokenizer.json").is_file()
    assert not (final / "model.safetensors").exists()  # the frozen base is not saved again
    adapters = load_file(final / "adapter_model.safetensors")
    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_path).config
    assert sum(t.numel() for t in adapters.values()) == planner.lora_parameter_count(tiny, 4)
    # B starts at zero (the adapted model starts as the base): non-zero B means the adapters trained.
    trained_b = [name for name, t in adapters.items() if "lora_B" in name and t.abs().sum() > 0]
    assert len(trained_b) == len(adapters) // 2


def arithmetic_pairs(tmp_path, count=24):
    records = [{"input": f"What is {i} + {2 * i}?", "output": str(3 * i)} for i in range(count)]
    return write_jsonl(tmp_path / "pairs.jsonl", records)


def test_tensorboard_gets_the_loss_learning_rate_grad_norm_and_throughput_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    result = training.train(make_config(tmp_path, arithmetic_pairs(tmp_path), max_steps=3, report_to="tensorboard"))
    events = EventAccumulator(str(tmp_path / "out" / "tracking" / "training")).Reload()
    for name, key in [("train/loss", "loss"), ("train/learning_rate", "learning_rate"),
                      ("train/grad_norm", "grad_norm"), ("train/tokens_per_second", "tokens_per_second")]:
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [1, 2, 3], name
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in result["history"]], rel=1e-5), name
    assert "train/mfu" not in events.Tags()["scalars"]  # CPU: no peak to measure against, nothing invented


def test_report_to_wandb_without_wandb_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(training.TrainError, match="report_to: wandb needs the package wandb"):
        training.train(make_config(tmp_path, report_to="wandb"))
    assert not (tmp_path / "out").exists()


def test_pure_bf16_training_keeps_bf16_weights_and_adamw_states(tmp_path):
    path = arithmetic_pairs(tmp_path)
    result = training.train(make_config(tmp_path, path, dtype="bf16", precision="bf16", max_steps=2, save_every_steps=2))
    assert result["status"] == "finished" and result["settings"]["mixed_precision"] == "no"
    assert {t.dtype for t in load_file(tmp_path / "out" / "final" / "model.safetensors").values()} == {torch.bfloat16}
    optimizer = torch.load(checkpoints.latest_checkpoint(tmp_path / "out") / "optimizer.bin", weights_only=True)
    moments = [state[name] for state in optimizer["state"].values() for name in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}  # 2 + 2 B per parameter, as planned


def test_pure_bf16_on_an_fp32_model_is_refused_with_what_to_set(tmp_path):
    with pytest.raises(training.TrainError, match="precision: bf16 .* needs dtype: bf16"):
        training.train(make_config(tmp_path, precision="bf16"))


def test_resume_continues_from_the_saved_step_with_the_same_optimizer_state(tmp_path):
    path = arithmetic_pairs(tmp_path)
    settings = dict(max_steps=4, save_every_steps=2, micro_batch_size=2)
    interrupted = training.train(make_config(tmp_path / "a", path, stop_after_steps=2, **settings))
    assert interrupted["status"].startswith("stopped at step 2")
    checkpoint = checkpoints.latest_checkpoint(tmp_path / "a" / "out")
    assert checkpoint.name == "step-00000002"
    saved_optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert {float(state["step"]) for state in saved_optimizer["state"].values()} == {2.0}

    resumed = training.train(make_config(tmp_path / "a", path, **settings))
    straight = training.train(make_config(tmp_path / "c", path, **settings))
    assert resumed["steps"] == {"total": 4, "resumed_from": 2, "reached": 4}
    resumed_losses = [r["loss"] for r in resumed["history"]]
    assert resumed_losses == pytest.approx([r["loss"] for r in straight["history"]], rel=1e-6, abs=1e-7)
    resumed_weights = load_file(tmp_path / "a" / "out" / "final" / "model.safetensors")
    straight_weights = load_file(tmp_path / "c" / "out" / "final" / "model.safetensors")
    for name, tensor in straight_weights.items():  # wrong moments or data position would move these
        torch.testing.assert_close(resumed_weights[name], tensor, atol=1e-6, rtol=1e-5)

    with pytest.raises(training.TrainError, match=r"other settings or data: learning_rate 0.001 \(now 0.0005\)"):
        training.train(make_config(tmp_path / "a", path, **{**settings, "learning_rate": 5e-4}))


def test_a_damaged_checkpoint_is_named_with_the_older_one_to_resume_from_and_nothing_is_deleted(tmp_path):
    path = arithmetic_pairs(tmp_path)
    settings = dict(max_steps=4, save_every_steps=1, micro_batch_size=2)
    training.train(make_config(tmp_path, path, stop_after_steps=3, **settings))
    newest, older = checkpoints.checkpoint_dir(tmp_path / "out", 3), checkpoints.checkpoint_dir(tmp_path / "out", 2)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    with pytest.raises(training.TrainError, match=rf"cannot resume from {newest}, it is damaged \(SafetensorError: .*"
                                                  rf"move {newest} away to resume from the older checkpoint kept, "
                                                  "step-00000002"):
        training.train(make_config(tmp_path, path, **settings))
    state = newest / checkpoints.STATE_FILE
    state.write_text('{"step": ')
    with pytest.raises(training.TrainError, match=rf"{newest}, it is damaged \({checkpoints.STATE_FILE}: Expecting"):
        training.train(make_config(tmp_path, path, **settings))
    assert weights.exists() and older.is_dir()  # nothing deleted
    newest.rename(tmp_path / "damaged")  # as the message says: the older checkpoint resumes
    assert training.train(make_config(tmp_path, path, **settings))["steps"] == {"total": 4, "resumed_from": 2, "reached": 4}


def test_workbook_train_cli_trains_into_a_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_folder, "OUTPUTS_DIR", tmp_path)
    code = cli.main(["train", "--params", "cpu", "--set", "max_steps=2", "validation_fraction=0.05",
                     "length_percentile=90"])
    out = capsys.readouterr().out
    assert code == 0, out
    (run,) = [folder for folder in tmp_path.iterdir() if folder.is_dir()]
    assert f"new run folder {run} (save_every_steps is 0, no checkpoints" in out
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["steps"]["reached"] == 2
    # The cpu profile scores the rejection-sampling round's 300 held-out questions (eval_prompts_path).
    assert metrics["accuracy"]["before"]["records"] == 300
    assert metrics["accuracy"]["before"]["of"].startswith("held-out prompts of ")
    assert "training loss by epoch" in out and (run / "training" / "final" / "config.json").is_file()


def test_every_set_counts_in_python_m_workbook_training(monkeypatch, capsys):
    seen = {}

    def train_in_chosen_folder(params, wanted, params_arg, overrides):  # the real one's signature
        seen.update(params, params_arg=params_arg, overrides=overrides)
        assert wanted == run_folder.FolderSettings.from_params(params)
        return 0

    monkeypatch.setattr(training_cli, "_train_in_chosen_folder", train_in_chosen_folder)
    assert training.main(["--params", "cpu", "--set", "max_steps=3", "--set", "epochs=2", "learning_rate=0.001"]) == 0
    assert (seen["max_steps"], seen["epochs"], seen["learning_rate"]) == (3, 2, 0.001)
    assert (seen["params_arg"], seen["overrides"]) == ("cpu", ["max_steps=3", "epochs=2", "learning_rate=0.001"])
    assert training.main(["--params", "cpu", "--set", "max_steps=3", "--set", "epochs=two"]) == 2  # no traceback
    assert capsys.readouterr().err.startswith("error: --set epochs=two: 'epochs' is 'two'")


@pytest.mark.slow
def test_rerunning_the_same_train_command_resumes_the_run_it_interrupted(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_folder, "OUTPUTS_DIR", tmp_path / "outputs")
    command = ["train", "--params", "cpu", "--set", f"train_data_path={arithmetic_pairs(tmp_path)}", "max_steps=2",
               "save_every_steps=1", "micro_batch_size=2", "validation_fraction=0"]
    real_config = training_cli.config_from_params
    with monkeypatch.context() as interrupt:  # the first invocation ends after step 1, as a kill would
        interrupt.setattr(training_cli, "config_from_params",
                          lambda *args: dataclasses.replace(real_config(*args), stop_after_steps=1))
        assert cli.main(command) == 0
    (run,) = (tmp_path / "outputs").iterdir()
    assert checkpoints.latest_checkpoint(run / "training").name == "step-00000001"
    capsys.readouterr()

    assert cli.main(command) == 0  # the same command again
    out = capsys.readouterr().out
    assert f"resuming {run}: " in out and "checkpoint at step 1" in out
    assert list((tmp_path / "outputs").iterdir()) == [run]  # no new folder
    metrics = json.loads((run / "training_metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["steps"] == {"total": 2, "resumed_from": 1, "reached": 2}
    assert (run / "training" / "final" / "model.safetensors").is_file()

    assert cli.main(command) == 0  # a finished run is never resumed: the same command trains anew
    out = capsys.readouterr().out
    (new,) = set((tmp_path / "outputs").iterdir()) - {run}
    assert f"new run folder {new}" in out and "resuming" not in out
    assert json.loads((new / "training_metrics.json").read_text())["steps"]["resumed_from"] == 0


def fake_run(root, name, settings, step=None, status=None, fingerprint=None):
    """A run folder as the CLI leaves it: its command record, a checkpoint and a result if given."""
    folder = root / name
    (folder / "training").mkdir(parents=True)
    record = {"command": "workbook train", "started": name, "settings": settings}
    (folder / run_folder.COMMAND_FILE).write_text(json.dumps(record))
    if step is not None:
        checkpoint = checkpoints.checkpoint_dir(folder / "training", step)
        checkpoint.mkdir(parents=True)
        (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps({"step": step, "fingerprint": fingerprint, "history": [],
                                                                          "eval_history": []}))
    if status is not None:
        (folder / "training" / "training_result.json").write_text(json.dumps({"status": status}))
    return folder


KILLED_WHILE_SAVING = """
import os, pathlib, signal, sys, types
from workbook.training import checkpoints

class Accelerator:  # one process, as accelerate's is to checkpoints.save
    is_main_process = is_local_main_process = True
    project_configuration = types.SimpleNamespace(save_on_each_node=False)
    def save_state(self, folder):
        pathlib.Path(folder).mkdir(parents=True)
        (pathlib.Path(folder) / "model.safetensors").write_bytes(b"weights")
    def wait_for_everyone(self):
        pass

def save(step):
    checkpoints.save(Accelerator(), sys.argv[1], step, {"data": "d"}, [{"step": step, "loss": 1.0}] * 2000, [], None)

save(1)
opened = pathlib.Path.open
def open_then_die(self, *args, **kwargs):  # half the state file reaches the disk, then SIGKILL
    handle = opened(self, *args, **kwargs)
    if checkpoints.STATE_FILE not in self.name:
        return handle
    class Torn:
        def __enter__(self): return self
        def __exit__(self, *exc): return False
        def write(self, text):
            handle.write(text[:len(text) // 2]); handle.flush(); os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    return Torn()
pathlib.Path.open = open_then_die
save(2)
"""


@pytest.mark.slow
def test_a_kill_while_the_checkpoint_state_is_written_leaves_the_previous_checkpoint_to_resume(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "lib")}
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_SAVING, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (checkpoints.checkpoint_dir(tmp_path, 2) / "model.safetensors").exists()  # it died saving step 2
    latest = checkpoints.latest_checkpoint(tmp_path)
    assert latest == checkpoints.checkpoint_dir(tmp_path, 1)
    assert checkpoints.saved_state(latest)["step"] == 1  # whole, and a resume reads it


def test_only_an_unfinished_run_of_the_same_settings_with_a_checkpoint_is_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "OUTPUTS_DIR", tmp_path)
    profile = params.load_all()["cpu"]
    wanted = run_folder.FolderSettings.from_params(profile)
    settings = wanted.resumes
    interrupted = fake_run(tmp_path, "20250101-000000-cpu", settings, step=6)  # killed: no result written
    fake_run(tmp_path, "20250102-000000-cpu", {**settings, "learning_rate": 1.0}, step=4)  # other settings
    fake_run(tmp_path, "20250103-000000-cpu", settings, step=None)  # killed before its first checkpoint
    fake_run(tmp_path, "20250104-000000-cpu", settings, step=9, status="finished")
    chosen = run_folder.choose(wanted, "workbook train --params cpu")
    assert (chosen.path, chosen.created) == (interrupted, False) and "at step 6" in chosen.note

    # While it trains, a second command leaves it alone (and names who holds it) and starts anew.
    second = run_folder.choose(wanted, "workbook train --params cpu")
    assert second.created and second.path.parent == tmp_path
    assert f"{interrupted} was started by the same settings but is still training (process {os.getpid()} on " in second.note
    second.discard()
    assert not second.path.exists()  # nothing was trained there: no folder left behind
    chosen.release()
    again = run_folder.choose(wanted, "workbook train --params cpu")
    assert again.path == interrupted
    again.release()

    # Resumes by itself, one command at a time.
    explicit = run_folder.FolderSettings.from_params({**profile, "train_output_dir": str(tmp_path / "mine")})
    first = run_folder.choose(explicit, "workbook train")
    assert "train_output_dir is set" in first.note
    with pytest.raises(training.TrainError, match=r"train_output_dir .*mine is in use by process"):
        run_folder.choose(explicit, "workbook train")
    first.release()


@pytest.mark.multiprocess
def test_two_processes_on_cpu_give_the_losses_of_one_process_with_the_same_effective_batch(tmp_path):
    path = arithmetic_pairs(tmp_path, count=40)
    one = training.launch(make_config(tmp_path / "one", path, max_steps=3, gradient_accumulation_steps=2))
    two = training.launch(make_config(tmp_path / "two", path, max_steps=3, processes=2))
    assert two["settings"]["processes"] == 2 and two["settings"]["distributed_type"] == "MULTI_CPU"
    assert two["plan"]["effective_batch_rows"] == one["plan"]["effective_batch_rows"] == 4
    # The same examples per step, the loss normalised over the whole effective batch: equal up to
    # the order of floating-point sums.
    assert [r["loss"] for r in two["history"]] == pytest.approx([r["loss"] for r in one["history"]], rel=1e-4)
    assert [r["tokens"] for r in two["history"]] == [r["tokens"] for r in one["history"]]


def test_resuming_a_run_whose_data_changed_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_folder, "OUTPUTS_DIR", tmp_path)
    overrides = [f"train_data_path={arithmetic_pairs(tmp_path)}", "save_every_steps=1", "validation_fraction=0"]
    settings = run_folder.training_settings(runner.resolve_params("cpu", overrides)[0])
    run = fake_run(tmp_path, "20250101-000000-cpu", settings, step=1, fingerprint={"data": "0123456789abcdef"})
    monkeypatch.setattr(training_cli, "launch", lambda *args: pytest.fail("the model was loaded"))
    assert cli.main(["train", "--params", "cpu", "--set", *overrides]) == 2
    error = capsys.readouterr().err
    assert f"{run / 'training' / 'checkpoints' / 'step-00000001'} was saved by a run with other settings or data: " \
           "data 0123456789abcdef (now " in error
    assert f"move {run / 'training'} away" in error and (run / "training" / "checkpoints").is_dir()  # nothing lost


@pytest.mark.parametrize("change", [dict(seed=1), dict(padding="length_grouped"), dict(max_steps=3),
                                    dict(warmup_steps=1), dict(micro_batch_size=3), dict(learning_rate=2e-3),
                                    dict(lora_rank=4), dict(optimizer="adamw-8bit"), dict(data="same lengths, other tokens")])
def test_a_checkpoint_is_resumed_only_by_the_settings_and_data_it_was_saved_with(tmp_path, change):
    """The fingerprint is the only guard of a resume into the same folder: each setting that changes
    which examples a step sees or where the schedule is, and the data's tokens (not only their
    lengths), must stop it by name."""
    config = make_config(tmp_path, arithmetic_pairs(tmp_path), max_steps=2)
    prepared = training.prepare_data(config)
    saved = checkpoints.fingerprint(config, prepared, training.plan_run(config, prepared))
    checkpoint = tmp_path / "step-00000001"
    checkpoint.mkdir()
    (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps({"step": 1, "fingerprint": saved, "history": [],
                                                                 "eval_history": []}))
    if "data" in change:  # one answer changed for another of the same length: 3 -> 4
        records = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
        records[1]["output"] = "4"
        config = dataclasses.replace(config, data_path=str(write_jsonl(tmp_path / "edited.jsonl", records)))
        key = "data"
    else:
        config = dataclasses.replace(config, **change)
        key = next(iter(change))
    now = training.prepare_data(config)
    now_fingerprint = checkpoints.fingerprint(config, now, training.plan_run(config, now))
    assert [len(e.input_ids) for e in now.train] == [len(e.input_ids) for e in prepared.train] or key != "data"
    key = {"max_steps": "total_steps", "learning_rate": "learning_rate"}.get(key, key)
    with pytest.raises(training.TrainError, match=rf"saved by a run with other settings or data: .*\b{key} "):
        checkpoints.resumable_state(checkpoint, now_fingerprint)


def test_an_unwritable_outputs_folder_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(run_folder, "OUTPUTS_DIR", tmp_path / "a-file" / "outputs")
    monkeypatch.setattr(training_cli, "launch", lambda *args: pytest.fail("the model was loaded"))
    assert cli.main(["train", "--params", "cpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: cannot create or lock a run folder (") and error.count("\n") == 1
    assert f"make {tmp_path / 'a-file' / 'outputs'} writable" in error


def test_a_run_too_short_to_leave_out_its_warm_up_steps_says_its_figure_is_not_a_steady_state():
    from types import SimpleNamespace
    from workbook.training import report
    config = SimpleNamespace(peak_bf16_tflops=0.0, peak_fp16_tflops=0.0, dtype="fp32", profile="cpu")
    steps = [{"tokens": 100, "seconds": 1.0, "flops": 1e9}]
    assert "not a steady state" in report.throughput(steps, config, 1, on_gpu=False)["what"]
    longer = report.throughput(steps * 4, config, 1, on_gpu=False)
    assert "left out of the steady-state figure" in longer["what"] and longer["tokens_per_second"] == 100.0


def test_a_stalled_step_is_named_beside_the_steady_state_figure_and_a_cpu_run_has_no_cost():
    from types import SimpleNamespace
    from workbook.training import report
    config = SimpleNamespace(peak_bf16_tflops=0.0, peak_fp16_tflops=0.0, dtype="fp32", profile="cpu")
    steps = [{"step": i, "tokens": 1000, "seconds": 0.25, "flops": 1e9} for i in range(1, 10)]
    steps[7]["seconds"] = 4.0  # another process had the machine during step 8
    figures = report.throughput(steps, config, 1, on_gpu=False)
    assert figures["tokens_per_second_median_step"] == 4000.0 and figures["tokens_per_second"] < 1500
    assert figures["stalls"].startswith("1 step(s) ran under 1/3 of the median step's rate (step 8 (4.00 s)")
    assert figures["stalls"].endswith("the median step ran at 4,000 tokens/s")
    assert "73% of the steady-state seconds" in figures["stalls"]  # 4 of the 5.5 s after the 2 warm-up steps
    assert report.throughput(steps[:7], config, 1, on_gpu=False)["stalls"] == ""
    assert report.cost_text({"gpus": 0, "usd_per_gpu_hour": 0.0, "cost_usd": 0.0}) == "n/a: a CPU run (no GPU-hours)"
    assert report.cost_text({"gpus": 2, "usd_per_gpu_hour": 3.5, "cost_usd": 0.7}) == "$0.70 (2 GPU(s) x $3.5/GPU-hour)"


def test_the_overall_rate_keeps_the_warm_up_steps_and_the_per_process_rate_divides_by_the_processes():
    from types import SimpleNamespace
    from workbook.training import report
    config = SimpleNamespace(peak_bf16_tflops=0.0, peak_fp16_tflops=0.0, dtype="fp32", profile="cpu")
    # Two slow warm-up steps (compilation), then 3 steps of 1,000 tokens in 0.5 s, over 4 processes.
    steps = [{"tokens": 1000, "seconds": 5.0, "flops": 1e9}] * 2 + [{"tokens": 1000, "seconds": 0.5, "flops": 1e9}] * 3
    figures = report.throughput(steps, config, processes=4, on_gpu=False)
    assert figures["tokens_per_second"] == pytest.approx(2000.0)
    assert figures["tokens_per_second_overall"] == pytest.approx(5000 / 11.5)  # every step, warm-up included
    assert figures["tokens_per_second_per_process"] == pytest.approx(500.0)


def test_the_training_cost_is_counted_in_gpu_hours_of_every_gpu_and_a_cpu_run_has_none(tmp_path):
    from types import SimpleNamespace
    from workbook.training import report
    config = make_config(tmp_path, usd_per_gpu_hour=4.0)
    run = SimpleNamespace(micro_batch_size=2, steps_per_epoch=2, total_steps=4, gradient_accumulation_steps=1,
                          learning_rate=1e-3, learning_rate_rule="given", to_dict=lambda: {})
    prepared = SimpleNamespace(max_seq_length=64, summary=lambda: {})
    history = [{"step": i, "loss": 1.0, "tokens": 100, "seconds": 1.0, "flops": 1e9} for i in range(1, 5)]

    def result(device, processes):
        accelerator = SimpleNamespace(num_processes=processes, device=torch.device(device),
                                      distributed_type=SimpleNamespace(value="MULTI_GPU"))
        return report.result(config, prepared, run, accelerator, history, [], 0, 4, True, "tiny", 10, 10, "AdamW",
                             False, {"peak_bytes": None, "note": "n/a"}, None, None, wall_seconds=1800.0,
                             final_dir=None, fsdp=False)
    # 30 minutes of 2 GPUs: one GPU-hour, $4.
    time_ = result("cuda", 2)["time"]
    assert time_["gpus"] == 2 and time_["gpu_hours"] == pytest.approx(1.0) and time_["cost_usd"] == pytest.approx(4.0)
    # A CPU run spends no GPU-hours: its cost is n/a, not the profile's price.
    on_cpu = result("cpu", 1)["time"]
    assert on_cpu["gpus"] == 0 and on_cpu["cost_usd"] == 0 and report.cost_text(on_cpu) == "n/a: a CPU run (no GPU-hours)"


def test_the_run_summary_says_not_measured_instead_of_a_zero_and_compares_the_first_epoch_with_the_last():
    from workbook.training import report
    result = {
        "status": "finished", "steps": {"reached": 6, "total": 6}, "model_description": "tiny",
        "throughput": {"tokens_per_second": 2000.0, "tokens_per_second_overall": 400.0,
                       "tokens_per_second_median_step": 2100.0, "stalls": "", "achieved_tflops": None,
                       "mfu": None, "mfu_note": "n/a: CPU run (no GPU peak to measure against)"},
        "loss": {"epoch_means": [2.0, 1.5, 1.0], "eval_before": None, "eval_after": None},
        "memory": {"measured": {"peak_bytes": None, "note": "not measured: no GPU"}, "predicted_peak_bytes": 2**30},
        "time": {"wall_seconds": 12.0, "training_seconds": 10.0, "gpus": 1, "usd_per_gpu_hour": 0.0, "cost_usd": 0.0},
        "accuracy": {"before": None, "after": None}, "output": {"final_model_dir": None}}
    lines = report.summary_lines(result)
    # No GPU peak: MFU is named n/a with the reason, never printed as 0.0%.
    assert lines[2] == "tokens/s 2,000 (non-padding, steady state); MFU n/a: CPU run (no GPU peak to measure against)"
    # A GPU profile without a price: the cost is n/a, not $0.00.
    assert lines[3] == "wall 12.0 s, cost n/a: the profile has no price per GPU-hour"
    rows = {row["measurement"]: row["value"] for row in report.measurement_rows(result)}
    assert rows["tokens/s (steady state)"] == "2,000" and rows["tokens/s (every step)"] == "400"
    assert rows["peak memory per GPU (measured)"] == "not measured: no GPU"
    assert rows["MFU"] == "n/a: CPU run (no GPU peak to measure against)"
    first_last = report.before_after_rows(result)[0]
    assert (first_last["start"], first_last["end"]) == ("2.0000", "1.0000")


def test_the_measured_peak_memory_is_the_largest_processs_not_their_sum(monkeypatch):
    from types import SimpleNamespace
    from workbook import runtime
    from workbook.training import report
    monkeypatch.setattr(runtime, "peak_memory", lambda device: SimpleNamespace(total_bytes=6e9, allocated_bytes=4e9))

    class TwoProcesses:  # rank 0 measured 6 GB, the other process 8 GB (5 GB allocated)
        def reduce(self, tensor, reduction):
            both = torch.stack([tensor, torch.tensor([8e9, 5e9], dtype=torch.float64)])
            return both.amax(0) if reduction == "max" else both.sum(0)
    measured = report.measured_peak_memory(torch.device("cpu"), TwoProcesses())
    assert measured["peak_bytes"] == 8 * 10**9 and measured["peak_allocated_bytes"] == 5 * 10**9
    assert measured["rank0_peak_bytes"] == 6 * 10**9


def test_the_learning_rate_warms_up_linearly_then_decays_by_cosine_over_the_steps_after_the_warm_up():
    rate = lambda step: run_plan.learning_rate_at(step, 1.0, warmup_steps=10, total_steps=110)
    assert [rate(0), rate(4), rate(9)] == pytest.approx([0.1, 0.5, 1.0])
    assert rate(10) == pytest.approx(1.0)  # the first step after the warm-up is at the peak
    assert rate(60) == pytest.approx((1 + run_plan.MIN_LR_FRACTION) / 2)  # half-way through the decay
    assert rate(110) == pytest.approx(run_plan.MIN_LR_FRACTION) == rate(500)


def test_an_auto_micro_batch_leaves_the_run_its_warm_up(tmp_path, tiny_model_path):
    # The tiny model fits thousands of rows: 'auto' once took them all, one optimizer step, and a run whose
    # learning rate never left its warm-up (warmup_steps 20 on the GPU profiles).
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"input": f"Question {i}?", "output": "x" * 5} for i in range(60)])
    config = make_config(tmp_path, path, use_chat_template=False, padding="length_grouped", micro_batch_size="auto",
                         max_steps=0, epochs=2, warmup_steps=9)
    prepared = training.prepare_data(config)
    run = training.plan_run(config, prepared)
    assert (run.micro_batch_size, run.steps_per_epoch, run.total_steps) == (12, 5, 10)
    assert "capped at 12 so that the 2 epoch(s) of 60 rows give at least warmup_steps + 1 = 10" in run.micro_batch_rule
    # One epoch and warm-up 4: five steps, the warm-up's four and one at the peak (not four).
    one_epoch = training.plan_run(dataclasses.replace(config, epochs=1, warmup_steps=4), prepared)
    assert (one_epoch.micro_batch_size, one_epoch.steps_per_epoch, one_epoch.total_steps) == (12, 5, 5)
    # A run max_steps decides needs one step an epoch (the loader goes round again).
    fixed = training.plan_run(dataclasses.replace(config, max_steps=3), prepared)
    assert fixed.micro_batch_size == 60 and "an epoch (60 rows) has an optimizer step" in fixed.micro_batch_rule


def test_the_run_plan_counts_steps_and_scales_the_learning_rate_by_the_batch_of_every_process(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"input": f"Question {i}?", "output": "x" * 5} for i in range(60)])
    config = make_config(tmp_path, path, use_chat_template=False, padding="length_grouped", micro_batch_size=4,
                         gradient_accumulation_steps=2, max_steps=0, epochs=1, lr_scaling="linear", base_batch=8)
    prepared = training.prepare_data(config, log=lambda line: None)
    run = training.plan_run(config, prepared, processes=2)
    # 60 rows in micro-batches of 4: 15; a step takes 2 accumulated x 2 processes = 4 of them, so 3 whole steps
    # (the 3 micro-batches left over make no step of their own).
    assert (run.micro_batches_per_epoch, run.steps_per_epoch, run.total_steps) == (15, 3, 3)
    assert run.effective_batch_rows == 16 and run.learning_rate == pytest.approx(2e-3)  # linear: 1e-3 x 16 / 8
    # The padding reported is that of the 12 micro-batches the steps use.
    lengths = [example.length for example in prepared.train]
    epoch = sft_batches.epoch_micro_batches(sft_batches.plan_rows(lengths, "length_grouped", prepared.max_seq_length),
                                            lengths, "length_grouped", micro_batch_size=4, seed=config.seed, epoch=0)
    assert run.padding_fraction == sft_batches.padding_fraction(epoch[:12], lengths, "length_grouped",
                                                                prepared.max_seq_length)
    with pytest.raises(training.TrainError, match=r"gives 2 micro-batch\(es\) of 30 rows, but one optimizer step needs 4"):
        training.plan_run(dataclasses.replace(config, micro_batch_size=30), prepared, processes=2)
    # 'auto' leaves every process an optimizer step: 60 rows // (2 x 2) = 15 a micro-batch, not 30.
    auto = training.plan_run(dataclasses.replace(config, micro_batch_size="auto"), prepared, processes=2)
    assert (auto.micro_batch_size, auto.steps_per_epoch) == (15, 1)
    # Two epochs and warm-up 10 need 11 steps: 6 an epoch (rounded up), so micro-batches of 60 // (2 x 6) = 5.
    warm = training.plan_run(dataclasses.replace(config, micro_batch_size="auto", epochs=2, warmup_steps=10), prepared,
                             processes=1)
    assert (warm.micro_batch_size, warm.steps_per_epoch, warm.total_steps) == (5, 6, 12)


def test_accuracy_checks_of_a_packed_run_generate_with_an_attention_that_decodes(tmp_path, tiny_model_path, tokenizer):
    # A packed run on CPU trains with document_sdpa: no padding mask, and a one-token decode step causal from
    # its first key. Greedy answers generated through it were nonsense (" 11111"), and the rejection-sampling
    # round read 0% before and after. The checks must give what the model gives with sdpa, and leave training
    # on its packed path.
    from workbook import decoding, models
    from workbook.training import packed_attention
    packed_attention.register()
    packed = models.load_model("tiny", "fp32", "cpu", attn_implementation="document_sdpa").model
    plain = models.load_model("tiny", "fp32", "cpu", attn_implementation="sdpa").model
    prompts = [tokenizer("What is 7 + 5?")["input_ids"], tokenizer("What is 23 + 45?")["input_ids"],
               tokenizer("What is 1 + 2?")["input_ids"]]  # different lengths: left padding
    expected = decoding.greedy_completions(plain, tokenizer, prompts, 6)
    with packed_attention.generation_attention(packed):
        assert decoding.greedy_completions(packed, tokenizer, prompts, 6) == expected
    assert packed.config._attn_implementation == "document_sdpa"
    assert decoding.greedy_completions(packed, tokenizer, prompts, 6) != expected  # what the checks used to read
