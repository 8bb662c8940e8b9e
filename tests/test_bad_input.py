"""Bad input from an audit of the commands: each mistake gets one line naming the file, line or key
(exit 2), never a traceback, and a failed job's manifest says so."""

import json
import re
import shutil

import pytest

from workbook import cli, jsonl, models, params, runner
from workbook.paths import PARAMS_DIR


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def test_jsonl_with_a_byte_order_mark_reads_and_utf16_or_a_folder_is_named(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"input": "What is 1 + 1?"}\n{"input": "What is 2 + 2?"}\n')
    assert [record["input"] for _, record in jsonl.iter_jsonl(bom)] == ["What is 1 + 1?", "What is 2 + 2?"]
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes('{"input": "x"}\n'.encode("utf-16"))
    with pytest.raises(jsonl.DataError, match=r"wide.jsonl: UTF-16 text .* save the file as UTF-8"):
        list(jsonl.iter_jsonl(wide))
    with pytest.raises(jsonl.DataError, match=r": a folder, not a file"):
        jsonl.existing_file(tmp_path)


def test_utf16_of_either_byte_order_is_named_not_read_as_bad_lines(tmp_path):
    # Windows tools write little-endian UTF-16, others big-endian: both must get the one line saying how to fix it.
    for encoding in ("utf-16-le", "utf-16-be"):
        wide = tmp_path / f"{encoding}.jsonl"
        wide.write_bytes("\ufeff".encode(encoding) + '{"input": "x"}\n'.encode(encoding))
        with pytest.raises(jsonl.DataError, match=rf"{encoding}.jsonl: UTF-16 text .* save the file as UTF-8"):
            list(jsonl.iter_jsonl(wide))


def test_a_params_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    latin = tmp_path / "cpu.yaml"
    latin.write_bytes((PARAMS_DIR / "cpu.yaml").read_bytes().replace(b"Profile 'cpu'", b"Profil\xe9 'cpu'", 1))
    with pytest.raises(params.ParamsError, match=r"cpu.yaml:1: not UTF-8 text \(byte \d+\); save the file as UTF-8"):
        params.load(latin)


def test_a_broken_model_directory_is_one_line_not_a_traceback(tmp_path, tiny_model_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(models.ModelError, match=r"model .*broken: cannot load it from .* needs config.json"):
        models.load_model(str(broken), "fp32", "cpu")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(tiny_model_path / "config.json", config_only / "config.json")
    with pytest.raises(models.ModelError, match=r"needs config.json and the weights"):
        models.load_model(str(config_only), "fp32", "cpu")
    with pytest.raises(models.ModelError, match=r"needs its tokenizer files"):
        models.load_tokenizer(str(config_only))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"input": "What is 1 + 1?"}\n')
    code, err = run_cli(capsys, "generate", "--params", "cpu", "--set", f"model={config_only}",
                        f"prompts_path={prompts}", f"output_path={tmp_path / 'out.jsonl'}", "samples_per_prompt=1",
                        "do_sample=false", "verifier=")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: model ") and "Traceback" not in err


def test_flash_attention_without_its_package_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelError, match=r"flash_attention_2 needs the flash-attn package.*attn_implementation: sdpa"):
        models.check_attention_installed("flash_attention_2")
    models.check_attention_installed("sdpa")


def test_lora_targets_matching_no_layer_stop_plan_and_train_with_one_line(tmp_path, tiny_model_path, capsys):
    code, err = run_cli(capsys, "plan", "--profile", "h100", "--model", "llama-3.1-8b", "--mode", "train",
                        "--lora-targets", "foo_proj")
    assert code == 2 and "lora_targets ['foo_proj'] match no Linear layer" in err and "Traceback" not in err
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + 1?", "output": str(i + 1)}) + "\n" for i in range(8)))
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_data_path={data}", "max_steps=1",
                        "lora_rank=4", "lora_targets=foo_proj", "eval_prompts_path=",
                        f"train_output_dir={tmp_path / 'run'}")
    assert code == 2 and "match no Linear layer" in err.strip().splitlines()[-1]


def test_bench_names_its_unknown_model_or_setting_before_measuring_and_its_budget_must_be_positive(capsys):
    code, err = run_cli(capsys, "bench", "--params", "cpu", "--set", "bench_generate_model=nope")
    assert code == 2 and "error: bench_generate_model: unknown model 'nope'" in err
    code, err = run_cli(capsys, "bench", "--params", "cpu", "--set", "bench_train_settings=nope")
    assert code == 2 and "error: bench_train_settings: unknown nope" in err and "generation" not in err.lower()
    with pytest.raises(SystemExit) as refused:
        cli.main(["bench", "--params", "cpu", "--time-budget-seconds", "-5"])
    assert refused.value.code == 2 and "expected a number of seconds > 0" in capsys.readouterr().err


