"""The generation engine: batched equals one-at-a-time, nothing lost to a kill, an OOM or a bad line."""

import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from workbook import arithmetic, cli, decoding, generation, jsonl, params
from workbook.generation import engine
from workbook.paths import PARAMS_DIR, REPO_ROOT


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    """(model, tokenizer) of the tiny model in float32 on CPU, loaded once for this module."""
    return generation.load_model(str(tiny_model_path), "fp32", "cpu")


def write_prompts(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# The cpu profile's run is a rejection-sampling round (8 sampled answers per question, one kept);
# the engine's guarantees tested here are stated for one greedy output per prompt, so tests pin it.
ONE_GREEDY_OUTPUT = {"do_sample": False, "samples_per_prompt": 1, "max_accepted_per_prompt": 0}
GREEDY_SET = [f"{key}={str(value).lower()}" for key, value in ONE_GREEDY_OUTPUT.items()]  # for --set


def job_params(prompts_path, output_path, **changes):
    """The cpu profile pointed at test files, greedy with one output per prompt, with validated changes."""
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(prompts_path=str(prompts_path), output_path=str(output_path), log_every_batches=0,
                  verifier="", **ONE_GREEDY_OUTPUT)  # the cpu profile verifies; these tests are about generation
    for key, value in changes.items():
        values[key] = params.validate_value(key, value, "test")
    return values


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outputs_by_id(path):
    return {r["metadata"]["example_id"]: (r["output"], r["metadata"]["finish_reason"]) for r in read_records(path)}


# Prompts of many lengths (1 to ~60 characters, ~15 to ~45 tokens with the chat template), so batches carry real left padding and
# rows that end early; arithmetic ones end with end of sequence, odd ones often run to the limit.
VARIED_PROMPTS = [record["input"] for record in arithmetic.sample_records()[:10]] + [
    "x", "Hi", "What is 7 + 8? What is 7 + 8?", "Add 12 and 30.", "What is 1 + 1?" * 3, "Tell me: what is 20 + 22?",
    "What is 45 - 45?", "9 + 9 = ?", "What is 3 + 4? Answer with a number, please.", "Sum: 10 + 20 + 30?", "?",
    "What is 88 - 16?  ", "Compute 5 - 2.", "What is 0 + 0?"]


def greedy_one_at_a_time(model, prompts, settings):
    """Reference: plain `generate` on each prompt alone (no padding), cut at the first end of sequence;
    with its finish reason: "eos" where it ended so, else "length"."""
    results = {}
    for prompt in prompts:
        # An explicit mask: without one, generate masks every prompt token equal to the pad id.
        ids = torch.tensor([prompt.token_ids])
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=prompt.max_new_tokens,
                                do_sample=False, eos_token_id=list(settings.eos_token_ids),
                                pad_token_id=settings.pad_token_id)
        new = output[0, len(prompt.token_ids):].tolist()
        ends = [i for i, token in enumerate(new) if token in settings.eos_token_ids]
        results[prompt.index] = (new[: ends[0] + 1], "eos") if ends else (new, "length")
    return results


def engine_results(backend, prompts):
    collected = {}

    def write(outcome):
        assert not outcome.failed
        collected.update({prompt.index: (completion.token_ids, completion.finish_reason)
                          for prompt, completion in outcome.completed})

    generation.run_batches(backend, prompts, write=write)
    return collected


def make_prompts(tiny, texts, max_new_tokens=8):
    model, tokenizer = tiny
    ids = generation.tokenize_prompts(tokenizer, texts, use_chat_template=True)
    # The pad id the job lends (an end id: the tokenizer has none), not 0, which is <|begin_of_text|>.
    settings = generation.DecodingSettings(max_new_tokens, decoding.eos_token_ids(model, tokenizer),
                                           decoding.pad_token_id(model, tokenizer))
    return [generation.Prompt(i, row, max_new_tokens) for i, row in enumerate(ids)], settings


@pytest.fixture(scope="module")
def varied(tiny):
    """The varied prompts, their decoding settings, and their one-at-a-time greedy outputs."""
    # 3 new tokens: the well-trained tiny model replies "7<|eot_id|>" (2 tokens) to "123<|eot_id|>" (4),
    # so some rows end early at an end id and the three-digit answers run into the limit.
    prompts, settings = make_prompts(tiny, VARIED_PROMPTS, max_new_tokens=3)
    reference = greedy_one_at_a_time(tiny[0], prompts, settings)
    lengths = {len(tokens) for tokens, _ in reference.values()}
    assert min(lengths) < settings.max_new_tokens == max(lengths), "outputs should end early and at the limit"
    assert {finish for _, finish in reference.values()} == {"eos", "length"}
    return prompts, settings, reference


