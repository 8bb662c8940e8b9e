"""Hugging Face's ``pipeline("text-generation")`` as the generation sweep's ``hf-pipeline`` strategy:
the tool many users run, measured in the same run as the workbook's strategies, on the same model
object, device, dtype, prompts and greedy decoding, at each of the sweep's batch sizes.

How it is fed. The pipeline takes text: its ``preprocess`` tokenizes every prompt (transformers 5.17
to 5.23; no input of token ids). The sweep's prompts are random token ids, so each is decoded with
the model's tokenizer and the pipeline tokenizes the text again, ``add_special_tokens=False`` (the
sweep's prompts carry no BOS). Where the re-tokenized ids equal the sweep's (every prompt of a model
with a tokenizer: the sweep writes them so, ``generation_sweep.text_stable_prompts``), the pipeline runs the very same input and its output
is compared with one-at-a-time generation; where they differ, it is not compared and the point says
how many prompts ran the sweep's ids. A preset (random weights) has no tokenizer: it gets the tiny
model's, the one ``workbook.random_weights`` saves beside random weights; ids that tokenizer cannot
decode (all but its few hundred) are mapped onto ones it can, so each prompt keeps its length, not its ids.

How it is counted. ``return_tensors=True`` returns each row's ids: the batch's left padding, the
prompt, the new tokens. The new tokens are what follows the prompt, cut at the first end of
sequence as the engine cuts its own (``generation.finish``); text is never counted. The pipeline
batches in input order (it does not sort by length), so it is fed in the sweep's file order.
"""

from __future__ import annotations

import time
from typing import Callable

from workbook import decoding, generation, models, runtime, tiny_model
from workbook.bench.counting import BenchError

HOW = ("transformers.pipeline('text-generation') over the sweep's model object and its tokenizer, greedy "
       "(do_sample=False), max_new_tokens = min_new_tokens = the sweep's, batch_size = the point's, prompts in "
       "file order as text (the sweep's ids decoded, re-tokenized by the pipeline), output tokens counted from "
       "the ids it returned (return_tensors=True)")


def pipeline_tokenizer(setup) -> tuple[object, str]:
    """(tokenizer, where it came from): the model's own, or for a preset the tiny model's (random
    weights have none; ``workbook.random_weights`` saves this one beside them)."""
    tokenizer = models.load_tokenizer(setup.model_name)
    source = f"{setup.model_name}'s tokenizer"
    if tokenizer is None:
        tokenizer = models.load_tokenizer(tiny_model.TINY_MODEL_NAME)
        source = "the tiny model's tokenizer (a preset has none), ids beyond it mapped onto it"
    # Prompts are checked against the model's context, not the tokenizer's (the tiny one says 256).
    tokenizer.model_max_length = decoding.context_length(setup.model) or tokenizer.model_max_length
    if tokenizer.pad_token_id is None:  # the pipeline refuses to batch without one
        tokenizer.pad_token_id = decoding.pad_token_id(setup.model, tokenizer)
    return tokenizer, source