def test_a_job_that_fails_with_a_traceback_records_failed_not_running(tmp_path, monkeypatch):
    from workbook.generation import cli as generation_cli

    made = tmp_path / "20260101-000000-cpu"

    def broken(*args, **kwargs):
        (made / "generations.jsonl").write_text("")  # it wrote something: the folder stays, with its record
        raise RuntimeError("a bug")

    monkeypatch.setattr(generation_cli.notebook, "new_run_dir", lambda profile: made.mkdir() or made)
    monkeypatch.setattr(generation_cli, "start", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        generation_cli.cli_main("cpu", [])
    manifest = json.loads((made / runner.MANIFEST_FILE).read_text())
    assert manifest["status"] == "failed" and manifest["error"] == "a bug"


@pytest.mark.slow
def test_a_diverging_run_stops_with_its_step_and_saves_no_final_model(tmp_path, tiny_model_path, capsys):
    # learning_rate 1e9 once trained to a NaN loss, saved the NaN model as final/ and exited 0.
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + 1?", "output": str(i + 1)}) + "\n" for i in range(40)))
    output = tmp_path / "run"
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_data_path={data}", "max_steps=4",
                        "learning_rate=1e9", "warmup_steps=0", "micro_batch_size=4", "eval_prompts_path=",
                        f"train_output_dir={output}")
    assert code == 2 and "training diverged" in err.strip().splitlines()[-1]
    assert not (output / "final").exists()


def test_too_little_data_for_the_processes_is_said_before_they_start(tmp_path, tiny_model_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"input": "What is 1 + 1?", "output": "2"}) + "\n")
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_data_path={data}", "max_steps=2",
                        "train_processes=4", "validation_fraction=0", "eval_prompts_path=",
                        f"train_output_dir={tmp_path / 'run'}")
    assert code == 2 and "needs 4" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_a_max_seq_length_that_cuts_every_response_says_to_raise_it(tmp_path, tiny_model_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + 1?", "output": str(i + 1)}) + "\n" for i in range(8)))
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_data_path={data}", "max_steps=2",
                        "max_seq_length=4", "eval_prompts_path=", f"train_output_dir={tmp_path / 'run'}")
    assert code == 2 and "lost every response token to max_seq_length 4" in err and "raise max_seq_length" in err


def test_a_gpu_profile_on_a_machine_without_one_is_warned_about():
    import torch
    from workbook import runtime
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert "profile h100 describes 1 GPU(s) and torch sees none" in runtime.missing_gpu_warning("h100", 1)
    assert runtime.missing_gpu_warning("cpu", 0) is None