EQUALITY_CASES = [
    ("static", len(VARIED_PROMPTS), [1, 5, len(VARIED_PROMPTS)]),
    ("continuous", len(VARIED_PROMPTS), [3, len(VARIED_PROMPTS)]),
    # torch.compile on CPU takes 10-40 s per batch size (each size compiles anew), so one size whose
    # batches are all full keeps the suite fast.
    ("static-compiled", 12, [6]),
]


def test_every_backend_the_params_offer_is_proven():
    assert sorted(case[0] for case in EQUALITY_CASES) == sorted(generation.BACKENDS)


# torch.compile's case takes minutes on 2 cores: `make test` runs it, `make test-fast` leaves it out.
@pytest.mark.parametrize("backend, prompt_count, batch_sizes",
                         [pytest.param(*case, marks=pytest.mark.slow) if case[0] == "static-compiled" else case
                          for case in EQUALITY_CASES])
def test_batched_greedy_equals_one_at_a_time(tiny, varied, backend, prompt_count, batch_sizes):
    prompts, settings, reference = varied
    prompts = prompts[:prompt_count]
    for batch_size in batch_sizes:
        made = generation.make_backend(backend, tiny[0], settings, batch_size)
        used = spy_on_static_caches(made) if backend == "static-compiled" else None
        results = engine_results(made, prompts)
        assert results == {p.index: reference[p.index] for p in prompts}, \
            f"{backend} at batch {batch_size} differs from one-at-a-time generation"
        if used is not None:
            # CUDA graphs stay valid only while every batch writes the same cache tensors: a new cache
            # per batch (generate's own default) would have them recorded again each time.
            assert len(used) == prompt_count // batch_size >= 2
            assert len({id(cache) for cache, _ in used}) == 1
            pointers = [pointer for _, pointer in used[1:]] + [used[0][0].layers[0].keys.data_ptr()]
            assert len(set(pointers)) == 1, "the kept static cache moved between batches"


@pytest.mark.slow
def test_a_short_warm_up_call_leaves_static_compiled_a_cache_the_job_reuses(tiny, varied):
    # The pilot warms a backend up with two new tokens, then times the job's batch: a cache sized for the
    # warm-up alone would be replaced (a recompile, CUDA graphs recorded again) inside the timed batch.
    prompts, settings, reference = varied
    backend = generation.make_backend("static-compiled", tiny[0], settings, 6)
    used = spy_on_static_caches(backend)
    batch = prompts[:6]
    backend.generate([dataclasses.replace(p, max_new_tokens=2) for p in batch])
    output = backend.generate(batch)
    assert len({id(cache) for cache, _ in used}) == 1
    assert {p.index: (c.token_ids, c.finish_reason) for p, c in zip(batch, output.completions)} == {p.index: reference[p.index]
                                                                                for p in batch}


def spy_on_static_caches(backend):
    """Records each static cache ``backend`` hands to generate, with its first layer's key address
    at that moment (None before its first batch allocates it)."""
    used, hand_out = [], backend.static_cache

    def spied(*args):
        cache = hand_out(*args)
        keys = getattr(cache.layers[0], "keys", None)
        used.append((cache, None if keys is None else keys.data_ptr()))
        return cache

    backend.static_cache = spied
    return used


def test_output_is_sliced_at_the_padded_prompt_length_not_at_the_unpadded_count(tiny):
    # Seed 000's slice (at the count of non-pad tokens) would start a short prompt's output inside
    # its own prompt; the long prompt forces 30+ pad tokens on the short one.
    prompts, settings = make_prompts(tiny, ["What is 2 + 2?", "Please tell me right now: what is 40 + 2?"])
    results = engine_results(generation.make_backend("static", tiny[0], settings, 2), prompts)
    text = tiny[1].decode(results[0][0], skip_special_tokens=True)
    assert "?" not in text and "What" not in text and results == greedy_one_at_a_time(tiny[0], prompts, settings)


