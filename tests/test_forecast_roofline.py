"""The forecast without a pilot: the job's work counted from the config (against a hand count and
against torch's FLOP counter on a meta model), lengths read from the reference outputs the input
carries, and a preset's forecast with no weights and no GPU, its range and basis in --json."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaConfig

from workbook import cli, params as params_module
from workbook.forecast import roofline, work
from workbook.generation.settings import GenerationSettings
from workbook.hardware import Hardware
from workbook.tiny_model import build_tokenizer

# Small enough to count by hand: 2 layers, 4 query heads of 16 over 2 KV heads (grouped-query attention).
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 300
HEAD_DIM = HIDDEN // HEADS


def small_config(tied: bool = False) -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=512, tie_word_embeddings=tied)
    config._attn_implementation = "sdpa"
    return config


def hand_counted_linear_weights() -> int:
    attention = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2  # q, o; k, v
    mlp = 3 * HIDDEN * INTERMEDIATE  # gate, up, down
    return LAYERS * (attention + mlp)


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def counted(function) -> int:
    with FlopCounterMode(display=False) as counter:
        function()
    return counter.get_total_flops()


def test_model_work_counts_each_weight_by_hand():
    model = work.model_work(small_config(), "bf16")
    assert model.linear_parameters == hand_counted_linear_weights()
    assert model.head_parameters == HIDDEN * VOCAB
    assert model.attention_width == LAYERS * HEADS * HEAD_DIM
    assert model.kv_cache_bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    norms = LAYERS * 2 * HIDDEN + HIDDEN
    # An untied input embedding is gathered a row per token, not streamed; a tied one is the head.
    assert model.streamed_weight_bytes == 2 * (hand_counted_linear_weights() + HIDDEN * VOCAB + norms)
    tied = work.model_work(small_config(tied=True), "bf16")
    assert tied.streamed_weight_bytes == model.streamed_weight_bytes


def test_prefill_and_decode_flops_equal_a_hand_count_and_the_flop_counter():
    config, rows, length = small_config(), 3, 10
    model, meta = work.model_work(config, "fp32"), meta_model(config)
    linear = hand_counted_linear_weights()
    hand_prefill = (2 * linear * rows * length + 2 * HIDDEN * VOCAB * rows  # the last position's logits only
                    + 4 * LAYERS * HEADS * HEAD_DIM * rows * length * length)
    assert work.prefill_work(model, rows, length).flops == hand_prefill
    ids = torch.ones(rows, length, dtype=torch.long, device="meta")
    cache = {}

    def prefill():
        cache["past"] = meta(input_ids=ids, logits_to_keep=1, use_cache=True).past_key_values

    assert counted(prefill) == hand_prefill
    # The first decode step (new_tokens=2: the prefill gave the first token) attends length + 1 keys.
    hand_step = rows * 2 * (linear + HIDDEN * VOCAB) + 4 * LAYERS * HEADS * HEAD_DIM * rows * (length + 1)
    assert work.decode_work(model, rows, length, 2).flops == hand_step
    step = torch.ones(rows, 1, dtype=torch.long, device="meta")
    assert counted(lambda: meta(input_ids=step, past_key_values=cache["past"], use_cache=True, logits_to_keep=1,
                                cache_position=torch.tensor([length], device="meta"))) == hand_step


def test_decode_bytes_read_the_weights_each_step_and_each_rows_growing_cache():
    model = work.model_work(small_config(), "bf16")
    rows, prompt, new_tokens = 4, 20, 6
    steps = new_tokens - 1
    keys = rows * sum(prompt + step for step in range(1, new_tokens))
    written = rows * (model.kv_cache_bytes_per_token + VOCAB * 2)
    assert work.decode_work(model, rows, prompt, new_tokens).bytes == (
        steps * (model.streamed_weight_bytes + written) + keys * model.kv_cache_bytes_per_token)


def test_a_training_step_equals_the_flop_counter_forward_and_backward():
    config, rows, length = small_config(), 3, 16
    model, meta = work.model_work(config, "fp32"), meta_model(config)
    ids = torch.ones(rows, length, dtype=torch.long, device="meta")

    def step():
        meta(input_ids=ids, labels=ids).loss.backward()

    assert work.training_step_work(model, rows, length).flops == counted(step)
    # LoRA leaves the frozen weights' gradients out; checkpointing runs the forward twice.
    full = work.training_step_work(model, rows, length)
    forward = 2 * (model.linear_parameters + model.head_parameters) * rows * length
    assert full.flops - work.training_step_work(model, rows, length, lora=True).flops == forward
    attention = 4 * model.attention_width * rows * length * length
    assert work.training_step_work(model, rows, length, recompute=True).flops - full.flops == forward + attention


def test_static_batches_are_length_sorted_and_decode_until_their_longest_output():
    model = work.model_work(small_config(), "bf16")
    prompts, outputs = [5, 30, 12, 30, 7], [3, 50, 9, 4, 200]
    job = work.static_generation_work(model, prompts, outputs, batch_size=2, max_new_tokens=100)
    # Sorted longest first, ties in file order: (30: 50 out, 30: 4), (12: 9, 7: 200 -> capped 100), (5: 3).
    assert [(c.rows, c.longest_prompt, c.new_tokens) for c in job.calls] == [(2, 30, 50), (2, 12, 100), (1, 5, 3)]
    assert job.decode.forwards == 49 + 99 + 2
    assert job.padded_positions == 2 * 30 + 2 * 12 + 5
    assert job.output_tokens == 3 + 50 + 9 + 4 + 100


def test_one_request_at_a_time_costs_the_same_flops_static_or_continuous():
    model = work.model_work(small_config(), "bf16")
    prompts, outputs = [9, 4, 6], [5, 2, 7]
    static = work.static_generation_work(model, prompts, outputs, batch_size=1, max_new_tokens=64)
    stream = work.continuous_generation_work(model, prompts, outputs, batch_size=1, max_new_tokens=64)
    assert static.prefill.flops + static.decode.flops == pytest.approx(stream.prefill.flops + stream.decode.flops)


def write_prompts(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def tiny_params(tmp_path, records, **changes):
    prompts = write_prompts(tmp_path / "prompts.jsonl", records)
    params = params_module.load(params_module.profile_path("cpu"))
    return params_module.apply_overrides(params, {"prompts_path": str(prompts), "samples_per_prompt": 1,
                                                  "do_sample": False, **changes})


def settings(params) -> GenerationSettings:
    return GenerationSettings.from_params(params)


def test_output_lengths_come_from_the_reference_outputs_the_input_carries(tmp_path):
    tokenizer = build_tokenizer()
    records = [{"input": "What is 2 + 3?", "output": "5"},
               {"input": "What is 40 + 2?", "metadata": {"original_output": "The answer is 42."}}]
    lengths = roofline.job_lengths(settings(tiny_params(tmp_path, records)), tokenizer, expected=(3,))
    assert lengths.output_basis == "reference outputs in the input"  # they win over expected_new_tokens
    assert lengths.output_tokens == [len(tokenizer("5", add_special_tokens=False)["input_ids"]) + 1,
                                     len(tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"]) + 1]
    chat = [len(ids) for ids in roofline.tokenize_prompts(tokenizer, [r["input"] for r in records], True)]
    assert lengths.prompt_tokens == chat
    # Without reference outputs: the stated expected length, else none (max_new_tokens, the bound).
    bare = [{"input": r["input"]} for r in records]
    stated = roofline.job_lengths(settings(tiny_params(tmp_path, bare)), tokenizer, expected=(3,))
    assert (stated.output_basis, stated.output_tokens) == ("expected_new_tokens (params)", [3.0, 3.0])
    bound = roofline.job_lengths(settings(tiny_params(tmp_path, bare)), tokenizer)
    assert (bound.output_basis, bound.output_tokens) == ("max_new_tokens as the bound", None)


def test_a_preset_without_a_tokenizer_is_counted_by_its_bytes_and_says_so(tmp_path):
    records = [{"input": "x" * 40, "output": "y" * 400}]
    lengths = roofline.job_lengths(settings(tiny_params(tmp_path, records, model="Llama-3.2-1B")), None)
    assert lengths.prompt_tokens == [10] and lengths.output_tokens == [101.0]
    assert lengths.token_counts.startswith("estimated: UTF-8 bytes / 4")


def test_efficiency_is_measured_where_committed_and_a_labelled_prior_elsewhere(tmp_path):
    prior = roofline.efficiency_for("h100", "generate", root=tmp_path)
    assert prior.basis == "prior" and "prior (not measured on this GPU)" in prior.source
    assert prior.decode_bandwidth[0] < prior.decode_bandwidth[1] < prior.decode_bandwidth[2]
    (tmp_path / "h100").mkdir()
    (tmp_path / "h100" / roofline.EFFICIENCY_FILE).write_text(json.dumps(
        {"efficiency": {"generate": {"decode_bandwidth": 0.6, "compute": 0.4}}}))
    measured = roofline.efficiency_for("h100", "generate", root=tmp_path)
    assert measured.basis == "measured" and measured.decode_bandwidth[1] == 0.6 and measured.compute[1] == 0.4
    # Never another device's: the a100's row stays a prior.
    assert roofline.efficiency_for("a100-80gb", "generate", root=tmp_path).basis == "prior"


def test_time_is_each_calls_slower_roof(tmp_path):
    job = work.GenerationWork("static", 1, calls=[work.CallWork(1, 1, 2, work.Work(8e12, 1e9, 1),
                                                                 work.Work(1e9, 4e9, 1))])
    peaks = roofline.forecast.Peaks(flops=1e15, bytes_per_second=2e12, source="test")
    # Prefill: 8e12 FLOPs at 0.5 x 1e15 = 16 ms (its bytes 1 ms); decode: 4e9 bytes at 0.5 x 2e12 = 4 ms.
    assert roofline.seconds(job, peaks, {"decode_bandwidth": 0.5, "compute": 0.5}) == pytest.approx(0.016 + 0.004)


def test_a_preset_forecast_needs_no_weights_and_no_gpu_and_states_range_and_basis(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl",
                            [{"input": "word " * n, "output": "answer " * (3 * n)} for n in range(1, 40)])
    code = cli.main(["forecast", "--params", "h100", "--json", "--set", "model=Llama-3.2-1B",
                     f"prompts_path={prompts}", "max_new_tokens=256"])
    assert code == 0
    made = json.loads(capsys.readouterr().out)["without_pilot"]
    assert made["lengths"]["output_basis"] == "reference outputs in the input"
    assert made["job"]["prompts"] == 39
    row = next(row for row in made["rows"] if row["profile"] == "h100")
    low, high = row["wall_seconds_range"]
    assert 0 < low < row["wall_seconds"] < high <= row["every_output_to_max_new_tokens_seconds"]
    assert row["efficiency"]["basis"] == "prior" and "prior" in row["basis"]
    assert row["usd"] == pytest.approx(row["wall_seconds"] / 3600 * 2.5, abs=1e-4)  # h100: $2.5 per GPU-hour
    assert row["work"]["calls"] >= 1 and row["work"]["decode"]["bytes"] > 0


def test_auto_pilots_where_the_model_runs_here_and_counts_the_work_elsewhere(tmp_path):
    cpu = Hardware.from_params(params_module.load(params_module.profile_path("cpu")))
    assert roofline.pilot_or_work("tiny", cpu) == "pilot"  # the tiny model: built and run here
    assert roofline.pilot_or_work("Llama-3.1-8B", cpu) == "work"  # a preset: no weights
    folder = tmp_path / "model"
    folder.mkdir()
    small_config().save_pretrained(folder)
    assert roofline.pilot_or_work(str(folder), cpu) == "work"  # config.json only
    (folder / "model.safetensors").write_bytes(b"")
    assert roofline.pilot_or_work(str(folder), cpu) == "pilot"
    h100 = Hardware.from_params(params_module.load(params_module.profile_path("h100")))
    expected = "pilot" if torch.cuda.is_available() else "work"  # a GPU profile without its GPU here: work
    assert roofline.pilot_or_work(str(folder), h100) == expected


def test_the_report_shows_a_pilot_forecast_beside_the_work_forecast():
    made = roofline.RooflineForecast(
        mode="generate", profile="h100", model="m", job={"prompts": 2, "max_new_tokens": 8},
        lengths={"output_basis": "reference outputs"},
        rows=[{"profile": "h100", "batch_size": 4, "wall_seconds": 100.0, "wall_seconds_range": [80.0, 150.0],
               "gpu_hours": 0.03, "usd_range": [0.05, 0.1], "every_output_to_max_new_tokens_seconds": 200.0,
               "efficiency": {"basis": "prior"}}])
    lines = "\n".join(roofline.forecast_lines(made, [{"profile": "h100", "wall_seconds": 90.0}]))
    assert "| pilot forecast |" in lines and "| 90.0 s |" in lines and "| 100.0 s |" in lines


def test_a_packed_training_run_counts_its_rows_and_steps():
    model = work.model_work(small_config(), "bf16")
    # 10 examples of 100 tokens pack into ceil(1,000 / 256) = 4 rows; 2 rows a step: 2 steps an epoch.
    run = work.training_work(model, [100] * 10, seq_len=256, micro_batch_size=2, accumulation=1, processes=1,
                             epochs=3, max_steps=0, lora=False, recompute=False)
    assert (run.steps, run.rows_per_step) == (6, 2)
    assert run.total.flops == 12 * work.training_step_work(model, 1, 256).flops
    # A partial last step trains only the rows left: 3 rows, 2 a step, 2 epochs = 6 rows in 4 steps.
    partial = work.training_work(model, [256] * 3, seq_len=256, micro_batch_size=2, accumulation=1, processes=1,
                                 epochs=2, max_steps=0, lora=False, recompute=False)
    assert partial.steps == 4 and partial.total.flops == 6 * work.training_step_work(model, 1, 256).flops


def test_a_training_forecast_without_a_pilot_prices_its_steps_at_the_training_prior(capsys):
    code = cli.main(["forecast", "--params", "h100", "--mode", "train", "--method", "work", "--json",
                     "--set", "model=Llama-3.2-1B"])
    assert code == 0
    made = json.loads(capsys.readouterr().out)["without_pilot"]
    row = next(row for row in made["rows"] if row["profile"] == "h100")
    assert made["mode"] == "train" and row["efficiency"]["basis"] == "prior" and "Llama 3" in row["basis"]
    low, high = row["wall_seconds_range"]
    assert 0 < low < row["wall_seconds"] < high and row["work"]["total"]["flops"] > 0


def test_a_mixture_of_experts_counts_each_tokens_routed_experts_only():
    from transformers import MixtralConfig
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=8,
                           num_experts_per_tok=2)
    attention = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2
    router, experts = 8 * HIDDEN, 8 * 3 * HIDDEN * INTERMEDIATE
    assert work.model_work(config, "bf16").linear_parameters == LAYERS * (attention + router + experts * 2 / 8)


def test_the_forecast_checks_its_count_against_torchs_flop_counter(tmp_path):
    params = tiny_params(tmp_path, [{"input": "What is 2 + 3?", "output": "5"}])
    checked = roofline.forecast_without_pilot(params, profiles={}, log=lambda line: None).flop_counter_check
    assert checked["relative_difference"] == {"prefill": 0.0, "decode_step": 0.0}


def test_a_profile_whose_batch_does_not_fit_gets_no_time_and_a_job_that_fits_nowhere_is_refused():
    # A forecast at a batch the run could never start with would price a run that cannot happen.
    from workbook.planner.plans import DoesNotFitError
    h100 = params_module.load_all()["h100"]
    job = params_module.Params({**h100, "model": "Llama-3.2-1B", "seq_len": 2048})
    with pytest.raises(DoesNotFitError, match="the largest batch that fits is"):
        roofline.fitting_batch({**job, "micro_batch_size": 4096}, "train")
    assert roofline.fitting_batch({**job, "micro_batch_size": "auto"}, "train") >= 1
    unfit = DoesNotFitError("does not fit, not even at batch 1")
    rows = [{"profile": "h100", "wall_seconds": 10.0}, {"profile": "v100", "wall_seconds": None, "error": unfit}]
    assert roofline.require_somewhere_to_run(rows, "v100") == [{"profile": "h100", "wall_seconds": 10.0},
                                                               {"profile": "v100", "wall_seconds": None}]
    with pytest.raises(DoesNotFitError):
        roofline.require_somewhere_to_run([{"profile": "v100", "wall_seconds": None, "error": unfit}], "v100")


@pytest.mark.parametrize("value, expected", [("400", "400"), (400, "400"), ("120, 300,650", "120, 300,650"), ("", "")])
def test_expected_new_tokens_takes_one_length_or_several(value, expected):
    assert params_module.validate_value("expected_new_tokens", value, "params/h100.yaml:3") == expected
    assert params_module.parse_overrides(["expected_new_tokens=400"]) == {"expected_new_tokens": "400"}


@pytest.mark.parametrize("value", ["0", "-5", "400 tokens", "1.5", "120,,300", "auto", True])
def test_expected_new_tokens_refuses_what_is_no_length_and_names_the_key(value):
    with pytest.raises(params_module.ParamsError,
                       match=r"params/h100.yaml:3: 'expected_new_tokens' is .*; expected comma-separated positive "
                             r"integers.*or '' \(not stated\)"):
        params_module.validate_value("expected_new_tokens", value, "params/h100.yaml:3")


def without_pilot(tmp_path, records, capsys, *settings_, flag=None) -> dict:
    """``workbook forecast --method work --json`` for an h100 job of a preset over ``records``."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", records)
    code = cli.main(["forecast", "--params", "h100", "--method", "work", "--json", *(flag or []), "--set",
                     "model=Llama-3.2-1B", f"prompts_path={prompts}", "max_new_tokens=256", "batch_size=8", *settings_])
    assert code == 0
    return json.loads(capsys.readouterr().out)["without_pilot"]