def test_calibrate_names_an_unknown_profile_or_case_on_a_cpu_too(tmp_path, capsys):
    from workbook.planner import calibration
    with pytest.raises(SystemExit) as refused:
        calibration.main(["--profile", "h10", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "h10.yaml: no such parameter file" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--only: no case of this profile's grid starts with 'nope'"):
        calibration.main(["--profile", "h100", "--only", "nope", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before it wrote anything


def test_a_config_without_the_models_sizes_is_refused_not_planned_as_a_default_llama(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    code, err = run_cli(capsys, "plan", "--profile", "h100", "--model", str(tmp_path))
    assert code == 2 and "no 'hidden_size', 'num_hidden_layers', 'vocab_size'" in err


def test_a_text_key_takes_the_text_yaml_would_have_read_as_something_else():
    assert params.parse_overrides(["system_prompt=no", "output_path=2026-01-01", "prompts_path=123"]) == {
        "system_prompt": "no", "output_path": "2026-01-01", "prompts_path": "123"}
    assert params.parse_overrides(["do_sample=no", "batch_size=4"]) == {"do_sample": False, "batch_size": 4}


def test_a_mistyped_profile_or_model_name_suggests_the_one_meant(capsys):
    code, err = run_cli(capsys, "plan", "--profile", "H200")
    assert code == 2 and "Did you mean 'h200'?" in err
    code, err = run_cli(capsys, "plan", "--profile", "a100")
    assert code == 2 and "Did you mean 'a100-40gb' or 'a100-80gb'?" in err
    code, err = run_cli(capsys, "plan", "--profile", "cpu", "--model", "llama-3.1-8")
    assert code == 2 and "Did you mean 'Llama-3.1-8B'?" in err
    code, err = run_cli(capsys, "plan", "--profile", "cpu", "--model", "no-such-model")
    assert code == 2 and "Did you mean" not in err and "Presets (any case)" in err


def test_a_training_run_that_does_not_fit_lists_what_would_with_predicted_peaks(tmp_path, capsys):
    # The cpu profile plans against this machine's RAM: a full 8B fine-tune cannot fit, and the run stops
    # before loading the model (past the RAM the kernel kills the process without a word), listing each
    # single change with its predicted peak, leaving out what needs a GPU (8-bit Adam, offloading, FSDP).
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", "model=Llama-3.1-8B", "max_seq_length=2048",
                        f"train_output_dir={tmp_path / 'out'}")
    assert code == 2 and "micro_batch_size 16 at 2048 tokens: does not fit, not even at batch 1 (batch 16 needs" in err
    assert "of this machine's RAM" in err
    assert "single changes, cheapest in throughput first (none fits alone" in err
    assert "lora_rank 16" in err and "grad_checkpointing true" in err
    assert "adamw-8bit" not in err and "fsdp" not in err.lower() and "offload" not in err
    assert not any((tmp_path / "out").rglob("*"))  # nothing loaded, nothing written


def test_a_micro_batch_set_over_the_ram_is_refused_with_the_largest_that_fits(tmp_path, capsys):
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", "model=Llama-3.2-1B", "max_seq_length=512",
                        "micro_batch_size=64", f"train_output_dir={tmp_path / 'out'}")
    largest = int(err.split("the largest batch that fits is ")[1].split(".")[0])
    assert code == 2 and "micro_batch_size 64 at 512 tokens: batch 64 needs" in err and 1 <= largest < 64
    assert f"Set micro_batch_size to {largest} or auto." in err and "changes that would make it fit" not in err


def test_a_generation_model_over_the_ram_is_refused_before_its_weights_load(tmp_path, capsys):
    # On the cpu profile the weights would fill the RAM and the kernel would kill the job without a word.
    from workbook import presets
    big = tmp_path / "big"
    big.mkdir()
    presets.load_config("Llama-3.1-70B").to_json_file(big / "config.json")  # no weights: refused before loading
    code, err = run_cli(capsys, "generate", "--params", "cpu", "--set", f"model={big}",
                        f"output_path={tmp_path / 'out.jsonl'}")
    assert code == 2 and "batch_size 32: does not fit, not even at batch 1" in err and "of this machine's RAM" in err
    assert "tensor parallelism" not in err and not (tmp_path / "out.jsonl").exists()


def test_processes_that_the_ram_cannot_hold_together_are_refused_before_they_start(tmp_path, capsys, monkeypatch):
    # Each CPU process holds the whole model: one fits, eight would not (RAM set to 16 GiB for the test).
    import psutil
    from types import SimpleNamespace
    from workbook import presets
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * 2**30, available=16 * 2**30))
    model = tmp_path / "one-b"
    model.mkdir()
    presets.load_config("Llama-3.2-1B").to_json_file(model / "config.json")
    code, err = run_cli(capsys, "generate", "--params", "cpu", "--set", f"model={model}", "dtype=bf16",
                        "data_parallel_processes=8", f"output_path={tmp_path / 'out.jsonl'}")
    assert code == 2 and "8 processes each hold the model and a batch of 32: 8 x" in err
    # The most processes it offers are the most whose copies the plan's share of RAM holds.
    each, ram, most = re.search(r"8 x ([\d.]+) GiB is over the ([\d.]+) GiB of this machine's RAM.*"
                                r"run at most (\d+) process\(es\)", err, re.S).groups()
    assert 2.0 < float(each) < 3.0 and int(most) == int(float(ram) / float(each)) < 8
    assert not (tmp_path / "out.jsonl").exists()


def test_a_forecast_that_does_not_fit_says_so_and_what_would(tmp_path, capsys):
    # As the job it forecasts: an error naming the key and the largest batch, no traceback, nothing run.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "What is 1 + 1?"}\n')
    code, err = run_cli(capsys, "forecast", "--params", "cpu", "--set", f"prompts_path={prompts}",
                        "batch_size=100000000", f"output_path={tmp_path / 'out.jsonl'}")
    assert code == 2 and "error: batch_size 100000000: batch 100000000 needs" in err and "Set batch_size to" in err
    assert not (tmp_path / "out.jsonl").exists()
    code, err = run_cli(capsys, "forecast", "--params", "cpu", "--mode", "train", "--set", "model=Llama-3.1-70B",
                        "max_seq_length=2048", f"train_output_dir={tmp_path / 'train'}")
    assert code == 2 and "does not fit, not even at batch 1" in err and "lora_rank 16" in err


def test_the_worst_case_probe_refuses_a_batch_over_the_ram_before_loading_the_model():
    # Notebook 01's probe on the cpu profile: past the RAM there is no out-of-memory error to back off
    # from, the kernel kills the process, so the plan refuses the batch first.
    from workbook.planner import DoesNotFitError, probes
    cpu = params.Params({**params.load_all()["cpu"], "micro_batch_size": 100000})
    with pytest.raises(DoesNotFitError, match=r"micro_batch_size 100000: batch 100000 needs .* Set micro_batch_size to"):
        probes.prove_batch_size(cpu, "train", device="cpu")


def test_a_model_the_planner_cannot_plan_is_not_refused_by_the_ram_check(tmp_path):
    # GPT-2's config has no intermediate_size: nothing to judge by, so the job runs as before.
    from transformers import GPT2Config
    from workbook.planner import profile
    GPT2Config(n_layer=2, n_embd=64, n_head=2).to_json_file(tmp_path / "config.json")
    assert profile.refuse_over_ram({**params.load_all()["cpu"], "model": str(tmp_path)}, "generate", 4) is None


def test_small_mistakes_each_get_their_own_message(tmp_path, capsys):
    # The profile comes with its file (its hardware facts), never from --set.
    with pytest.raises(params.ParamsError, match=r"--set 'profile=h100': the profile is the parameter file's own; "
                                                 "choose it with --params h100"):
        params.parse_overrides(["profile=h100"])
    # A folder given as --params is a folder, not a missing '<folder>.yaml'.
    with pytest.raises(params.ParamsError, match=rf"{tmp_path}: a folder, not a parameter file"):
        params.load(params.profile_path(str(tmp_path)))
    # NaN is Python's, not JSON's: copied into the outputs, strict readers would refuse them.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "What is 1 + 1?"}\n{"input": "What is 2 + 2?", "score": NaN}\n')
    bad = [record for _, record in jsonl.iter_jsonl(prompts) if isinstance(record, jsonl.BadLine)]
    assert [(b.line, b.reason) for b in bad] == [(2, "not valid JSON (NaN is not a JSON value; write null or a string)")]
    code, err = run_cli(capsys, "forecast", "--params", "cpu", "--pilot-seconds", "nan")
    assert code == 2 and "--pilot-seconds nan: expected a number of seconds > 0" in err
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_data_path={tmp_path}",
                        f"train_output_dir={tmp_path / 'out'}")
    assert code == 2 and "a folder, not a file" in err
    code, err = run_cli(capsys, "train", "--params", "cpu", "--set", f"train_output_dir={prompts}")
    assert code == 2 and f"train_output_dir {prompts} must be a folder you can write" in err


