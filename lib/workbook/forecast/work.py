"""The work a job is, counted without running it: FLOPs and bytes of every prefill, decode step and
training step, from the model's config alone (no weights, no GPU), over the batches the engine would
run. ``roofline`` turns this work into time on a profile's GPU.

    model = model_work(presets.load_config("Llama-3.1-8B"), "bf16")
    job = static_generation_work(model, prompt_tokens, output_tokens, batch_size=32, max_new_tokens=2048)
    job.prefill.flops, job.decode.bytes         # summed over the job's batches

What is counted, per the ops a forward runs (``torch.utils.flop_counter.FlopCounterMode`` counts the
same on a meta model: tests/test_forecast_roofline.py holds them equal):

- every linear layer's matmul: 2 FLOPs per weight per token it processes; the output projection
  (vocabulary) only at the positions whose logits are computed (generate: the last one);
- attention: QK^T and AV, 2 FLOPs each per query head x head dim x (query, key) pair, over every
  key position the kernel reads (a padded batch reads its padding too);
- bytes read: every weight once per forward (an untied input embedding is gathered a row per token,
  not streamed), each row's KV cache per decode step, the KV written and the logits written.

Norms, activations, rotary embeddings and sampling are not counted: a few FLOPs per hidden unit
against thousands per weight. Mixture-of-experts layers count each token's routed experts only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from workbook import presets
from workbook.forecast.model import decode_contexts
from workbook.forecast.stream import StepWork, batch_tokens, schedule
from workbook.planner.formulas import kv_cache_bytes_per_token
from workbook.planner.shape import compute_bytes


@dataclass(frozen=True)
class ModelWork:
    """What one token costs a model, from its config."""

    name: str
    dtype: str
    linear_parameters: float  # weights of the decoder's linear layers a token is multiplied by (routed experts: the active share)
    head_parameters: int  # hidden x vocabulary: the output projection, per position whose logits are computed
    streamed_weight_bytes: int  # what one forward reads of the weights: all but an untied input embedding
    kv_cache_bytes_per_token: int  # K and V of one position over every layer
    attention_width: int  # layers x query heads x head dim
    vocab_size: int

    @property
    def element_bytes(self) -> int:
        return compute_bytes(self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_work(config, dtype: str) -> ModelWork:
    """A model's per-token work from its config (a preset's or a folder's config.json), counted on the
    meta model the planner builds: every linear layer as the architecture has it."""
    meta = presets.build_on_meta_device(config)
    text = _text_config(config)
    head = meta.get_output_embeddings()
    embedding = meta.get_input_embeddings().weight
    experts = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "n_routed_experts", None))
    active = getattr(text, "num_experts_per_tok", None)
    expert_share = active / experts if experts and active else 1.0
    # Every matrix a token is multiplied by: nn.Linear weights and fused ones (experts stored as one
    # [experts, out, in] tensor); embeddings (gathered) and the head (counted apart) left out.
    gathered = {id(module.weight) for module in meta.modules() if isinstance(module, torch.nn.Embedding)}
    linear = 0.0
    for name, parameter in meta.named_parameters():
        if parameter.dim() < 2 or id(parameter) in gathered or (head is not None and parameter is head.weight):
            continue
        linear += parameter.numel() * (expert_share if ".experts." in name else 1.0)
    head_parameters = head.weight.numel() if head is not None else 0
    tied = head is not None and head.weight is embedding
    parameters = sum(p.numel() for p in meta.parameters())
    streamed = (parameters - (0 if tied else embedding.numel())) * compute_bytes(dtype)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelWork(name=str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model")),
                     dtype=dtype, linear_parameters=linear, head_parameters=head_parameters,
                     streamed_weight_bytes=int(streamed), kv_cache_bytes_per_token=kv_cache_bytes_per_token(config, dtype),
                     attention_width=text.num_hidden_layers * heads * head_dim, vocab_size=text.vocab_size)


@dataclass
class Work:
    """FLOPs and bytes of some calls, summed, and how many forwards they were."""

    flops: float = 0.0
    bytes: float = 0.0
    forwards: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.forwards + other.forwards)


def prefill_work(model: ModelWork, rows: int, length: int, logits_positions: int = 1) -> Work:
    """One prefill of ``rows`` prompts padded to ``length`` tokens; logits at the last
    ``logits_positions`` of each row (generate keeps one)."""
    tokens = rows * length
    flops = (2 * model.linear_parameters * tokens + 2 * model.head_parameters * rows * logits_positions
             + 4 * model.attention_width * rows * length * length)
    written = tokens * model.kv_cache_bytes_per_token + rows * logits_positions * model.vocab_size * model.element_bytes
    return Work(flops, model.streamed_weight_bytes + written, 1)


def decode_work(model: ModelWork, rows: int, longest_prompt: int, new_tokens: float) -> Work:
    """The decode steps of one static call whose longest output is ``new_tokens`` (the prefill yields
    the first): each step one token per row, attending the padded prompt and what came since."""
    steps = max(new_tokens - 1, 0.0)
    keys = rows * decode_contexts(longest_prompt, new_tokens)  # key positions read over every row and step
    flops = steps * rows * 2 * (model.linear_parameters + model.head_parameters) + 4 * model.attention_width * keys
    per_step = model.streamed_weight_bytes + rows * (model.kv_cache_bytes_per_token + model.vocab_size * model.element_bytes)
    return Work(flops, steps * per_step + keys * model.kv_cache_bytes_per_token, steps)


@dataclass
class CallWork:
    """One call of the engine: its shape and its work by phase."""

    rows: int
    longest_prompt: int
    new_tokens: float  # the longest output of the call (its decode steps + 1)
    prefill: Work
    decode: Work


@dataclass
class GenerationWork:
    """A generation job's work: every call the engine runs, and the sums."""

    backend: str
    batch_size: int
    calls: list[CallWork] = field(default_factory=list)
    prefill: Work = field(default_factory=Work)
    decode: Work = field(default_factory=Work)
    prompt_tokens: int = 0  # the prompts' own tokens (no padding)
    output_tokens: float = 0.0  # the outputs' tokens
    padded_positions: float = 0.0  # prompt positions the prefills computed, padding included

    def summary(self) -> dict:
        return {"backend": self.backend, "batch_size": self.batch_size, "calls": len(self.calls),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "padded_prompt_positions": self.padded_positions,
                "prefill": asdict(self.prefill), "decode": asdict(self.decode)}