def h100_row(made: dict) -> dict:
    return next(row for row in made["rows"] if row["profile"] == "h100")


BARE = [{"input": "word " * n} for n in range(1, 25)]  # prompts without reference outputs


def test_the_forecast_takes_expected_new_tokens_where_the_input_carries_no_outputs_and_says_so(tmp_path, capsys):
    stated = without_pilot(tmp_path, BARE, capsys, "expected_new_tokens=100")
    assert stated["lengths"]["output_basis"] == "expected_new_tokens (params)"
    assert stated["lengths"]["expected_new_tokens"] == [100] and stated["lengths"]["output_tokens_total"] == 24 * 100
    assert any(note.startswith("outputs: expected_new_tokens (params): every output 100 tokens") for note in stated["notes"])
    row = h100_row(stated)
    assert row["basis"].endswith("outputs: expected_new_tokens (params)")
    low, high = row["wall_seconds_range"]
    assert low < row["wall_seconds"] < high < row["every_output_to_max_new_tokens_seconds"]
    bound = without_pilot(tmp_path, BARE, capsys)  # not stated: every output runs to max_new_tokens
    assert bound["lengths"]["output_basis"] == "max_new_tokens as the bound"
    assert h100_row(bound)["wall_seconds"] > row["wall_seconds"]
    # The command line's flag sets the same key; the terminal report names the basis too.
    assert h100_row(without_pilot(tmp_path, BARE, capsys, flag=["--expected-new-tokens", "100"])) == row
    prompts = tmp_path / "prompts.jsonl"
    assert cli.main(["forecast", "--params", "h100", "--method", "work", "--expected-new-tokens", "100", "--set",
                     "model=Llama-3.2-1B", f"prompts_path={prompts}", "max_new_tokens=256"]) == 0
    assert "outputs: expected_new_tokens (params)" in capsys.readouterr().out
    assert cli.main(["forecast", "--params", "h100", "--method", "work", "--expected-new-tokens", "0"]) == 2
    assert "'expected_new_tokens' is '0'" in capsys.readouterr().err