def test_a_warm_up_longer_than_the_run_is_said(tmp_path, capsys):
    from workbook.training.run_plan import warmup_note
    assert warmup_note(9, 10, 1e-3) == ""
    assert warmup_note(100, 2, 1e-3) == ("warmup_steps 100 is not below the run's 2 optimizer steps: the learning rate "
                                         "rises the whole run and ends at 2e-05, 2% of its peak")


def test_an_empty_model_or_prompts_path_is_refused_by_key():
    for key in ("model", "prompts_path"):
        with pytest.raises(params.ParamsError, match=rf"--set {key}=: '{key}' is ''; expected a non-empty string"):
            params.parse_overrides([f"{key}="])
    assert params.parse_overrides(["output_path="]) == {"output_path": ""}  # '' there means the run folder's file


def test_a_gpu_profiles_bench_on_a_cpu_refuses_a_model_the_ram_cannot_hold(capsys, monkeypatch):
    # The sweeps run fp32 on a CPU: an 8B's weights alone fill 30 GiB, past which the kernel kills the run.
    import psutil
    from types import SimpleNamespace
    import torch
    from workbook import runtime
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=24 * 2**30, available=20 * 2**30))
    monkeypatch.setattr(runtime, "default_device", lambda: torch.device("cpu"))  # as on a machine without a GPU
    code, err = run_cli(capsys, "bench", "--params", "h200")
    assert code == 2 and "error: bench_generate_model Llama-3.1-8B: its fp32 weights (29.9 GiB) are over the " \
                         "20.0 GiB of RAM free on this CPU" in err and "set bench_generate_model=tiny" in err


def test_did_you_mean_ignores_case_names_every_choice_a_prefix_starts_and_catches_a_near_miss():
    from workbook.suggest import did_you_mean
    assert did_you_mean("LLAMA-3.1-8", ["Llama-3.1-8B", "Llama-3.1-70B"]) == " Did you mean 'Llama-3.1-8B'?"
    assert did_you_mean("h", ["cpu", "h100", "h100x8", "h200"]) == " Did you mean 'h100' or 'h100x8' or 'h200'?"
    assert did_you_mean("sequence_len", ["seq_len", "dtype"]) == " Did you mean 'seq_len'?"
    assert did_you_mean("zzz", ["seq_len", "dtype"]) == ""