def test_a_job_writes_seed_format_records_counts_and_a_summary(tmp_path, tiny):
    records = [{**r, "source": "test"} for r in arithmetic.sample_records()[:20]]
    records[3] = {"input": records[3]["input"], "output": records[3]["output"]}  # no id: the line number
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    lines = []
    summary = generation.run_job(job_params(prompts, tmp_path / "out.jsonl", batch_size=6, log_every_batches=2),
                               tmp_path / "out.jsonl", model=tiny[0], tokenizer=tiny[1], log=lines.append,
                               show_progress=False)
    written = read_records(tmp_path / "out.jsonl")
    assert [r["metadata"]["example_id"] for r in written] == [r.get("id", 4) for r in records]  # input order
    first = written[0]
    assert first["input"] == records[0]["input"] and first["domain"] == "arithmetic" and first["source"] == "test"
    assert first["metadata"]["original_output"] == records[0]["output"]
    assert first["metadata"]["teacher_model"] == "tiny"
    assert first["metadata"]["generation_params"] == {"temperature": None, "top_p": None, "max_new_tokens": 8,
                                                      "do_sample": False, "seed": None}
    prompt_ids = generation.tokenize_prompts(tiny[1], [r["input"] for r in written], use_chat_template=True)
    assert all(r["metadata"]["finish_reason"] in ("eos", "length") and r["metadata"]["output_tokens"] >= 1
               and r["metadata"]["prompt_tokens"] == len(ids) for r, ids in zip(written, prompt_ids))
    # "length": the limit ended it, and its text is every token; "eos": the model ended it, and the
    # end token is counted but not written (the replies are digits, one token each).
    for r in written:
        tokens, reason = r["metadata"]["output_tokens"], r["metadata"]["finish_reason"]
        assert reason == "eos" or tokens == 8, r
        text_tokens = len(tiny[1](r["output"], add_special_tokens=False)["input_ids"])
        assert text_tokens == (tokens if reason == "length" else tokens - 1), r
    assert summary["generated"] == summary["in_output"] == 20 and summary["unaccounted"] == 0
    assert summary["batches"] == 4 and len(summary["batch_list"]) == 4
    assert all(b["longest_output_tokens"] >= 1 for b in summary["batch_list"])
    assert summary["examples_per_minute"] > 0 and summary["output_tokens_per_second"] > 0
    assert 0 <= summary["padding_waste"] < 1 and summary["failures_path"] is None
    assert json.loads((tmp_path / "out.summary.json").read_text())["in_output"] == 20
    assert any(line.startswith("batch 2/4: 12/20 (60.0%) - generated 12, failed 0") for line in lines)
    accuracy = generation.task_accuracy(written)
    assert accuracy["scored"] == 19 and accuracy["decoding"] == "greedy"  # the line without a domain is not scored


