"""Hugging Face's pipeline("text-generation") measured beside the workbook's strategies: on the tiny
model on CPU it runs the sweep's prompts to full length (counted from ids), gives the engine's greedy
tokens for the same input ids, and the report states the workbook's best over it. A few seconds."""

import importlib

import pytest
import torch

from workbook import bench, gpu, models, params
from workbook.generation import Prompt
from workbook.paths import PARAMS_DIR

generation_sweep = importlib.import_module("workbook.bench.generation_sweep")  # the package exports a function so named
hf_pipeline = importlib.import_module("workbook.bench.hf_pipeline")

EXAMPLES, NEW_TOKENS = 6, 12  # without min_new_tokens the tiny model ends these 6 after 6-11 tokens


@pytest.fixture(scope="module")
def sweep(tiny_model_path):
    """seed-before (one at a time), static-sorted and hf-pipeline at batches 4 and 6 on the tiny model."""
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    chosen = bench.BenchSettings.from_params({
        **cpu, "bench_strategies": "seed-before,static-sorted,hf-pipeline", "bench_batch_sizes": "4,6",
        "bench_examples": EXAMPLES, "bench_max_new_tokens": NEW_TOKENS, "prompt_len": 16, "bench_repeats": 1})
    return generation_sweep.generation_sweep(chosen, log=lambda line: None)


def pipeline_points(sweep):
    return [p for p in sweep["points"] if p["strategy"] == bench.HF_PIPELINE]


def test_the_pipeline_runs_every_prompt_to_full_length_with_the_engines_greedy_tokens(sweep):
    points = pipeline_points(sweep)
    assert [p["batch_size"] for p in points] == [4, 6]
    for point in points:
        # Full length only because min_new_tokens reached the pipeline (see NEW_TOKENS).
        assert point["examples"] == EXAMPLES and point["failed"] == 0
        assert point["full_length_outputs"] == EXAMPLES and point["output_tokens"] == EXAMPLES * NEW_TOKENS
        assert point["pipeline_prompts"]["prompts_with_the_sweeps_ids"] == EXAMPLES  # text-stable prompts: same ids
        # Greedy: the pipeline's tokens are one-at-a-time generation's for every prompt (a sampling default fails).
        assert point["compared_with_one_at_a_time"] == EXAMPLES
        assert point["identical_to_one_at_a_time"] == EXAMPLES
        assert point["output_tokens_per_second"]["median"] > 0 and point["time_to_first_result_seconds"] > 0
        assert point["padding_waste"] > 0  # file order, prompts of uneven lengths: the pipeline pads
        ratio = point["workbook_best_over_pipeline"]
        assert ratio["strategy"] == "static-sorted"  # the only workbook strategy at these batch sizes
        ours = next(p for p in sweep["points"] if p["strategy"] == "static-sorted"
                    and p["batch_size"] == point["batch_size"])
        assert ratio["ratio"] == pytest.approx(ours["output_tokens_per_second"]["median"]
                                               / point["output_tokens_per_second"]["median"])


def test_new_tokens_are_counted_from_the_ids_after_the_padding_and_the_prompt():
    assert hf_pipeline.new_tokens([0, 0, 7, 8, 9, 5, 6], [7, 8, 9], pad_token_id=0) == [5, 6]
    assert hf_pipeline.new_tokens([0, 7, 0, 5], [7, 0], pad_token_id=0) == [5]  # a pad id inside the prompt
    with pytest.raises(bench.BenchError, match="does not hold the prompt"):
        hf_pipeline.new_tokens([0, 7, 9, 5, 6], [7, 8], pad_token_id=0)


def test_ids_a_tokenizer_cannot_decode_keep_the_prompts_length_not_its_ids(tiny_model_path):
    tokenizer = models.load_tokenizer("tiny")
    prompts = [Prompt(0, [40, 41, 42], NEW_TOKENS), Prompt(1, [40, 5000, 128255, 41], NEW_TOKENS)]  # 8B-sized ids
    texts, ran = hf_pipeline.prompt_texts(prompts, tokenizer)
    assert ran[0] == [40, 41, 42] and tokenizer.decode([40, 41, 42]) == texts[0]
    assert len(ran[1]) == 4 and ran[1] != prompts[1].token_ids and max(ran[1]) < len(tokenizer)
    assert not set(ran[1]) & set(tokenizer.all_special_ids)


def test_the_report_shows_the_pipeline_rows_and_the_workbooks_best_over_it(sweep):
    report = {"generation": sweep, "hardware": gpu.detect(), "threads": torch.get_num_threads(),
              "versions": gpu.software_versions()}
    rows = bench.generation_rows(report)
    pipeline_rows = [row for row in rows if row["strategy"] == bench.HF_PIPELINE]
    assert [row["batch"] for row in pipeline_rows] == ["4", "6"]
    assert all(row["vs hf-pipeline, same batch"] == "1.00x" for row in pipeline_rows)
    assert next(row for row in rows if row["strategy"] == "seed-before")["vs hf-pipeline, same batch"] == "n/a"
    lines = bench.pipeline_comparison_lines(report)
    assert "pipeline('text-generation')" in lines[0] and "greedy" in lines[0]
    assert f"transformers {report['versions']['transformers']}" in lines[0] and "(CPU, " in lines[0]
    for point, line in zip(pipeline_points(sweep), lines[1:]):
        ratio = point["workbook_best_over_pipeline"]["ratio"]
        assert line.startswith(f"- batch {point['batch_size']}: workbook best / hf-pipeline = **{ratio:.2f}x** "
                               "(static-sorted ")
        assert f"{EXAMPLES} of {EXAMPLES} outputs identical to one-at-a-time" in line
    # The seeds' claim and the goals are the engine's: the pipeline's points do not count there.
    claims = {row["claim"]: row["measured"] for row in bench.claims_table(sweep, None, None, on_gpu=False)}
    assert f"{EXAMPLES * 3} of {EXAMPLES * 3} outputs over 3 points" in \
        claims["slice each output at its count of non-pad prompt tokens"]


def test_the_strategy_is_parsed_and_runs_per_batch_size_in_file_order():
    assert bench.parse_strategies("static-sorted,hf-pipeline") == ["static-sorted", "hf-pipeline"]
    points = bench.sweep_points(bench.BenchSettings(bench_batch_sizes="8,32", bench_strategies="hf-pipeline"),
                                torch.device("cpu"))
    assert [(p["batch_size"], p["backend"], p["sort"]) for p in points] == [(8, "static", False), (32, "static", False)]
    assert "hf-pipeline" in params.load(PARAMS_DIR / "cpu.yaml")["bench_strategies"].split(",")