def prompt_texts(prompts: list[generation.Prompt], tokenizer) -> tuple[list[str], list[list[int]]]:
    """Each prompt as text, and the ids the pipeline will run for it (its own tokenization of the text)."""
    special = set(tokenizer.all_special_ids)
    decodable = [i for i in range(len(tokenizer)) if i not in special]
    texts = []
    for prompt in prompts:
        ids = [i if i < len(tokenizer) else decodable[i % len(decodable)] for i in prompt.token_ids]
        texts.append(tokenizer.decode(ids, clean_up_tokenization_spaces=False))
    return texts, [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def generate_arguments(settings: generation.DecodingSettings) -> dict:
    """The engine's greedy decoding as the pipeline's keyword arguments. Stated one by one: the
    pipeline's own defaults sample (do_sample=True, temperature 0.7, 256 new tokens)."""
    return {"max_new_tokens": settings.max_new_tokens, "min_new_tokens": settings.min_new_tokens,
            "do_sample": False, "num_beams": 1, "repetition_penalty": 1.0,
            "eos_token_id": list(settings.eos_token_ids), "pad_token_id": settings.pad_token_id}


def new_tokens(sequence: list[int], prompt_ids: list[int], pad_token_id: int) -> list[int]:
    """What follows the prompt in one row the pipeline returned: left padding, the prompt, new tokens."""
    width = len(prompt_ids)
    for start in range(len(sequence) - width + 1):
        if sequence[start:start + width] == prompt_ids:
            return sequence[start + width:]
        if sequence[start] != pad_token_id:
            break
    raise BenchError(f"an hf-pipeline output does not hold the prompt it was given after its padding "
                     f"(prompt of {width} tokens, output of {len(sequence)}); the pipeline's output format "
                     "changed: check return_tensors in transformers' text_generation.py")


def prepare(setup, point: dict) -> tuple[Callable[[], dict], dict]:
    """Build the pipeline for one point and warm it up on one batch; returns (one timed pass over
    every prompt, facts about the prompts it ran)."""
    from transformers import pipeline
    tokenizer, source = pipeline_tokenizer(setup)
    texts, ran_ids = prompt_texts(setup.prompts, tokenizer)
    pipe = pipeline("text-generation", model=setup.model, tokenizer=tokenizer, device=setup.device)
    batch = point["batch_size"]
    arguments = {"batch_size": batch, "return_tensors": True, "add_special_tokens": False,
                 **generate_arguments(setup.settings)}
    pipe(texts[:batch], **arguments)  # warm-up

    def one_pass() -> dict:
        return _run(pipe, texts, ran_ids, setup, arguments)

    same = [p.index for p, ids in zip(setup.prompts, ran_ids) if ids == p.token_ids]
    facts = {"tokenizer": source, "prompts_with_the_sweeps_ids": len(same),
             "prompt_tokens_run": sum(map(len, ran_ids)),
             "sweep_prompt_tokens": sum(len(p.token_ids) for p in setup.prompts)}
    return one_pass, {"pipeline_prompts": facts, "comparable_prompts": same}


def _run(pipe, texts: list[str], ran_ids: list[list[int]], setup, arguments: dict) -> dict:
    """One pass, in the shape of the engine's (``generation.summarize``) plus the completions."""
    settings, pad = setup.settings, pipe.tokenizer.pad_token_id
    completions: dict[int, generation.Completion] = {}
    first = None
    slots = 0  # positions computed: each returned row is the batch's padded width plus its new tokens
    began = time.perf_counter()
    # A generator makes the pipeline stream results, so the first one can be timed.
    results = pipe((text for text in texts), **arguments)
    for prompt, prompt_ids, result in zip(setup.prompts, ran_ids, results):
        if first is None:
            runtime.synchronize(setup.device)
            first = time.perf_counter() - began
        sequence = [int(token) for token in result[0]["generated_token_ids"]]
        slots += len(sequence)
        completions[prompt.index] = generation.finish(new_tokens(sequence, prompt_ids, pad), settings.max_new_tokens,
                                                      settings.eos_token_ids)
    runtime.synchronize(setup.device)
    seconds = time.perf_counter() - began
    output_tokens = sum(len(c.token_ids) for c in completions.values())
    useful = sum(map(len, ran_ids)) + output_tokens
    return {"generated": len(completions), "failed": len(texts) - len(completions), "seconds": seconds,
            "output_tokens": output_tokens, "output_tokens_per_second": round(output_tokens / seconds, 1),
            "padding_waste": round(1 - useful / slots, 4) if slots else None,
            "time_to_first_result_seconds": first, "completions": completions}


def best_workbook_ratio(pipeline_point: dict, points: list[dict]) -> dict:
    """The workbook's fastest strategy at the pipeline point's batch size over the pipeline."""
    batch = pipeline_point["batch_size"]
    ours = [p for p in points if p["batch_size"] == batch and p["strategy"] != pipeline_point["strategy"]
            and "output_tokens_per_second" in p]
    if not ours:
        return {"ratio": None, "note": f"no workbook strategy ran at batch {batch}"}
    best = max(ours, key=lambda p: p["output_tokens_per_second"]["median"])
    fastest = best["output_tokens_per_second"]["median"]
    return {"ratio": fastest / pipeline_point["output_tokens_per_second"]["median"], "strategy": best["strategy"],
            "workbook_tokens_per_second": fastest, "batch_size": batch,
            "note": "median output tokens/s of the workbook's fastest strategy at this batch size over the pipeline's"}