def test_a_rerun_skips_what_is_written_and_regenerates_only_a_torn_last_line(tmp_path, tiny):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:12])
    output = tmp_path / "out.jsonl"
    run = dict(model=tiny[0], tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    generation.run_job(job_params(prompts, output), output, **run)
    complete = output.read_bytes()
    assert generation.run_job(job_params(prompts, output), output, **run)["generated"] == 0
    assert output.read_bytes() == complete
    lines = complete.decode().splitlines(keepends=True)
    output.write_text("".join(lines[:-1]) + lines[-1][:25])  # a kill in the middle of the last write
    said = []
    again = generation.run_job(job_params(prompts, output), output, **{**run, "log": said.append})
    assert again["generated"] == 1 and output.read_bytes() == complete
    assert any("cut its torn last line (25 bytes" in line for line in said)
    output.write_text("".join(lines[:-1]) + lines[-1].rstrip("\n"))  # whole, only its newline missing (a hand edit)
    assert generation.run_job(job_params(prompts, output), output, **run)["generated"] == 0
    assert output.read_bytes() == complete


class OutOfMemoryAbove:
    """The model, except that generate() raises the real CUDA out-of-memory error above `limit` rows."""

    def __init__(self, model, limit):
        self.model, self.limit, self.batch_sizes = model, limit, []

    def generate(self, input_ids, **kwargs):
        self.batch_sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
                "of which 1.25 GiB is free.")
        return self.model.generate(input_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.slow
def test_out_of_memory_splits_the_batch_and_loses_nothing(tmp_path, tiny):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:12])
    run = dict(tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    expected_output = tmp_path / "expected.jsonl"
    generation.run_job(job_params(prompts, expected_output, batch_size=8), expected_output, model=tiny[0], **run)
    wrapped = OutOfMemoryAbove(tiny[0], limit=3)
    output = tmp_path / "out.jsonl"
    summary = generation.run_job(job_params(prompts, output, batch_size=8), output, model=wrapped, **run)
    assert wrapped.batch_sizes[:4] == [8, 4, 2, 2]
    assert summary["in_output"] == 12 and summary["failed"] == 0 and summary["oom_or_error_splits"] > 0
    assert outputs_by_id(output) == outputs_by_id(expected_output)


@pytest.mark.slow
def test_an_example_that_runs_out_of_memory_alone_is_recorded_and_retried_on_rerun(tmp_path, tiny):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:6])
    output = tmp_path / "out.jsonl"
    run = dict(tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    summary = generation.run_job(job_params(prompts, output, batch_size=4), output,
                               model=OutOfMemoryAbove(tiny[0], limit=0), **run)
    failures = read_records(tmp_path / "out.failures.jsonl")
    assert summary["failed"] == 6 and summary["in_output"] == 0 and summary["unaccounted"] == 0
    assert sorted(f["line"] for f in failures) == [1, 2, 3, 4, 5, 6]
    assert all(f["stage"] == "generation" and "CUDA out of memory" in f["error"] for f in failures)
    rerun = generation.run_job(job_params(prompts, output, batch_size=4), output, model=tiny[0], **run)
    assert rerun["in_output"] == 6 and rerun["in_failures"] == 0
    assert not (tmp_path / "out.failures.jsonl").exists()


class FailsOn:
    """The model, except that a batch holding the prompt `bad_ids` raises ValueError (or every batch)."""

    def __init__(self, model, bad_ids=None):
        self.model, self.bad_ids = model, bad_ids

    def generate(self, input_ids, attention_mask, **kwargs):
        rows = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        if self.bad_ids is None or self.bad_ids in rows:
            raise ValueError("index out of range in self")
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.slow
def test_an_error_is_isolated_to_its_example_and_a_systematic_one_stops_the_run(tmp_path, tiny):
    records = arithmetic.sample_records()[:10]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    bad_ids = tiny[1](records[4]["input"])["input_ids"]
    output = tmp_path / "out.jsonl"
    run = dict(tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    summary = generation.run_job(job_params(prompts, output, batch_size=8, use_chat_template=False), output,
                               model=FailsOn(tiny[0], bad_ids), **run)
    assert summary["in_output"] == 9 and summary["failed"] == 1
    failure, = read_records(tmp_path / "out.failures.jsonl")
    assert failure["example_id"] == records[4]["id"] and failure["error"] == "ValueError: index out of range in self"
    with pytest.raises(generation.GenerationError, match="3 examples in a row failed alone.*broken setup"):
        generation.run_job(job_params(prompts, tmp_path / "other.jsonl", batch_size=8), tmp_path / "other.jsonl",
                         model=FailsOn(tiny[0]), **run)


def prompt_tokens(tiny, text):
    """The prompt's token ids as the job formats it (the cpu profile's chat template)."""
    return generation.tokenize_prompts(tiny[1], [text], use_chat_template=True)[0]


def filled_prompt(tiny, tokens):
    """A question padded with " +" (one token each; the chat template would trim trailing spaces) to
    exactly ``tokens`` prompt tokens."""
    question = "What is 2 + 2?"
    text = question + " +" * (tokens - len(prompt_tokens(tiny, question)))
    assert len(prompt_tokens(tiny, text)) == tokens
    return text


def test_bad_lines_and_long_prompts_follow_their_policies(tmp_path, tiny):
    good = arithmetic.sample_records()[:4]
    too_long = "What is 1 + 1? " * 30  # ~300 tokens: more than the tiny model's 256 positions
    too_long_tokens = len(prompt_tokens(tiny, too_long))
    nearly_full = filled_prompt(tiny, 253)  # room for 3 new tokens
    lines = [json.dumps(good[0]), "{not json", json.dumps(good[1]), json.dumps({"input": ""}),
             json.dumps({"id": "long", "input": too_long}), json.dumps(good[2]),
             json.dumps({"id": "tight", "input": nearly_full}), json.dumps(good[3])]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    run = dict(model=tiny[0], tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:2: not valid JSON.*on_bad_line: skip"):
        generation.run_job(job_params(prompts, output), output, **run)
    with pytest.raises(jsonl.DataError, match=rf"in.jsonl:5: prompt of {too_long_tokens} tokens leaves no room.*256.*"
                                             r"on_long_prompt: skip"):
        generation.run_job(job_params(prompts, output, on_bad_line="skip"), output, **run)
    assert not output.exists() or output.read_text() == ""  # both stopped before generating
    summary = generation.run_job(job_params(prompts, output, on_bad_line="skip", on_long_prompt="skip"), output, **run)
    failures = {f["line"]: f for f in read_records(tmp_path / "out.failures.jsonl")}
    assert sorted(failures) == [2, 4, 5]
    assert failures[2]["stage"] == "input" and "not valid JSON" in failures[2]["error"]
    assert failures[4]["error"] == "'input' is empty" and failures[5]["stage"] == "prompt_too_long"
    written = {r["metadata"]["example_id"]: r for r in read_records(output)}
    assert sorted(map(str, written)) == sorted([g["id"] for g in good] + ["tight"])
    assert written["tight"]["metadata"]["output_tokens"] <= 3  # capped by the context, as vLLM does
    assert summary["unaccounted"] == 0 and summary["bad_input_lines"] == 2 and summary["too_long"] == 1


def test_a_prompt_that_fills_the_context_exactly_leaves_no_room_and_follows_the_policy(tmp_path, tiny):
    full = filled_prompt(tiny, 256)  # the tiny model's whole context
    prompts = write_prompts(tmp_path / "in.jsonl", [{"id": "full", "input": full}])
    output = tmp_path / "out.jsonl"
    with pytest.raises(jsonl.DataError, match=r"in.jsonl:1: prompt of 256 tokens leaves no room.*256"):
        generation.run_job(job_params(prompts, output), output, model=tiny[0], tokenizer=tiny[1],
                           log=lambda line: None, show_progress=False)


def test_sampling_is_recorded_and_repeats_with_the_same_seed(tmp_path, tiny):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:8])
    run = dict(model=tiny[0], tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    sampled = dict(do_sample=True, temperature=1.5, top_p=0.95, seed=7, max_new_tokens=6)
    for name in ("a.jsonl", "b.jsonl"):
        generation.run_job(job_params(prompts, tmp_path / name, **sampled), tmp_path / name, **run)
    first = read_records(tmp_path / "a.jsonl")
    assert first[0]["metadata"]["generation_params"] == {"temperature": 1.5, "top_p": 0.95, "max_new_tokens": 6,
                                                         "do_sample": True, "seed": 7}
    assert outputs_by_id(tmp_path / "a.jsonl") == outputs_by_id(tmp_path / "b.jsonl")
    # It samples: another seed draws other tokens; a temperature near 0, or a top_p that keeps only
    # the likeliest token, draws the greedy ones (so both settings reach the sampler).
    outputs = {}
    for name, changes in (("seed8", dict(sampled, seed=8)), ("greedy", dict(max_new_tokens=6)),
                          ("cold", dict(sampled, temperature=1e-3, top_p=1.0)), ("narrow", dict(sampled, top_p=1e-6))):
        generation.run_job(job_params(prompts, tmp_path / name, **changes), tmp_path / name, **run)
        outputs[name] = outputs_by_id(tmp_path / name)
    assert outputs["seed8"] != outputs_by_id(tmp_path / "a.jsonl")
    assert outputs["cold"] == outputs["greedy"] == outputs["narrow"] != outputs_by_id(tmp_path / "a.jsonl")
    with pytest.raises(generation.GenerationError, match="sampling needs temperature > 0"):
        generation.run_job(job_params(prompts, tmp_path / "c.jsonl", do_sample=True, temperature=0.0),
                         tmp_path / "c.jsonl", **run)


class OutOfMemoryInFlight:
    """Replaces the model's forward: the forward passes numbered in ``failing`` (1-based) raise the
    real CUDA out-of-memory error, as a step of the continuous-batching loop would mid-run."""

    def __init__(self, forward, failing):
        self.forward, self.failing, self.calls = forward, set(failing), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity "
                                         "of 79.11 GiB of which 1.25 GiB is free.")
        return self.forward(*args, **kwargs)


@pytest.mark.slow
def test_an_out_of_memory_in_flight_lowers_the_continuous_limit_and_loses_nothing(tmp_path, tiny, monkeypatch):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:12])
    lines = []
    run = dict(tokenizer=tiny[1], log=lines.append, show_progress=False)
    expected = tmp_path / "expected.jsonl"
    generation.run_job(job_params(prompts, expected, batch_size=8), expected, model=tiny[0], **run)
    output = tmp_path / "out.jsonl"
    monkeypatch.setattr(tiny[0], "forward", OutOfMemoryInFlight(tiny[0].forward, failing={3, 4}))
    summary = generation.run_job(job_params(prompts, output, batch_size=8, backend="continuous"), output,
                                 model=tiny[0], **run)
    assert summary["in_output"] == 12 and summary["failed"] == 0 and summary["oom_or_error_splits"] == 2
    assert any("out of memory with 8 requests in flight" in line and "at most 4 in flight" in line for line in lines)
    assert outputs_by_id(output) == outputs_by_id(expected)
    assert read_records(output) and not (tmp_path / "out.failures.jsonl").exists()