def static_generation_work(model: ModelWork, prompt_tokens: list[int], output_tokens: list[float], *,
                           batch_size: int, max_new_tokens: int) -> GenerationWork:
    """The static engine's job: prompts sorted longest first (ties in file order), cut every
    ``batch_size``; each call prefills its rows padded to its longest prompt, then decodes until its
    longest output ends (``output_tokens[i]``: prompt i's, end of sequence included, capped at
    ``max_new_tokens``)."""
    order = sorted(range(len(prompt_tokens)), key=lambda i: (-prompt_tokens[i], i))
    job = GenerationWork("static", batch_size, prompt_tokens=sum(prompt_tokens))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        longest = prompt_tokens[rows[0]]
        new = max(min(output_tokens[i], max_new_tokens) for i in rows)
        call = CallWork(len(rows), longest, new, prefill_work(model, len(rows), longest),
                        decode_work(model, len(rows), longest, new))
        job.calls.append(call)
        job.prefill, job.decode = job.prefill + call.prefill, job.decode + call.decode
        job.output_tokens += sum(min(output_tokens[i], max_new_tokens) for i in rows)
        job.padded_positions += len(rows) * longest
    return job


def continuous_generation_work(model: ModelWork, prompt_tokens: list[int], output_tokens: list[float], *,
                               batch_size: int, max_new_tokens: int) -> GenerationWork:
    """The continuous engine's job: one stream, longest prompts first, ``batch_size`` requests in
    flight, scheduled as transformers' manager schedules it (``stream.schedule``)."""
    order = sorted(range(len(prompt_tokens)), key=lambda i: (-prompt_tokens[i], i))
    requests = [(prompt_tokens[i], max(1, round(min(output_tokens[i], max_new_tokens)))) for i in order]
    prefill, decode = schedule(requests, batch_size, batch_tokens(batch_size, prompt_tokens))
    job = GenerationWork("continuous", batch_size, prompt_tokens=sum(prompt_tokens),
                         output_tokens=float(sum(output for _, output in requests)),
                         padded_positions=float(sum(prompt_tokens)))
    job.prefill, job.decode = _stream_work(model, prefill), _stream_work(model, decode)
    return job


def _stream_work(model: ModelWork, work: StepWork) -> Work:
    """A stream's steps: each reads the weights once; every token it processes is multiplied by the
    linear layers, every request in it gets its logits, every (query, key) pair is attended."""
    flops = (2 * model.linear_parameters * work.tokens + 2 * model.head_parameters * work.sequences
             + 4 * model.attention_width * (work.prefill_pairs + work.decode_keys))
    written = work.tokens * model.kv_cache_bytes_per_token + work.sequences * model.vocab_size * model.element_bytes
    return Work(flops, work.steps * model.streamed_weight_bytes + work.decode_keys * model.kv_cache_bytes_per_token
                + written, work.steps)