def test_reference_outputs_in_the_input_win_over_expected_new_tokens(tmp_path, capsys):
    records = [{**record, "output": "answer " * 30} for record in BARE]
    made = without_pilot(tmp_path, records, capsys, "expected_new_tokens=200")
    assert made["lengths"]["output_basis"] == "reference outputs in the input"
    assert made["lengths"]["expected_new_tokens"] is None
    assert h100_row(made)["basis"].endswith("outputs: reference outputs in the input")
    # Some records without one: the stated length counts for all, and a note says why.
    partly = without_pilot(tmp_path, records[:3] + BARE[3:], capsys, "expected_new_tokens=200")
    assert partly["lengths"]["output_basis"] == "expected_new_tokens (params)"
    assert "3 of 24 records carry a reference output; all must for the forecast to use them" in partly["notes"]


def test_a_distribution_of_lengths_gives_a_range_from_all_at_the_shortest_to_all_at_the_longest(tmp_path, capsys):
    one = {length: h100_row(without_pilot(tmp_path, BARE, capsys, f"expected_new_tokens={length}"))
           for length in (40, 256)}
    # 900 is over max_new_tokens (256): the job stops there, so it counts as 256.
    made = without_pilot(tmp_path, BARE, capsys, "expected_new_tokens=40,120,900")
    assert made["lengths"]["expected_new_tokens"] == [40, 120, 900]
    assert made["lengths"]["output_tokens_total"] == 8 * (40 + 120 + 256)  # each length an equal share of 24
    row = h100_row(made)
    low, high = row["wall_seconds_range"]
    assert low == pytest.approx(one[40]["wall_seconds_range"][0], rel=1e-6)
    assert high == pytest.approx(one[256]["wall_seconds_range"][1], rel=1e-6)
    # A static batch decodes until its longest output: batches of 8 nearly all hold a 256.
    assert one[40]["wall_seconds"] < row["wall_seconds"] <= one[256]["wall_seconds"]
    assert any("the range runs from every output at 40 tokens" in note for note in made["notes"])
    assert any("each length over max_new_tokens (256) counted as 256" in note for note in made["notes"])


def test_the_lengths_are_dealt_in_equal_shares_in_the_same_order_every_time():
    dealt = roofline.dealt([10.0, 20.0, 30.0], 7)
    assert sorted(dealt) == [10.0, 10.0, 10.0, 20.0, 20.0, 30.0, 30.0]
    assert dealt == roofline.dealt([10.0, 20.0, 30.0], 7)
