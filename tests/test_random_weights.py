"""A preset architecture with random weights as a local model directory: the generation job and the
trainer load it like any Hugging Face directory, its prompts tokenize, and the ids random weights
generate beyond the tokenizer's vocabulary decode without an error. A shrunken Llama-3.1-8B (the
preset's own vocabulary of 128,256 ids, tiny layers) keeps it to seconds on a CPU."""

import json

import pytest

from workbook import generation, params, presets, random_weights, training
from workbook.paths import PARAMS_DIR
from workbook.tiny_model import tiny_config

SMALL_LLAMA = {**presets.PRESETS["Llama-3.1-8B"], "_name_or_path": "test/Small-Llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16}  # vocab_size stays 128,256: the ids the tokenizer lacks are the point
# Its output head is untied (8B's): a tied one mostly echoes the input's ids, all inside the tiny tokenizer's few hundred.


@pytest.fixture(scope="module")
def random_model(tmp_path_factory, tiny_model_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(presets.PRESETS, "Small-Llama", SMALL_LLAMA)
        return random_weights.save_random_model("Small-Llama", tmp_path_factory.mktemp("models") / "small", "bf16")


def test_the_directory_holds_the_presets_config_safetensors_weights_and_a_tokenizer(random_model):
    names = {path.name for path in random_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", random_weights.BUILD_INFO_FILE} <= names
    config = json.loads((random_model / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["dtype"]) == (128256, 64, "bfloat16")
    info = json.loads((random_model / random_weights.BUILD_INFO_FILE).read_text())
    assert info["preset"] == "Small-Llama" and info["built_on"] == "cpu" and "noise" in info["note"]
    # The tokenizer allows the model's positions, not the tiny model's 256 (the trainer caps at the smaller).
    assert json.loads((random_model / "tokenizer_config.json").read_text())["model_max_length"] == 131072


def test_ids_beyond_the_tokenizers_vocabulary_decode_to_nothing(random_model):
    _, tokenizer = generation.load_model(str(random_model), "fp32", "cpu")
    assert len(tokenizer) <= tiny_config().vocab_size < 128256
    ids = tokenizer("What is 1 + 2?")["input_ids"]
    assert tokenizer.decode(ids + [5000, 128255], skip_special_tokens=True) == "What is 1 + 2?"


def test_the_generation_job_loads_it_and_writes_a_record_per_prompt(random_model, tmp_path):
    model, tokenizer = generation.load_model(str(random_model), "fp32", "cpu")
    assert model.config.vocab_size == 128256 and tokenizer is not None
    prompts, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "input": f"What is {i} + 1?"}) + "\n" for i in range(3)))
    job = params.load(PARAMS_DIR / "cpu.yaml")
    job.update(model=str(random_model), prompts_path=str(prompts), output_path=str(output), batch_size=2,
               max_new_tokens=6, verifier="", log_every_batches=0, interactive=False, do_sample=False,
               samples_per_prompt=1)  # one greedy output per prompt
    summary = generation.run_job(job, output, model=model, tokenizer=tokenizer, log=lambda line: None,
                                 show_progress=False)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert summary["generated"] == 3 and len(records) == 3
    assert all(isinstance(record["output"], str) and 1 <= record["metadata"]["output_tokens"] <= 6
               for record in records)
    # Random weights pick among 128,256 ids, the tokenizer knows 128: most tokens written decode to nothing.
    assert sum(len(record["output"]) for record in records) < sum(r["metadata"]["output_tokens"] for r in records)


def test_the_trainer_loads_it_and_trains_on_the_shipped_sample(random_model, tmp_path):
    config = training.TrainConfig(model=str(random_model), data_path="", data_description="the shipped sample",
                                  output_dir=str(tmp_path / "out"), validation_fraction=0.0, micro_batch_size=2,
                                  learning_rate=1e-3, max_steps=2, warmup_steps=0, dtype="fp32", tf32=False,
                                  dataloader_workers=0, pin_memory=False, use_chat_template=False, save_every_steps=0)
    result = training.train(config)
    assert result["status"] == "finished" and result["steps"]["reached"] == 2
    assert result["model_description"].startswith(f"{random_model}: weights from {random_model}")
    assert not result["data"]["formatting"].get("synthetic")  # real examples, tokenized by the tiny tokenizer


def test_the_command_prints_what_it_built_as_its_last_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(presets.PRESETS, "Small-Llama", SMALL_LLAMA)
    assert random_weights.main(["--preset", "Small-Llama", "--out", str(tmp_path / "m"), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # what forecast_check reads
    assert printed["preset"] == "Small-Llama" and printed["dtype"] == "bf16" and printed["parameters"] > 0


def test_a_model_directory_loads_straight_onto_a_gpu_not_through_host_memory(tiny_model_path, monkeypatch):
    """On CUDA, from_pretrained places the weights on the device itself (an 8B model's 16 GB never sit
    in host RAM first); on CPU the model loads as before."""
    from transformers import AutoModelForCausalLM
    from workbook import models
    asked = []
    original = AutoModelForCausalLM.from_pretrained

    def recording(path, **kwargs):
        asked.append(kwargs.get("device_map"))
        return original(path, **{key: value for key, value in kwargs.items() if key != "device_map"})

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    models.load_model(str(tiny_model_path), "fp32", "cpu")
    models.load_model(str(tiny_model_path), "fp32", "cuda:0")
    assert asked == [None, "cuda:0"]