def generation_work(model: ModelWork, prompt_tokens: list[int], output_tokens: list[float], *, backend: str,
                    batch_size: int, max_new_tokens: int) -> GenerationWork:
    """The job's work as ``backend`` ('static', 'static-compiled' or 'continuous') runs it."""
    count = continuous_generation_work if backend == "continuous" else static_generation_work
    made = count(model, prompt_tokens, output_tokens, batch_size=batch_size, max_new_tokens=max_new_tokens)
    made.backend = backend
    return made


# ----------------------------------------------------------------------------------------------
# Training.


def training_step_work(model: ModelWork, rows: int, seq_len: int, *, lora: bool = False,
                       recompute: bool = False) -> Work:
    """One optimizer step over ``rows`` rows of ``seq_len`` tokens (every micro-batch and process of
    it). Forward 1x, backward 2x the forward's FLOPs (the gradient of the input and of the weight);
    LoRA skips the frozen weights' gradients (backward 1x for them); gradient checkpointing runs the
    forward again. Logits at every position. Bytes: the weights read by forward and backward."""
    tokens = rows * seq_len
    forward_linear = 2 * (model.linear_parameters + model.head_parameters) * tokens
    attention = 4 * model.attention_width * rows * seq_len * seq_len
    backward = (1 if lora else 2) * forward_linear + 2 * attention
    forwards = 2 if recompute else 1
    return Work(forwards * (forward_linear + attention) + backward, (forwards + 1) * model.streamed_weight_bytes, 1)


@dataclass
class TrainingWork:
    steps: int
    rows_per_step: int
    seq_len: int
    step: Work
    total: Work

    def summary(self) -> dict:
        return {"steps": self.steps, "rows_per_step": self.rows_per_step, "seq_len": self.seq_len,
                "step": asdict(self.step), "total": asdict(self.total)}


def training_work(model: ModelWork, example_tokens: list[int], *, seq_len: int, micro_batch_size: int,
                  accumulation: int, processes: int, epochs: int, max_steps: int, lora: bool,
                  recompute: bool) -> TrainingWork:
    """A packed training run: the examples' tokens packed into rows of ``seq_len``, rows dealt
    ``micro_batch_size x accumulation x processes`` to a step, ``epochs`` passes (or ``max_steps``)."""
    rows = max(1, math.ceil(sum(min(t, seq_len) for t in example_tokens) / seq_len))
    per_step = micro_batch_size * accumulation * processes
    steps = max_steps or math.ceil(rows / per_step) * epochs
    # An epoch's last step takes the rows left, not a full step's.
    trained_rows = max_steps * per_step if max_steps else rows * epochs
    row = training_step_work(model, 1, seq_len, lora=lora, recompute=recompute)
    step = training_step_work(model, per_step, seq_len, lora=lora, recompute=recompute)
    return TrainingWork(steps, per_step, seq_len, step, Work(row.flops * trained_rows, step.bytes * steps, steps))


def flop_counter_check(config, model: ModelWork, rows: int, length: int) -> dict:
    """The analytical FLOPs of one prefill (``rows`` x ``length``) and of the decode step after it,
    beside what ``torch.utils.flop_counter.FlopCounterMode`` counts running the real ops on the meta
    model (shapes only, no weights, no device). A model whose forward cannot run on meta is said so."""
    meta = presets.build_on_meta_device(config)
    ids = torch.ones(rows, length, dtype=torch.long, device="meta")
    step = torch.ones(rows, 1, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            with FlopCounterMode(display=False) as counter:
                cache = meta(input_ids=ids, logits_to_keep=1, use_cache=True).past_key_values
            prefill = counter.get_total_flops()
            with FlopCounterMode(display=False) as counter:
                meta(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1,
                     cache_position=torch.tensor([length], device="meta"))
            decode = counter.get_total_flops()
    except Exception as error:  # an architecture whose forward needs real data (e.g. routing on values)
        return {"shape": [rows, length], "flop_counter": f"not counted: {type(error).__name__}: {str(error)[:200]}"}
    analytical = {"prefill": prefill_work(model, rows, length).flops, "decode_step": decode_work(model, rows, length, 2).flops}
    counted = {"prefill": float(prefill), "decode_step": float(decode)}
    return {"shape": [rows, length], "analytical": analytical, "flop_counter": counted,
            "relative_difference": {key: (analytical[key] - counted[key]) / counted[key] if counted[key] else None
                                    for key in counted}}