@pytest.mark.slow
def test_a_request_out_of_memory_alone_in_flight_is_recorded_and_the_rest_go_on(tmp_path, tiny, monkeypatch):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:6])
    output = tmp_path / "out.jsonl"
    run = dict(tokenizer=tiny[1], log=lambda line: None, show_progress=False)
    always = OutOfMemoryInFlight(tiny[0].forward, failing=range(1, 1000))
    monkeypatch.setattr(tiny[0], "forward", always)
    summary = generation.run_job(job_params(prompts, output, batch_size=4, backend="continuous"), output,
                                 model=tiny[0], **run)
    failures = read_records(tmp_path / "out.failures.jsonl")
    assert summary["failed"] == 6 and summary["in_output"] == 0 and summary["unaccounted"] == 0
    assert sorted(f["line"] for f in failures) == [1, 2, 3, 4, 5, 6]
    assert all(f["stage"] == "generation" and "CUDA out of memory" in f["error"] for f in failures)
    # Named as the static path names it: transformers reports text, the record keeps the error's type.
    assert all(f["error"].startswith("OutOfMemoryError: CUDA out of memory") for f in failures)
    monkeypatch.undo()
    rerun = generation.run_job(job_params(prompts, output, batch_size=4, backend="continuous"), output,
                               model=tiny[0], **run)
    assert rerun["in_output"] == 6 and not (tmp_path / "out.failures.jsonl").exists()


