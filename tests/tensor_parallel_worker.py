"""Run by tests/test_tensor_parallel.py under torchrun: the tiny model sharded over the processes with
the generation job's own loading, against the same model whole in this process. Rank 0 writes JSON
to argv[1]: tokens and logits of both, and what one rank holds against what the planner predicts."""

import json
import sys

import torch

from workbook import decoding
from workbook.generation import job, tensor_parallel
from workbook.planner import layout, plan_generate
from workbook.presets import load_config

PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 51], [1, 60, 61, 62, 63, 64]]  # mixed lengths: left padded
NEW_TOKENS = 6

rank = job.current_rank(tensor_parallel_size=int(sys.argv[2]))
sharded_layout = tensor_parallel.Layout(rank.tensor_parallel_size, rank.count // rank.tensor_parallel_size)
sharded, _ = job.load_model("tiny", "fp32", rank.device, tensor_parallel.sharding_arguments(sharded_layout))
whole, _ = job.load_model("tiny", "fp32", "cpu")
input_ids, attention_mask = decoding.left_pad(PROMPTS, pad_token_id=0)


def tokens_and_logits(model):
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        tokens = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    return tokens.tolist(), logits


def cache_bytes(model) -> int:
    with torch.no_grad():
        cache = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


sharded_tokens, sharded_logits = tokens_and_logits(sharded)
whole_tokens, whole_logits = tokens_and_logits(whole)
plan = plan_generate(load_config("tiny"), batch_size=len(PROMPTS), prompt_len=input_ids.shape[1], new_tokens=1,
                     gpu_memory_bytes=2**30, dtype="fp32", tensor_parallel_size=rank.tensor_parallel_size)
measured_cache = cache_bytes(sharded)
if rank.index == 0:
    terms = {term.name: term.bytes for term in plan.terms}
    json.dump({"sharded_tokens": sharded_tokens, "whole_tokens": whole_tokens,
               "max_logit_difference": (sharded_logits - whole_logits).abs().max().item(),
               "parameter_bytes": layout.measured_rank_bytes(sharded), "planned_weights": terms["weights"],
               "whole_parameter_bytes": layout.measured_rank_bytes(whole),
               "cache_bytes": measured_cache, "planned_kv_cache": terms["kv_cache"]}, open(sys.argv[1], "w"))
rank.leave()  # as the job does: left to the interpreter's exit, gloo's threads sometimes abort a rank
