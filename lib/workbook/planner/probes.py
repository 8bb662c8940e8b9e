"""Probes: the worst case of generation and of a training step, measured on the device, and the
planned batch proven from a params profile (notebook 01).

A probe is a function ``probe(batch) -> ProbeMeasurement`` for ``finder.find_batch_size``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from accelerate.utils.memory import clear_device_cache

from workbook import decoding, models, runtime
from workbook.planner import profile
from workbook.planner.finder import FinderResult, ProbeMeasurement, find_batch_size
from workbook.units import format_bytes


class ProbeError(RuntimeError):
    """A probe could not run the worst case it was asked for (e.g. generation stopped early)."""


def generation_probe(
    model: torch.nn.Module,
    tokenizer,
    longest_prompt: str | list[int],
    max_new_tokens: int,
) -> Callable[[int], ProbeMeasurement]:
    """A probe that generates from ``batch`` copies of the longest prompt for exactly
    ``max_new_tokens`` tokens, greedily, on the model's device.

    ``min_new_tokens = max_new_tokens`` stops end-of-sequence from ending generation early, so
    the KV cache reaches its full length, the worst case of the data set. All copies have the
    same length, so no padding is needed (its side does not matter). ``longest_prompt`` is text
    (tokenized with ``tokenizer``, special tokens included as for the data) or token ids
    (``tokenizer`` may then be None). Raises ProbeError if generation still stops short.
    """
    prompt_ids = _prompt_ids(tokenizer, longest_prompt)
    _require_positive_int("max_new_tokens", max_new_tokens)
    pad_token_id = decoding.pad_token_id(model, tokenizer)  # all copies are equally long: never used
    device = _model_device(model)

    def probe(batch: int) -> ProbeMeasurement:
        input_ids = torch.tensor([prompt_ids] * batch, dtype=torch.long, device=device)

        def run():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # end of sequence cannot end it early
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_token_id,
            )
            return output.shape[1] - len(prompt_ids)

        generated, memory_fields, seconds = _measure(device, run)
        if generated != max_new_tokens:
            raise ProbeError(
                f"the generation probe produced {generated} new tokens, not max_new_tokens="
                f"{max_new_tokens}, so the worst case was not measured; check the model's "
                "generation_config (max_length, stop strings) and that the model's "
                "max_position_embeddings allows prompt + max_new_tokens"
            )
        return ProbeMeasurement(
            batch_size=batch, device=str(device), seconds=seconds, **memory_fields,
            sequence_tokens=len(prompt_ids) + generated, prompt_tokens=len(prompt_ids),
            generated_tokens=generated,
        )

    return probe


def training_probe(
    model: torch.nn.Module,
    seq_len: int,
    *,
    optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    vocab_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Callable[[int], ProbeMeasurement]:
    """A probe that runs one full training step on ``batch`` random sequences of ``seq_len`` tokens.

    Forward with labels, backward, one optimizer step (so the optimizer states exist at the
    peak, as from the first real step on), then ``zero_grad(set_to_none=True)``. The model is put
    in train mode for the step (gradient checkpointing only acts in train mode) and returned to
    its previous mode. ``autocast_dtype`` (e.g. torch.bfloat16) runs the forward under autocast,
    as a mixed-precision trainer would; None runs in the weights' own dtype.

    The probe does not train the model. The default optimizer is ``AdamW(lr=0)`` (fused on CUDA): it allocates
    both moments like any AdamW, and with lr=0 its step leaves every parameter bit for bit as it
    was (decoupled weight decay multiplies by 1 - lr x wd = 1; the update is scaled by lr), as
    long as the gradients are finite (0 x inf is NaN: a model whose first step overflows is
    broken anyway). Weights are not copied and restored instead, because a copy on the device
    would inflate the very peak being measured. A custom ``optimizer_factory(parameters)`` must keep that promise
    (build it with lr=0). Gradients the model held before the probe are discarded. The optimizer
    is rebuilt for every call, so the user's own optimizer state is never touched.
    """
    _require_positive_int("seq_len", seq_len)
    vocab_size = vocab_size or _vocab_size(model)
    device = _model_device(model)
    # Fused on CUDA, as the trainer builds it: foreach AdamW's step holds transient copies the size of the
    # trainable parameters, a peak the trainer (and so the plan) does not have.
    make_optimizer = optimizer_factory or (lambda parameters: torch.optim.AdamW(
        parameters, lr=0.0, fused=device.type == "cuda" or None))

    def probe(batch: int) -> ProbeMeasurement:
        # Random ids: memory depends on shapes only; a fixed seed keeps runs comparable.
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator).to(device)
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        was_training = model.training

        def run():
            optimizer = make_optimizer(trainable)
            model.train()
            try:
                with torch.autocast(device.type, dtype=autocast_dtype,
                                    enabled=autocast_dtype is not None):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
            finally:
                optimizer.zero_grad(set_to_none=True)
                model.train(was_training)
            return None

        _, memory_fields, seconds = _measure(device, run)
        return ProbeMeasurement(
            batch_size=batch, device=str(device), seconds=seconds, **memory_fields,
            sequence_tokens=seq_len,
        )

    return probe


def _measure(device: torch.device, run: Callable[[], object]) -> tuple[object, dict, float]:
    """Run ``run()`` and return its result, the memory fields of ProbeMeasurement and seconds.

    On CUDA the peak statistics are reset after emptying the cache, so the reserved peak counts
    what this run held (live tensors from before included), not blocks cached by earlier runs.
    """
    runtime.reset_peak_memory(device)
    started = time.perf_counter()
    result = run()
    runtime.synchronize(device)
    seconds = time.perf_counter() - started
    peak = runtime.peak_memory(device)
    fields = dict(peak_reserved_bytes=peak and peak.reserved_bytes, peak_allocated_bytes=peak and peak.allocated_bytes,
                  non_pytorch_bytes=peak and peak.non_pytorch_bytes)
    return result, fields, seconds


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (tokens), got {value!r}")


def _prompt_ids(tokenizer, longest_prompt: str | list[int]) -> list[int]:
    if isinstance(longest_prompt, str):
        if tokenizer is None:
            raise ValueError("longest_prompt is text, so a tokenizer is needed to turn it into ids")
        ids = list(tokenizer(longest_prompt)["input_ids"])
    else:
        ids = [int(token) for token in longest_prompt]
    if not ids:
        raise ValueError("longest_prompt is empty; pass the longest prompt of the data set")
    return ids


def _vocab_size(model) -> int:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text.vocab_size


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def prove_batch_size(params, mode: str, *, device: str | torch.device, log=print) -> tuple[FinderResult, str]:
    """Start from the planner's batch for the profile and prove it with the worst-case probe.

    Generation probes prompts of the profile's `prompt_len` tokens continued by the full
    `max_new_tokens`; training probes sequences of `seq_len` tokens with the optimizer step, set up
    as the trainer sets it up: fp32 master weights under autocast for a 16-bit full fine-tune, the
    base in its dtype with LoRA adapters, gradient checkpointing switched on the same way.
    Returns the finder's result and a description of the model that was probed.
    """
    profile.refuse_over_ram(params, mode)  # on a CPU, past the RAM the kernel kills the process: no error to back off on
    start = profile.resolve_batch_size(params, mode)
    # The model, lengths, attention and LoRA targets the planner assumed: the settings profile.plan reads.
    planned = profile.PlanSettings.from_params(params)
    dtype, lora = planned.dtype, mode == "train" and planned.lora_rank > 0
    mixed = mode == "train" and not lora and dtype != "fp32"
    loaded = models.load_model(planned.model, "fp32" if mixed else dtype, device,
                               attn_implementation=planned.attn_implementation)
    model = loaded.model
    if mode == "generate":
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (planned.prompt_len,), generator=generator)
        probe = generation_probe(model, None, prompt.tolist(), planned.max_new_tokens)
    else:
        if planned.grad_checkpointing:
            models.enable_gradient_checkpointing(model)
        if lora:
            model = models.with_lora(model, planned.lora_rank, planned.lora_targets)
        probe = training_probe(model, planned.seq_len,
                               autocast_dtype=models.TORCH_DTYPES[dtype] if mixed else None)

    def predicted(batch: int) -> int:
        return profile.plan(params, mode=mode, batch_size=batch).total_bytes

    try:
        return find_batch_size(start, probe, predicted_bytes=predicted, log=log), loaded.description
    finally:
        del model, loaded, probe
        clear_device_cache(garbage_collection=True)


def prove_modes(params, modes: list[str], log=print) -> tuple[dict, list[dict], str | None]:
    """Notebook 01's proof: ``prove_batch_size`` for each mode on the profile's hardware, where it is
    present. Returns (each mode's outcome or error, every probe attempt as a table row, the device or
    None). A mode that cannot be proven (nothing fits) is reported and the others still run."""
    on_gpu = profile.Budget.from_params(params).gpu_count > 0
    device = ("cuda" if torch.cuda.is_available() else None) if on_gpu else "cpu"
    proofs: dict[str, dict] = {}
    if device is None:
        log(f"Profile {profile.PlanSettings.from_params(params).profile} plans for a GPU, and this machine has "
            "none: the probe is skipped. Run this notebook on the GPU to prove the plan.")
        return proofs, [], None
    for mode in modes:
        try:
            result, probed = prove_batch_size(params, mode, device=device, log=log)
        except Exception as error:  # e.g. the plan says nothing fits: reported, and the next mode runs
            proofs[mode] = {"error": f"{type(error).__name__}: {error}"}
            log(f"{mode}: {proofs[mode]['error']}")
            continue
        proofs[mode] = {"model": probed, "device": device, **result.to_dict()}
        measured = result.measured_peak_bytes
        log(f"{mode}: settled on batch {result.batch_size} (planner started at {result.start_batch}); measured peak "
            f"{format_bytes(measured) if measured else 'not measured on CPU (torch keeps no peak of tensor memory)'}, "
            f"predicted {format_bytes(result.predicted_bytes)}; model {probed}")
    rows = [{"mode": mode, "batch": a["batch_size"], "outcome": a["outcome"],
             "measured peak": format_bytes(a["peak_bytes"]) if a["peak_bytes"] else "n/a",
             "predicted": format_bytes(a["predicted_bytes"]) if a["predicted_bytes"] else "n/a",
             "seconds": f"{a['seconds']:.2f}"}
            for mode, proof in proofs.items() for a in proof.get("attempts", [])]
    return proofs, rows, device