class FailsInFlight:
    """Replaces the model's forward: the forward passes numbered in ``failing`` (1-based), and every
    one that reads the token ``poison`` (a prompt that breaks the model), raise ``error``."""

    def __init__(self, forward, error, failing=(), poison=None):
        self.forward, self.error, self.failing, self.poison, self.calls = forward, error, set(failing), poison, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self.calls in self.failing or (self.poison is not None and bool((input_ids == self.poison).any())):
            raise self.error
        return self.forward(*args, **kwargs)


def manager_limits(model, monkeypatch, first=lambda manager: manager):
    """The in-flight limit of each continuous-batching manager started on ``model``, in order; the
    first manager is handed to the backend through ``first``."""
    start = model.init_continuous_batching

    @functools.wraps(start)  # the backend reads its signature
    def recording(*args, **kwargs):
        limits.append(kwargs["continuous_batching_config"].max_requests_per_batch)
        manager = start(*args, **kwargs)
        return first(manager) if len(limits) == 1 else manager

    limits = []
    monkeypatch.setattr(model, "init_continuous_batching", recording)
    return limits


def stream_outcomes(backend, prompts):
    """{index: (tokens, finish reason)} of the completed prompts and {index: error} of the failed ones."""
    completed, failed = {}, {}

    def write(outcome):
        completed.update({p.index: (c.token_ids, c.finish_reason) for p, c in outcome.completed})
        failed.update({p.index: error for p, error in outcome.failed})

    generation.run_batches(backend, prompts, write=write, log=lambda line: None)
    return completed, failed


@pytest.mark.slow
@pytest.mark.parametrize("error, limits", [
    # Another error: its requests are retried at 2 in flight, then the rest runs at the full 4 again.
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"), [4, 2, 4]),
    # Out of memory: 2 in flight for the rest of the run, no manager started again.
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB."), [4, 2]),
])
def test_an_error_in_flight_retries_its_requests_first_at_half_the_limit(tiny, varied, monkeypatch, error, limits):
    prompts, settings, reference = varied
    backend = generation.make_backend("continuous", tiny[0], settings, 4)
    started = manager_limits(tiny[0], monkeypatch)
    monkeypatch.setattr(tiny[0], "forward", FailsInFlight(tiny[0].forward, error, failing={3}))
    assert engine_results(backend, prompts[:12]) == {p.index: reference[p.index] for p in prompts[:12]}
    assert started == limits


@pytest.mark.slow
def test_a_prompt_that_breaks_the_model_fails_alone_and_the_requests_beside_it_are_generated(tiny, varied,
                                                                                               monkeypatch):
    prompts, settings, reference = varied
    # A row of the embedding no token maps to: never in a prompt, and never generated (never a training target).
    poison = len(tiny[1])
    assert not any(poison in p.token_ids for p in prompts)
    queue = [p.index for p in engine.sort_longest_first(prompts[:16])]
    broken = {queue[1], queue[7], queue[13]}  # three prompts apart in the queue, each with a token that breaks a forward
    prompts = [dataclasses.replace(p, token_ids=[*p.token_ids, poison]) if p.index in broken else p
               for p in prompts[:16]]
    queue = [p.index for p in engine.sort_longest_first(prompts)]
    assert all(abs(queue.index(a) - queue.index(b)) > 2 for a in broken for b in broken if a != b)
    monkeypatch.setattr(tiny[0], "forward", FailsInFlight(tiny[0].forward, RuntimeError("an illegal instruction"),
                                                          poison=poison))
    completed, failed = stream_outcomes(generation.make_backend("continuous", tiny[0], settings, 4), prompts)
    # Each broken prompt is recorded once, alone; successes between them keep the run going.
    assert sorted(failed) == sorted(broken) and set(failed.values()) == {"RuntimeError: an illegal instruction"}
    assert completed == {p.index: reference[p.index] for p in prompts if p.index not in broken}


@pytest.mark.slow
def test_one_continuous_call_with_a_broken_prompt_raises_with_what_it_completed(tiny, varied, monkeypatch):
    # generate() (the benchmark's call): the caller gets the completed rows and the failure's own error,
    # never a result with a row missing.
    prompts, settings, reference = varied
    poison = len(tiny[1])  # an embedding row no token maps to: never generated
    prompts = [dataclasses.replace(p, token_ids=[*p.token_ids, poison]) if p.index == 2 else p for p in prompts[:6]]
    monkeypatch.setattr(tiny[0], "forward", FailsInFlight(tiny[0].forward, RuntimeError("an illegal instruction"),
                                                          poison=poison))
    with pytest.raises(engine.PartialFailure) as raised:
        generation.make_backend("continuous", tiny[0], settings, 4).generate(prompts)
    assert sorted(raised.value.completed) == [0, 1, 3, 4, 5]  # positions in the call's list
    assert raised.value.completed[0].token_ids == reference[prompts[0].index][0]
    assert "an illegal instruction" in str(raised.value.error)


