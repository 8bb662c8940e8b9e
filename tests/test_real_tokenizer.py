"""What the checkpoints users bring do and the character-level tokenizer never did, on the tiny model
whose tokenizer is now like theirs (byte-level BPE, Llama 3's special tokens, two end ids, role headers,
no pad token); and the model a run trained, full or LoRA, as the next run's model."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workbook import arithmetic, cli, decoding, jsonl, models, params, prompt_format, tiny_model
from workbook import generation, training
from workbook.generation.files import read_outputs
from workbook.paths import PARAMS_DIR
from workbook.training import examples as sft_examples

# Gemma's template before Gemma 2: a system turn raises.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def job_params(prompts_path, output_path, **changes):
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(prompts_path=str(prompts_path), output_path=str(output_path), log_every_batches=0, verifier="",
                  do_sample=False, samples_per_prompt=1, max_accepted_per_prompt=0)
    for key, value in changes.items():
        values[key] = params.validate_value(key, value, "test")
    return values


def run_job(tiny, tmp_path, records, name="out.jsonl", **changes):
    prompts = arithmetic.write_records(tmp_path / f"{name}.in.jsonl", records)
    output = tmp_path / name
    summary = generation.run_job(job_params(prompts, output, **changes), output, model=tiny[0], tokenizer=tiny[1],
                                 log=lambda line: None, show_progress=False)
    return summary, read_outputs(output)


def test_the_tokenizer_is_byte_level_bpe_with_llama3_specials_and_no_pad():
    tokenizer = tiny_model.build_tokenizer()
    assert len(tokenizer) <= tiny_model.tiny_config().vocab_size  # the embedding covers every id
    assert tokenizer.pad_token is None and tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.convert_ids_to_tokens(list(tiny_model.END_IDS)) == ["<|end_of_text|>", "<|eot_id|>"]
    for text in ["What is 23 + 45? 68", "  two  spaces, tab\tand\nnewline ", "café × 2 ✓", ""]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text  # any text, no unknown token
    assert len(tokenizer("What is 23 + 45?")["input_ids"]) < 1 + len("What is 23 + 45?")  # merges, not characters
    assert tokenizer.get_vocab() == tiny_model.build_tokenizer().get_vocab()  # the same BPE every build


def test_the_chat_template_writes_role_headers_and_the_reply_ends_with_end_of_turn():
    tokenizer = tiny_model.build_tokenizer()
    text = prompt_format.chat_prompt_text(tokenizer, "What is 1 + 2?", "Be brief.")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 1 + 2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_generation_stops_at_either_end_token_and_writes_no_special_token(tiny, tmp_path):
    model, tokenizer = tiny
    assert set(decoding.eos_token_ids(model, tokenizer)) == set(tiny_model.END_IDS)
    records = arithmetic.sample_records()[:12]
    # Chat: the model ends its turn with <|eot_id|>, which is not the tokenizer's eos_token.
    chat_summary, chat = run_job(tiny, tmp_path, records, "chat.jsonl", max_new_tokens=8)
    plain_summary, plain = run_job(tiny, tmp_path, records, "plain.jsonl", max_new_tokens=8, use_chat_template=False)
    for outputs in (chat, plain):
        assert all(r["metadata"]["finish_reason"] == "eos" for r in outputs)  # stopped, not cut at 8 tokens
        assert all(r["metadata"]["output_tokens"] <= 5 for r in outputs)
        assert not any("<|" in r["output"] for r in outputs)
    # A chat reply is the number ("68"), a plain continuation has its space (" 68"); both mostly right.
    assert all(r["output"] == r["output"].strip() for r in chat) and all(r["output"].startswith(" ") for r in plain)
    for outputs in (chat, plain):
        assert sum(arithmetic.score(record, r["output"]) for record, r in zip(records, outputs)) >= 9


def test_a_pad_id_is_lent_from_an_end_id_without_growing_the_vocabulary(tiny):
    model, tokenizer = tiny
    before = len(tokenizer)
    assert tokenizer.pad_token_id is None and model.generation_config.pad_token_id is None
    assert decoding.pad_token_id(model, tokenizer) in tiny_model.END_IDS
    prompts = prompt_format.prompt_token_ids(tokenizer, ["What is 1 + 2?", "What is 45 + 45?"], use_chat_template=True)
    batched = decoding.greedy_completions(model, tokenizer, prompts, 6)  # left-padded with the lent id
    alone = [decoding.greedy_completions(model, tokenizer, [row], 6)[0] for row in prompts]
    assert batched == alone and len(tokenizer) == before and tokenizer.pad_token is None
    assert model.get_input_embeddings().weight.shape[0] == tiny_model.tiny_config().vocab_size


def test_the_loss_covers_the_reply_and_its_end_token_not_the_role_headers(tiny):
    tokenizer = tiny[1]
    (example,), _ = sft_examples.tokenize_pairs([{"input": "What is 23 + 45?", "output": "68"}], tokenizer,
                                                use_chat_template=True)
    trained = [token for token, label in zip(example.input_ids, example.labels) if label != sft_examples.IGNORE_INDEX]
    assert trained == tokenizer("68", add_special_tokens=False)["input_ids"] + [tiny_model.EOT_ID]
    prompt = example.input_ids[:len(example.input_ids) - len(trained)]
    assert prompt == prompt_format.prompt_token_ids(tokenizer, ["What is 23 + 45?"], use_chat_template=True)[0]
    headers = {tiny_model.START_HEADER_ID, tiny_model.END_HEADER_ID, tiny_model.BOS_ID}
    assert headers <= set(prompt) and not headers & set(trained)
    assert "assistant" not in tokenizer.decode(trained)


def _without_system_role(tokenizer):
    copy = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    copy.chat_template = NO_SYSTEM_TEMPLATE
    return copy


def test_a_template_without_a_system_role_refuses_or_folds_the_system_prompt(tiny, tmp_path):
    tokenizer = _without_system_role(tiny[1])
    with pytest.raises(jsonl.DataError, match=r"refuses a system turn \(System role not supported\).*"
                                              r"on_no_system_role: fold"):
        prompt_format.prompt_token_ids(tokenizer, ["What is 1 + 2?"], use_chat_template=True, system_prompt="Be brief.")
    folded = prompt_format.prompt_token_ids(tokenizer, ["What is 1 + 2?"], use_chat_template=True,
                                            system_prompt="Be brief.", on_no_system_role="fold")
    assert tokenizer.decode(folded[0]) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                                           "Be brief.\n\nWhat is 1 + 2?<|eot_id|>"
                                           "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Without a system prompt nothing changes, and a template with a system role never folds.
    assert prompt_format.prompt_token_ids(tokenizer, ["What is 1 + 2?"], use_chat_template=True) == \
        prompt_format.prompt_token_ids(tiny[1], ["What is 1 + 2?"], use_chat_template=True)
    assert "system" in tiny[1].decode(prompt_format.prompt_token_ids(
        tiny[1], ["x"], use_chat_template=True, system_prompt="Be brief.", on_no_system_role="fold")[0])
    # Through the generation job: refused before anything is written, or folded and generated.
    records = arithmetic.sample_records()[:2]
    with pytest.raises(jsonl.DataError, match="on_no_system_role: fold"):
        run_job((tiny[0], tokenizer), tmp_path, records, "refused.jsonl", system_prompt="Be brief.")
    assert not (tmp_path / "refused.jsonl").exists() or (tmp_path / "refused.jsonl").read_text() == ""
    _, written = run_job((tiny[0], tokenizer), tmp_path, records, "folded.jsonl", system_prompt="Be brief.",
                         on_no_system_role="fold")
    assert len(written) == 2


def test_a_prompt_longer_than_the_context_follows_on_long_prompt(tiny, tmp_path):
    long_prompt = "What is 1 + 1? " * 40  # far more tokens than the tiny model's 256 positions
    records = [{"id": "long", "input": long_prompt, "output": "2"}, *arithmetic.sample_records()[:2]]
    with pytest.raises(jsonl.DataError, match=r"prompt of \d+ tokens leaves no room.*on_long_prompt: skip"):
        run_job(tiny, tmp_path, records, "fail.jsonl")
    summary, written = run_job(tiny, tmp_path, records, "skip.jsonl", on_long_prompt="skip")
    assert summary["too_long"] == 1 and len(written) == 2


# ----------------------------------------------------------------------------------------------
# The model a run trained is the next run's model.


def pairs_file(tmp_path):
    return arithmetic.write_records(tmp_path / "pairs.jsonl", arithmetic.sample_records()[:16])


def train(tmp_path, name, **changes):
    settings = dict(model="tiny", data_path=str(pairs_file(tmp_path)), data_description="test data",
                    output_dir=str(tmp_path / name), validation_fraction=0.0, micro_batch_size=4, learning_rate=1e-4,
                    max_steps=2, warmup_steps=0, dtype="fp32", tf32=False, dataloader_workers=0, pin_memory=False,
                    save_every_steps=0)
    result = training.train(training.TrainConfig(**{**settings, **changes}))
    return tmp_path / name / "final", result


def generate_with(model_dir, tmp_path, capsys, name):
    prompts = arithmetic.write_records(tmp_path / "prompts.jsonl", arithmetic.sample_records()[:4])
    output = tmp_path / f"{name}.jsonl"
    code = cli.main(["generate", "--params", "cpu", "--set", f"model={model_dir}", f"prompts_path={prompts}",
                     f"output_path={output}", "samples_per_prompt=1", "do_sample=false", "verifier=",
                     "max_accepted_per_prompt=0"])
    err = capsys.readouterr().err
    assert code == 0, err
    return read_outputs(output)


def plan_json(model_dir, capsys):
    """The plan `workbook plan` prints for ``model_dir``, without the model's name."""
    assert cli.main(["plan", "--profile", "cpu", "--mode", "generate", "--model", str(model_dir), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan.pop("model") == str(model_dir)
    return plan


def test_generate_and_plan_with_the_fully_fine_tuned_model(tmp_path, capsys, tiny_model_path):
    final, _ = train(tmp_path, "full")
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    written = generate_with(final, tmp_path, capsys, "full")
    assert len(written) == 4 and all(r["metadata"]["teacher_model"] == str(final) for r in written)
    assert plan_json(final, capsys) == plan_json(tiny_model_path, capsys)  # same architecture, same plan


@pytest.mark.parametrize("lora_save", ["merged", "adapters"])
def test_generate_and_plan_with_the_lora_trained_model(tmp_path, capsys, tiny_model_path, tiny, lora_save):
    final, _ = train(tmp_path, lora_save, lora_rank=4, lora_save=lora_save)
    if lora_save == "merged":  # a standalone model: loads without peft, its weights moved by the adapters
        assert (final / "config.json").is_file() and not (final / "adapter_config.json").exists()
        merged = AutoModelForCausalLM.from_pretrained(final)
        assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight,
                               tiny[0].model.layers[0].self_attn.q_proj.weight)
    else:
        assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
        loaded = models.load_model(str(final), "fp32", "cpu")
        assert "LoRA adapters" in loaded.description
    written = generate_with(final, tmp_path, capsys, lora_save)
    assert len(written) == 4
    assert plan_json(final, capsys) == plan_json(tiny_model_path, capsys)  # planned as its base model


# ----------------------------------------------------------------------------------------------
# Bad model folders: exit 2, what is wrong and what to do, nothing written.


def _generate_fails(model_dir, tmp_path, capsys) -> str:
    prompts = arithmetic.write_records(tmp_path / "prompts.jsonl", arithmetic.sample_records()[:2])
    output = tmp_path / "never.jsonl"
    code = cli.main(["generate", "--params", "cpu", "--set", f"model={model_dir}", f"prompts_path={prompts}",
                     f"output_path={output}", "samples_per_prompt=1", "do_sample=false", "verifier="])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert not output.exists()
    return err.strip().splitlines()[-1]


def test_bad_model_folders_exit_2_saying_what_is_wrong_and_what_to_do(tmp_path, capsys, tiny_model_path):
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_path / name, no_tokenizer / name)
    assert "holds no tokenizer" in _generate_fails(no_tokenizer, tmp_path, capsys)

    # Tokens added to the tokenizer, the embedding not resized: ids past its last row.
    grown = tmp_path / "grown_tokenizer"
    shutil.copytree(no_tokenizer, grown)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(100)])
    tokenizer.save_pretrained(grown)
    rows = tiny_model.tiny_config().vocab_size
    line = _generate_fails(grown, tmp_path, capsys)
    assert f"tokenizer has {len(tokenizer)} ids but the model's embedding only {rows} rows" in line
    assert "resize_token_embeddings" in line

    config = json.loads((tiny_model_path / "config.json").read_text())
    for name, changes in (("heads", {"num_attention_heads": 3}),  # 128 hidden over 3 heads: not an architecture
                          ("shapes", {"vocab_size": 100})):  # weights of 320 rows for an embedding of 100
        unbuildable = tmp_path / f"unbuildable_{name}"
        shutil.copytree(tiny_model_path, unbuildable)
        (unbuildable / "config.json").write_text(json.dumps({**config, **changes}))
        line = _generate_fails(unbuildable, tmp_path, capsys)
        assert str(unbuildable) in line and "config.json" in line

    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone"),
                                                               "peft_type": "LORA"}))
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(adapters)
    line = _generate_fails(adapters, tmp_path, capsys)
    assert "base model" in line and "gone" in line and "lora_save: merged" in line
    assert cli.main(["plan", "--profile", "cpu", "--mode", "generate", "--model", str(adapters)]) == 2
    assert "base_model_name_or_path" in capsys.readouterr().err