@pytest.mark.slow
def test_a_model_that_fails_every_step_stops_the_stream_after_three_lone_failures(tiny, varied, monkeypatch):
    prompts, settings, _ = varied
    monkeypatch.setattr(tiny[0], "forward", FailsInFlight(tiny[0].forward, RuntimeError("CUDA error: device lost"),
                                                          failing=range(1, 1000)))
    failed = []
    # Not one bad example but a broken setup: the run stops rather than record every prompt as failed.
    with pytest.raises(generation.GenerationError, match=r"^3 examples in a row failed alone with: RuntimeError: "
                                                         r"CUDA error: device lost\. That is not one bad example"):
        generation.run_batches(generation.make_backend("continuous", tiny[0], settings, 4), prompts[:8],
                               write=lambda outcome: failed.extend(outcome.failed), log=lambda line: None)
    assert len(failed) == 3  # each written before the stop


def test_a_stream_queues_its_longest_prompts_first(tiny, varied):
    prompts, settings, _ = varied
    backend = generation.make_backend("continuous", tiny[0], settings, 1)  # one in flight: they end in queue order
    finished = []
    backend.stream(prompts[:8], write=lambda outcome: finished.extend(p for p, _ in outcome.completed),
                   log=lambda line: None)
    assert finished == generation.sort_longest_first(prompts[:8])


class FirstResultFails:
    """Wraps a continuous-batching manager: the first request it finishes comes back failed instead,
    as when transformers fails one request on its own while the others in flight run on."""

    def __init__(self, manager):
        self.manager, self.failed = manager, None

    def get_result(self, *args, **kwargs):
        result = self.manager.get_result(*args, **kwargs)
        if result is not None and self.failed is None:
            self.failed = result.request_id
            result = dataclasses.replace(result, error="RuntimeError: this request's own error")
        return result

    def __getattr__(self, name):
        return getattr(self.manager, name)


@pytest.mark.slow
def test_requests_that_finish_beside_a_failed_one_are_written_once_and_only_it_is_retried(tiny, varied,
                                                                                           monkeypatch):
    prompts, settings, reference = varied
    limits = manager_limits(tiny[0], monkeypatch, first=FirstResultFails)
    written = []
    generation.run_batches(generation.make_backend("continuous", tiny[0], settings, 4), prompts[:8],
                           write=lambda outcome: written.extend(outcome.completed), log=lambda line: None)
    # The three beside it finish as the manager stops and are written then: each prompt exactly once.
    assert sorted(prompt.index for prompt, _ in written) == [p.index for p in prompts[:8]]
    assert {p.index: (c.token_ids, c.finish_reason) for p, c in written} == {p.index: reference[p.index]
                                                                           for p in prompts[:8]}
    assert limits == [4, 1, 4]  # the failed request alone, then the rest at the full limit


def test_a_streams_statistics_count_each_group_of_finished_requests_once(tiny, varied):
    prompts, settings, reference = varied
    backend = generation.make_backend("continuous", tiny[0], settings, 4)
    stats = generation.run_batches(backend, prompts[:10], write=lambda outcome: None, log=lambda line: None)
    # One group per 4 finished requests, the last one partial, as a summary's batch list shows them.
    assert [(s.index, s.examples, s.failed) for s in stats] == [(1, 4, 0), (2, 4, 0), (3, 2, 0)]
    assert sum(s.output_tokens for s in stats) == sum(len(reference[p.index][0]) for p in prompts[:10])
    assert sum(s.prompt_tokens for s in stats) == sum(len(p.token_ids) for p in prompts[:10])
    # Each group's seconds are its own (they add up to the stream's); the first result is the first group's.
    assert sum(s.seconds for s in stats) == pytest.approx(stats[-1].finished_at_seconds)
    assert stats[0].first_result_seconds is not None and [s.first_result_seconds for s in stats[1:]] == [None, None]


def test_continuous_backend_says_clearly_when_transformers_lacks_it(tiny):
    class WithoutContinuousBatching:
        device = torch.device("cpu")

    with pytest.raises(generation.GenerationError, match=r"backend 'continuous' needs transformers' continuous "
                                                       r"batching \(model.init_continuous_batching\).*backend: static"):
        generation.make_backend("continuous", WithoutContinuousBatching(), None, 4)


def test_cli_generates_and_reports_errors_with_exit_codes(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "in.jsonl", arithmetic.sample_records()[:5])
    output = tmp_path / "cli.jsonl"
    code = cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={prompts}", f"output_path={output}",
                     "max_examples=3", "log_every_batches=0", *GREEDY_SET])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "generated 3 examples in" in captured.out and f"output: {output} (3 of 3 examples)" in captured.out
    assert len(read_records(output)) == 3
    assert cli.main(["generate", "--params", "cpu", "--set", f"prompts_path={tmp_path / 'nope.jsonl'}",
                     f"output_path={output}"]) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err


def run_cli(*settings, **kwargs):
    command = [sys.executable, "-m", "workbook.generation", "--params", "cpu", "--set", "log_every_batches=0",
               "interactive=false", "verifier=", *GREEDY_SET, *settings]  # generation only: test_verify.py verifies
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def complete_lines(path):
    if not path.exists():
        return 0
    return path.read_bytes().count(b"\n")


@pytest.mark.slow
@pytest.mark.parametrize("backend, batch_size", [("static", 2), ("continuous", 4)])
def test_kill_9_at_random_moments_then_resume_leaves_every_id_exactly_once(tmp_path, backend, batch_size):
    rng = random.Random(20251121)
    # Enough examples that three kills (each after 2-12 new lines) always land mid-run, however fast
    # the tiny model answers.
    records = arithmetic.sample_records()[:150]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    settings = (f"prompts_path={prompts}", f"output_path={output}", f"batch_size={batch_size}", f"backend={backend}")
    # One thread per process: torch's two threads spin against each other on a busy shared machine
    # (3.5 s per example measured under load), which made the waits below run out.
    one_thread = {"env": {**os.environ, "OMP_NUM_THREADS": "1"}}
    killed_mid_run = 0
    for attempt in range(3):
        before = complete_lines(output)
        target = before + rng.randint(2, 12)
        process = run_cli(*settings, **one_thread)
        deadline = time.monotonic() + 120
        while complete_lines(output) < target and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.15))
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            killed_mid_run += 1
        process.communicate()
        if attempt == 1:  # as if the kill had hit the middle of a write
            last = output.read_text().splitlines()[-1]
            with output.open("a") as handle:
                handle.write(last[: len(last) // 2])
    assert killed_mid_run == 3 and 0 < complete_lines(output) < len(records)
    finished = run_cli(*settings, **one_thread)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err[-3000:]
    text = output.read_text()
    assert text.endswith("\n")
    ids = [json.loads(line)["metadata"]["example_id"] for line in text.splitlines()]
    assert ids == [r["id"] for r in records]  # each exactly once, in input order
    assert not (tmp_path / "out.failures.jsonl").exists()
    assert f"{len(records)} of {len(records)} examples" in out


@pytest.mark.multiprocess
def test_two_processes_share_the_job_and_merge_into_the_one_process_output(tmp_path, tiny):
    records = arithmetic.sample_records()[:24]
    prompts = write_prompts(tmp_path / "in.jsonl", records)
    single = tmp_path / "single.jsonl"
    generation.run_job(job_params(prompts, single, batch_size=4), single, model=tiny[0], tokenizer=tiny[1],
                     log=lambda line: None, show_progress=False)
    output = tmp_path / "two.jsonl"
    process = run_cli(f"prompts_path={prompts}", f"output_path={output}", "batch_size=4", "data_parallel_processes=2")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert output.read_text() == single.read_text()  # same records, same order, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "single.jsonl", "single.summary.json",
                                                          "two.jsonl", "two.summary.json"]  # parts merged away
    summary = json.loads((tmp_path / "two.summary.json").read_text())
    assert summary["processes"] == 2 and summary["in_output"] == 24 and summary["unaccounted"] == 0
    assert [share["rank"] for share in summary["per_process"]] == [0, 1]
    assert all(share["generated"] == 12 for share in summary["per_process"])


def test_backend_auto_follows_the_profiles_measurement_and_says_why(tmp_path):
    values = params.load(PARAMS_DIR / "cpu.yaml")
    values.update(backend="auto", profile="cpu")
    name, why = generation.resolve_backend(values, tmp_path)
    assert name == "static" and "nothing measured for the cpu profile" in why
    report = tmp_path / "cpu" / "continuous_batching.json"
    report.parent.mkdir()
    for ratio, expected in [(1.8, "continuous"), (0.7, "static")]:
        report.write_text(json.dumps({"device": "cpu", "model": "tiny", "results": [
            {"workload": "full", "continuous_vs_static": 0.5}, {"workload": "uneven", "continuous_vs_static": ratio}]}))
        name, why = generation.resolve_backend(values, tmp_path)
        assert name == expected and f"{ratio}x" in why and "uneven" in why and str(report) in why
    # A run whose time budget ended before the uneven workload's continuous arm: the full workload's ratio.
    report.write_text(json.dumps({"results": [{"workload": "full", "continuous_vs_static": 1.2},
                                              {"workload": "uneven", "continuous_vs_static": None}]}))
    assert generation.resolve_backend(values, tmp_path)[0] == "continuous"
    report.write_text(json.dumps({"results": [{"workload": "uneven", "continuous_vs_static": None}]}))
    name, why = generation.resolve_backend(values, tmp_path)
    assert name == "static" and "compares no continuous with static run" in why
    report.write_text("{}")
    with pytest.raises(generation.GenerationError, match=r"continuous_batching.json, which is not a continuous"):
        generation.resolve_backend(values, tmp_path)
    assert generation.resolve_backend({**values, "backend": "continuous"}, tmp_path)[0] == "continuous"
