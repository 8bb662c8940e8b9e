"""The peak of the real step, measured without a GPU: the workbook's own code run on fake tensors.

``FakeTensorMode`` gives every tensor a shape, a dtype and a storage size but no data, so each op runs
only its shape rule: the model is built from its config (no weights read, any size, on this CPU),
then the training step ``workbook train`` runs (``training.loop.optimizer_step``: its LoRA,
checkpointing, chunked loss, packed rows and attention path, precision and AdamW; two steps, so
that the optimizer states exist) or generation as the engine runs it (prefill, the first decode step
and the last, with the backend's cache), while ``live_tensors.LiveTensors`` counts the bytes alive
after every op, by kind. The peak is a moment: what is alive then, not a sum of everything.

What a CPU trace cannot see is added and named (``Trace.not_seen``): the CUDA context and the
allocator's rounding stay the profile's constants until a GPU measures them; kernels that differ
between CPU and GPU (flex attention, bitsandbytes) are named where the trace runs another.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbook import models, presets
from workbook.planner.live_tensors import KINDS, LiveTensors
from workbook.planner.paged import continuous_batching_config, default_page_size, paged_kernel, paged_layout
from workbook.planner.profile import Budget, PlanSettings
from workbook.units import format_bytes

TRAINING_STEPS = 2  # the second step is the steady one: AdamW's states exist from the first step's end
TRAINING_PHASES = ("forward", "loss", "backward", "gradient clipping", "optimizer step")
GENERATION_PHASES = ("prefill", "first decode step", "last decode step")


class TraceError(ValueError):
    """The step cannot run on fake tensors: the message names the op and the module that ran it."""


class NotACausalLanguageModel(ValueError):
    """An encoder-only or encoder-decoder config: the workbook trains and generates causal LMs only."""


@dataclass
class Trace:
    """The peak of one traced job, when it happened and what it held."""

    mode: str  # "train" or "generate"
    model: str
    peak_bytes: int  # tensors alive at the peak (no CUDA context, no allocator rounding)
    phase: str  # when: forward, loss, backward, gradient clipping, optimizer step; prefill, ... decode step
    by_kind: dict[str, int]  # the peak's bytes by kind (live_tensors.KINDS), zeros left out
    phase_peaks: dict[str, int]  # the most bytes alive in each phase
    seconds: float  # wall time of the trace
    settings: dict  # what was traced
    not_seen: list[str] = field(default_factory=list)  # what the trace leaves to the profile's constants
    substitutions: list[str] = field(default_factory=list)  # where the CPU trace ran another kernel than a GPU

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The trace in words, for the CLI and notebook 01."""
        kinds = ", ".join(f"{kind} {format_bytes(value)}" for kind, value in self.by_kind.items())
        phases = ", ".join(f"{phase} {format_bytes(value)}" for phase, value in self.phase_peaks.items())
        lines = [f"trace on fake tensors ({self.seconds:.1f} s): peak {format_bytes(self.peak_bytes)} "
                 f"({self.peak_bytes:,} B) in {self.phase}: {kinds}",
                 f"trace: the most alive in each phase: {phases}"]
        lines += [f"trace: {text}" for text in self.substitutions + self.not_seen]
        return lines


def refuse_non_causal(model: str) -> None:
    """NotACausalLanguageModel for an encoder-only (BERT) or encoder-decoder (T5) config, naming what
    the workbook plans instead; a causal LM passes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING
    config = presets.load_config(models.model_source(model))
    # BERT's config has a causal class too (BertLMHeadModel, with is_decoder): a masked-LM family that is not
    # configured as a decoder is an encoder.
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    encoder_only = type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or (
        type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False))
    if not encoder_decoder and not encoder_only:
        return
    kind = "an encoder-decoder" if encoder_decoder else "an encoder-only"
    raise NotACausalLanguageModel(
        f"model {model!r} ({config.model_type}) is {kind} model: the workbook trains and generates causal language "
        "models (decoder-only, AutoModelForCausalLM) and plans only those; nothing is planned for it. Plan a "
        f"decoder-only model instead: a preset ({', '.join(presets.preset_names()[:4])}, ...) or a local directory "
        "whose config.json is a causal LM")


# ----------------------------------------------------------------------------------------------
# Fake models.


def _on_meta(model: str, dtype, device, *, attn_implementation: str = models.DEFAULT_ATTENTION):
    """``models.load_model``'s signature: the architecture on the meta device (no storage, no init)."""
    return models.build_random(model, dtype, "meta", attn_implementation=attn_implementation)


def materialize(module: torch.nn.Module, fake_mode) -> torch.nn.Module:
    """Every meta parameter and buffer of ``module`` replaced by a fake CPU tensor of its shape and dtype
    (tied ones stay tied). PEFT's adapters are added on meta first: on fake tensors its weight swap fails."""
    made: dict[int, torch.Tensor] = {}
    with fake_mode:
        for child in module.modules():
            for name, parameter in list(child._parameters.items()):
                if parameter is not None:
                    if id(parameter) not in made:
                        made[id(parameter)] = torch.nn.Parameter(
                            torch.empty(parameter.shape, dtype=parameter.dtype, device="cpu"),
                            requires_grad=parameter.requires_grad)
                    child._parameters[name] = made[id(parameter)]
            for name, buffer in list(child._buffers.items()):
                if buffer is not None:
                    if id(buffer) not in made:
                        made[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                    child._buffers[name] = made[id(buffer)]
    return module


def _built(model: str, dtype: str, attn_implementation: str, fake: bool):
    """The generation trace's model (on fake tensors, or random real ones to check the fake), the fake mode it
    runs under (None on real tensors) and a fresh tracker."""
    mode = fake_mode() if fake else None
    tracker = LiveTensors(real_when_no_fake_input=fake)
    built = (_on_meta if fake else models.build_random)(model, dtype, "cpu", attn_implementation=attn_implementation).model
    if fake:
        materialize(built, mode)
    return built, mode, tracker


def fake_mode():
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode
    # torch logs every op fake tensors refuse with its traceback; the trace names it itself (_named_failures)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    # Real inputs are allowed: the batch's token ids stay real (the attention reads the packed
    # examples' spans from the position ids, the chunked loss the loss positions from the targets).
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _named_failures(model: torch.nn.Module):
    """A failure on fake tensors as a TraceError naming the op and the innermost module running it."""
    running: list[str] = []
    names = {module: name for name, module in model.named_modules()}

    def enter(module, args):
        running.append(names.get(module, type(module).__name__) or type(module).__name__)

    def leave(module, args, output):
        if running:
            running.pop()

    handles = [module.register_forward_pre_hook(enter) for module in names] + \
              [module.register_forward_hook(leave) for module in names]
    try:
        yield
    except TraceError:
        raise
    except Exception as error:
        where = running[-1] if running else "outside any module (the step's own code)"
        kind = type(error).__name__
        first = (str(error).strip().splitlines() or [kind])[0][:300]
        raise TraceError(f"the trace cannot run on fake tensors: {kind} in {where} "
                         f"({type(_find_module(model, where)).__name__ if running else 'step'}): {first}") from error
    finally:
        for handle in handles:
            handle.remove()


def _find_module(model, name: str):
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return model


# ----------------------------------------------------------------------------------------------
# Training.


def trace_batch(config, micro_batch_size: int, seq_len: int) -> dict:
    """A micro-batch of ``micro_batch_size`` full rows of ``seq_len`` tokens, as ``workbook train`` collates
    synthetic rows (``prepare.synthetic_documents``: packed documents when packing), every token carrying loss."""
    from workbook.training.batches import Collator
    from workbook.training.examples import TokenizedExample
    from workbook.training.prepare import synthetic_documents
    pieces = synthetic_documents(seq_len) if config.padding == "packing" else [seq_len]
    rows = [[TokenizedExample([1] * size, [1] * size, f"trace {row}.{piece}") for piece, size in enumerate(pieces)]
            for row in range(micro_batch_size)]
    collator = Collator(config.padding, seq_len, 0,
                        flatten=config.padding == "packing" and config.attn_implementation == "flash_attention_2")
    return collator(rows)


def trace_training(config, *, steps: int = TRAINING_STEPS, fake: bool = True, on_gpu: bool = True) -> Trace:
    """The peak of ``config``'s (a TrainConfig) training step, traced over ``steps`` optimizer steps on fake
    tensors (``fake=False``: the same on real tensors with random weights, the tiny model's check). ``on_gpu``: the run it plans
    is on a GPU (the fused AdamW the loop uses there); the peak is the last step's."""
    from accelerate import Accelerator

    from workbook.training import loop
    from workbook.training.config import accelerate_mixed_precision

    refuse_non_causal(config.model)
    started = time.perf_counter()
    seq_len, micro_batch_size = int(config.max_seq_length), int(config.micro_batch_size)
    substitutions, not_seen = [], _not_seen()
    if config.dtype in ("int8", "int4"):
        raise TraceError(f"dtype {config.dtype} (bitsandbytes 4/8-bit layers) has no CPU kernels to trace, and "
                         "workbook train does not run it (QLoRA is planned only)")
    mixed = accelerate_mixed_precision(config)
    if mixed == "fp16":
        substitutions.append("fp16 autocast traced as bf16 autocast (accelerate runs no fp16 on CPU): the same bytes")
        mixed = "bf16"
    if config.optimizer == "adamw-8bit":
        raise TraceError("optimizer adamw-8bit (bitsandbytes) has no CPU kernels to trace; trace with optimizer adamw "
                         "and read the plan's optimizer_states term for the 8-bit states")
    # No device placement: the model is on the CPU already, and moving fake parameters swaps them (torch refuses).
    accelerator = Accelerator(mixed_precision=mixed, cpu=True, device_placement=False)
    mode = fake_mode() if fake else None
    tracker = LiveTensors(real_when_no_fake_input=fake)
    hooks = []
    try:
        model, description, _ = loop.load_training_model(config, torch.device("cpu"), seq_len,
                                                         load=_on_meta if fake else models.build_random)
        attention = model.config._attn_implementation
        if fake:
            materialize(model, mode)
        # Real tensors, made before the fake mode starts: the step reads their values (loss tokens, spans).
        micro_batches = [trace_batch(config, micro_batch_size, seq_len) for _ in range(config.gradient_accumulation_steps)]
        # Under the tracker: it counts what grouped_mm returns, not the casts its fake rule needs.
        grouped = FakeGroupedMatmul() if fake else contextlib.nullcontext()
        with (mode or contextlib.nullcontext()), grouped, tracker, _named_failures(model):
            tracker.track_module(model)
            optimizer, _ = loop.build_optimizer(model, config, 1e-4, fused=on_gpu)
            model, optimizer = accelerator.prepare(model, optimizer)
            hooks += tracker.track_gradients(model)
            hooks += _phase_hooks(model, optimizer, tracker)
            backward, clip = accelerator.backward, accelerator.clip_grad_norm_
            accelerator.backward = _in_phase(tracker, "backward", backward)
            accelerator.clip_grad_norm_ = _in_phase(tracker, "gradient clipping", clip)
            for tensor in [t for batch in micro_batches for t in batch.values()]:
                tracker.track(tensor, "inputs")
            model.train()
            for step in range(steps):
                if step == steps - 1:
                    tracker.reset_peak()
                loop.optimizer_step(accelerator, model, optimizer, micro_batches, 1e-4, config.loss_chunk_tokens)
                tracker.set_phase("between steps")
    finally:
        for handle in hooks:
            handle.remove()
        loop.reset_accelerate_state()
    if attention == "document_sdpa" and on_gpu and config.padding == "packing":
        substitutions.append("packed rows traced with document_sdpa (sdpa per example); on a GPU the trainer runs "
                             "flex attention, which has no CPU backward: the same saved tensors per example (output "
                             "and log-sum-exp), no mask")
    if attention == "document_sdpa" and _unequal_head_dims(model):
        substitutions.append("multi-head latent attention's queries and keys are wider than its values: CPU sdpa has "
                             "no fused kernel for that and runs its math path per example, saving each example's "
                             "attention probabilities (heads x example length per token), which a GPU's flex or "
                             "memory-efficient kernel does not save: the trace holds more than the GPU step")
    substitutions.append("CPU autocast's op lists (torch.autocast('cpu')), not CUDA's: the same casts for matmuls "
                         "and attention")
    peak = tracker.peak
    return Trace(
        mode="train", model=config.model, peak_bytes=peak.bytes, phase=peak.phase,
        by_kind={kind: peak.by_kind[kind] for kind in KINDS if peak.by_kind.get(kind)},
        phase_peaks=dict(tracker.phase_peaks), seconds=round(time.perf_counter() - started, 2),
        settings={"description": description, "micro_batch_size": micro_batch_size, "seq_len": seq_len,
                  "gradient_accumulation_steps": config.gradient_accumulation_steps, "dtype": config.dtype,
                  "precision": config.precision, "lora_rank": config.lora_rank,
                  "grad_checkpointing": config.grad_checkpointing, "loss_chunk_tokens": config.loss_chunk_tokens,
                  "padding": config.padding, "attention": attention, "optimizer": config.optimizer,
                  "fused_adamw": on_gpu, "steps": steps, "fake": fake},
        not_seen=not_seen, substitutions=substitutions,
    )


class FakeGroupedMatmul(TorchDispatchMode):
    """Fake tensors' grouped_mm as its kernels run it. torch's fake (meta) rule for ``aten._grouped_mm`` takes
    bf16 operands only, after an early CUDA kernel, while the CPU and CUDA kernels take fp32 and fp16 too
    (``_grouped_mm_validate_inputs``); grouped_mm is in no autocast op list, so under mixed precision
    transformers' experts multiply in their fp32 master weights' dtype (``integrations/moe.py`` casts the input
    to the weight's dtype). A call on other floating operands runs the shape rule on bf16 casts of them, below
    the tracker (which sees none of the casts), and returns the result in the operands' dtype, as the kernels
    do."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype in (torch.float32, torch.float16) \
                and kwargs.get("out_dtype") is None:
            dtype = args[0].dtype
            cast = [value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point()
                    else value for value in args]
            return func(*cast, **kwargs).to(dtype)
        return func(*args, **kwargs)


def _unequal_head_dims(model) -> bool:
    """DeepSeek's MLA: query/key heads wider than value heads (qk_nope + qk_rope vs v_head_dim)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "v_head_dim", None)
    query = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0)
    return value is not None and query != value


def _phase_hooks(model, optimizer, tracker: LiveTensors) -> list:
    """Phases from the model's own hooks: forward while it runs (what it makes is kept for backward),
    the loss after it, the optimizer step around ``optimizer.step`` (its states counted as such after)."""
    def step_done(optimizer, args, kwargs):
        tracker.track_optimizer(optimizer)
        tracker.set_phase("after the optimizer step")

    return [model.register_forward_pre_hook(lambda module, args: tracker.set_phase("forward", "activations")),
            model.register_forward_hook(lambda module, args, output: tracker.set_phase("loss", "activations")),
            optimizer.optimizer.register_step_pre_hook(lambda *_: tracker.set_phase("optimizer step")),
            optimizer.optimizer.register_step_post_hook(step_done)]


def _in_phase(tracker: LiveTensors, phase: str, function):
    def run(*args, **kwargs):
        tracker.set_phase(phase)
        return function(*args, **kwargs)
    return run


def _not_seen() -> list[str]:
    return ["not seen by a CPU trace: the CUDA context and library workspaces, and the caching allocator's "
            "rounding and unreusable blocks; they stay the profile's constants (cuda_context, "
            "allocator_fragmentation) until a GPU measures them (workbook calibrate)"]


# ----------------------------------------------------------------------------------------------
# Generation.


def trace_generation(model: str, *, batch_size: int, prompt_len: int, new_tokens: int, dtype: str = "bf16",
                     backend: str = "static", attn_implementation: str = "sdpa", fake: bool = True) -> Trace:
    """The peak of generating ``new_tokens`` after ``batch_size`` prompts of ``prompt_len`` tokens as the engine
    runs it: prefill (logits of the last position only, as ``generate`` keeps), the first decode step and the
    last (the cache full but for one position: every step between holds less), with the backend's cache
    (``static``: transformers' dynamic cache; ``static-compiled``: its static cache, preallocated).
    One row is left-padded by a token, as a batch of unequal prompts is, so the padding mask exists."""
    from transformers import DynamicCache, StaticCache

    refuse_non_causal(model)
    if dtype in ("int8", "int4"):
        raise TraceError(f"dtype {dtype} (bitsandbytes 4/8-bit layers) has no CPU kernels to trace")
    if backend == "continuous":
        return trace_continuous(model, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                                dtype=dtype, attn_implementation=attn_implementation, fake=fake)
    if backend not in ("static", "static-compiled"):
        raise TraceError(f"backend {backend!r}: the trace runs the backends static, static-compiled and continuous")
    started = time.perf_counter()
    built, mode, tracker = _built(model, dtype, attn_implementation, fake)
    text_config = built.config.get_text_config(decoder=True)
    total = prompt_len + new_tokens
    with (mode or contextlib.nullcontext()), tracker, _named_failures(built), torch.no_grad():
        tracker.track_module(built)
        cache = (StaticCache(config=text_config, max_cache_len=total) if backend == "static-compiled"
                 else DynamicCache(config=text_config))
        update = cache.update

        def counted_update(key_states, value_states, layer_idx, *args, **kwargs):
            # what the cache keeps is counted as kv_cache the moment it has it
            result = update(key_states, value_states, layer_idx, *args, **kwargs)
            for tensor in _cache_tensors(cache):
                tracker.track(tensor, "kv_cache")
            return result

        cache.update = counted_update
        with torch.device("cpu"):
            input_ids = torch.ones((batch_size, prompt_len), dtype=torch.long)
            mask = torch.ones((batch_size, prompt_len), dtype=torch.long)
        mask[-1, 0] = 0  # one left-padded row
        for tensor in (input_ids, mask):
            tracker.track(tensor, "inputs")

        def forward(ids, mask, position: int, keep: int = 1):
            positions = torch.arange(position, position + ids.shape[1], device="cpu")
            output = built(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                           cache_position=positions, logits_to_keep=keep)
            # generate copies the last position's logits to fp32 and picks the next token from them
            logits = output.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            return logits.argmax(-1, keepdim=True)

        tracker.set_phase("prefill")
        next_ids = forward(input_ids, mask, 0)
        mask = torch.cat([mask, mask.new_ones((batch_size, 1))], dim=-1)
        if new_tokens > 1:
            tracker.set_phase("first decode step")
            next_ids = forward(next_ids, mask, prompt_len)
        if new_tokens > 2:
            # The steps between hold less than the last: the cache is filled without counting them.
            tracker.recording = False
            tracker.set_phase("filling the cache")
            filler = torch.ones((batch_size, new_tokens - 3), dtype=torch.long, device="cpu")
            if filler.shape[1]:
                mask = torch.cat([mask, mask.new_ones(filler.shape)], dim=-1)
                forward(filler, mask, prompt_len + 1)
            del filler
            tracker.recording = True
            mask = torch.cat([mask, mask.new_ones((batch_size, 1))], dim=-1)
            tracker.set_phase("last decode step")
            forward(next_ids, mask, total - 2)
    return _generation_trace(model, tracker, started, {
        "batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": dtype,
        "backend": backend, "cache": type(cache).__name__, "attention": built.config._attn_implementation,
        "fake": fake})


def trace_continuous(model: str, *, batch_size: int, prompt_len: int, new_tokens: int, dtype: str = "bf16",
                     attn_implementation: str = "sdpa", fake: bool = True) -> Trace:
    """The continuous backend (transformers' continuous batching, a paged cache) traced: its manager runs its
    steps in a thread of its own, which a fake-tensor mode (one per thread) does not follow, so the manager is
    made as the backend makes it and its batch processor's steps run here, in this thread: the paged cache
    allocated in full for ``batch_size`` requests in flight, every prefill step and the first decode step; then,
    the same cache holding every request at its next-to-last token, one decode step: the last, which reads the
    most. The sampled tokens have no values on fake tensors: each request is handed token 1 instead (no end id:
    every request runs to its length)."""
    started = time.perf_counter()
    built, mode, tracker = _built(model, dtype, attn_implementation, fake)
    # The backend's own layout (generation/continuous.py manager_arguments): every request in flight at its full
    # length, no blocks held back.
    layout = paged_layout(batch_size, prompt_len, new_tokens, default_page_size())
    generation_config = built.generation_config
    generation_config.eos_token_id, generation_config.do_sample = -1, False
    manager = built.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config(dict(
            max_requests_per_batch=batch_size, num_blocks=layout.num_blocks, max_batch_tokens=layout.max_batch_tokens,
            safety_margin=0.0, page_size=layout.page_size, seed=0,
            allow_block_sharing=False)))  # the trace's prompts are alike; a job's share no pages (an upper bound)
    attention = paged_kernel(built.config._attn_implementation)
    phases = []
    # torch.random.fork_rng: the processor seeds torch's generator (its tensor-parallel seed), this process's stays
    with (mode or contextlib.nullcontext()), tracker, _named_failures(built), torch.no_grad(), torch.random.fork_rng():
        tracker.track_module(built)
        tracker.set_phase("setup", "inputs")
        processor = manager._create_batch_processor()
        manager.batch_processor = processor
        for tensor in _cache_tensors(processor.cache):
            tracker.track(tensor, "kv_cache")
        io = processor.inputs_and_outputs
        io.prepare_batch_update = lambda: (io.requests_in_batch, [1] * io.num_request_in_batch, None)

        def run(prompt_tokens: int, recorded_decode_phase: str, record_prefill: bool) -> None:
            for row in range(batch_size):
                manager.add_request([1] * prompt_tokens, request_id=f"{recorded_decode_phase} {row}", max_new_tokens=2)
            while True:
                tracker.set_phase("between steps")
                if not processor.prepare_next_batch():
                    return
                decoding = all(state.query_length == 1 and state.state.position_offset > prompt_tokens
                               for state in io.requests_in_batch)
                tracker.recording = decoding or record_prefill
                tracker.set_phase(recorded_decode_phase if decoding else "prefill")
                phases.append(tracker.phase)
                manager._generation_step()
                processor.update_batch()
                if decoding:
                    tracker.recording = True
                    return

        run(prompt_len, "first decode step", record_prefill=True)
        if new_tokens > 2:  # every request at prompt + new - 2 tokens decodes its last one
            run(prompt_len + new_tokens - 2, "last decode step", record_prefill=False)
    tracker.recording = True
    return _generation_trace(model, tracker, started, {
        "batch_size": batch_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": dtype,
        "backend": "continuous", "cache": "PagedAttentionCache", "attention": attention,
        "num_blocks": layout.num_blocks, "max_batch_tokens": layout.max_batch_tokens, "fake": fake},
        substitutions=["the manager's steps run in this thread, not in its own; each sampled token is token 1"])


def _generation_trace(model: str, tracker: LiveTensors, started: float, settings: dict,
                      substitutions: list[str] | None = None) -> Trace:
    """A generation trace's record from its tracker: the peak, when it came, and its bytes by kind."""
    peak = tracker.peak
    return Trace(
        mode="generate", model=model, peak_bytes=peak.bytes, phase=peak.phase,
        by_kind={kind: peak.by_kind[kind] for kind in KINDS if peak.by_kind.get(kind)},
        phase_peaks={phase: value for phase, value in tracker.phase_peaks.items() if phase in GENERATION_PHASES},
        seconds=round(time.perf_counter() - started, 2), settings=settings, not_seen=_not_seen(),
        substitutions=substitutions or [])


def _cache_tensors(cache) -> list[torch.Tensor]:
    """A KV cache's tensors: the paged cache's one tensor for every layer (or, on transformers 5.17, a key
    and a value tensor per layer); a dynamic or static cache's keys and values, layer by layer."""
    if hasattr(cache, "cache_tensor"):
        return [cache.cache_tensor]
    if hasattr(cache, "key_cache"):
        return [*cache.key_cache, *cache.value_cache]
    tensors = []
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    return tensors


# ----------------------------------------------------------------------------------------------
# A plan's settings traced, and the trace beside the plan.

OVERHEAD_TERMS = ("cuda_context", "allocator_fragmentation")  # the profile's constants: no CPU trace sees them
# Which plan terms hold what each traced kind holds (the plan's activations are the saved tensors (training) or
# one layer's transients (generation), its logits term the logits and their gradients: the trace's
# activations, temporaries and inputs).
GROUPS = {
    "weights": (("weights", "lora_adapters"), ("parameters",)),
    "gradients": (("gradients", "ddp_gradient_buckets"), ("gradients",)),
    "optimizer states": (("optimizer_states",), ("optimizer_states",)),
    "autocast weight copies": (("autocast_weight_copies",), ("autocast_weight_copies",)),
    "KV cache": (("kv_cache",), ("kv_cache",)),
    "activations, logits and temporaries": (("activations", "logits_and_loss", "logits", "backward_temporaries",
                                             "optimizer_step_temporaries", "kv_read", "attention_mask"),
                                            ("activations", "temporaries", "inputs")),
}


def train_config(settings: PlanSettings, micro_batch_size: int):
    """The TrainConfig ``workbook train`` would build from ``settings`` (a profile's, with a plan's overrides)
    at ``micro_batch_size``: the run the trace runs. Synthetic rows of seq_len tokens stand in for the data."""
    from workbook.training.config import TrainConfig
    return TrainConfig(
        model=settings.model, data_path="", data_description="synthetic rows (trace)", output_dir="",
        max_seq_length=settings.seq_len, micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps, padding=settings.padding,
        dtype=settings.dtype, precision=settings.precision, lora_rank=settings.lora_rank,
        lora_targets=settings.lora_targets, grad_checkpointing=settings.grad_checkpointing,
        attn_implementation=settings.attn_implementation, loss_chunk_tokens=settings.loss_chunk_tokens,
        optimizer=settings.optimizer, offload_activations=settings.offload_activations)


def trace_plan(profile, plan) -> Trace:
    """The trace of what ``plan`` (planned from ``profile``: a profile's params and its overrides, as
    ``planner.profile.plan`` reads them) plans: one process's training step or generation. A TraceError
    says what cannot be traced (and the plan still stands)."""
    settings, on_gpu = PlanSettings.from_params(profile), Budget.from_params(profile).gpu_count > 0
    if plan.mode == "train":
        if settings.sharding != "none":
            raise TraceError("sharding fsdp: the trace runs one process, unsharded; read the plan's FSDP terms")
        if settings.offload_activations:
            raise TraceError("offload_activations copies to pinned host memory on CUDA only; the trace runs without "
                             "it: trace with offload_activations false and read the plan's activations term")
        return trace_training(train_config(settings, plan.batch_size), on_gpu=on_gpu)
    if plan.tensor_parallel_size > 1:
        raise TraceError(f"tensor_parallel_size {plan.tensor_parallel_size}: the trace runs one unsharded process")
    traced = trace_generation(settings.model, batch_size=plan.batch_size, prompt_len=plan.lengths["prompt_len"],
                              new_tokens=plan.lengths["new_tokens"], dtype=plan.dtype,
                              backend="static" if settings.backend == "auto" else settings.backend,
                              attn_implementation=settings.attn_implementation)
    if settings.backend == "auto":
        traced.substitutions.append("backend auto traced as static, as it is planned (where the job picks "
                                    "continuous, trace backend continuous)")
    return traced


def beside_plan(plan, trace: Trace) -> dict:
    """The trace beside the plan, group by group (``GROUPS``), tensors only: the plan's total without
    its CUDA context and fragmentation terms against the trace's peak; then the trace with those
    profile constants added, the figure to hold against the GPU."""
    terms = {term.name: term.bytes for term in plan.terms}
    groups = []
    for name, (plan_terms, kinds) in GROUPS.items():
        planned = sum(terms.get(term, 0) for term in plan_terms)
        traced = sum(trace.by_kind.get(kind, 0) for kind in kinds)
        if planned or traced:
            groups.append({"group": name, "plan_bytes": planned, "trace_bytes": traced,
                           "plan_terms": [term for term in plan_terms if term in terms]})
    plan_tensors = sum(value for name, value in terms.items() if name not in OVERHEAD_TERMS)
    constants = {name: terms.get(name, 0) for name in OVERHEAD_TERMS}
    fragmentation = plan.settings.get("fragmentation_fraction", 0.0)
    return {
        "groups": groups,
        "plan_tensor_bytes": plan_tensors,
        "trace_peak_bytes": trace.peak_bytes,
        "plan_over_trace": round(plan_tensors / trace.peak_bytes, 4) if trace.peak_bytes else None,
        "trace_with_profile_constants_bytes": (trace.peak_bytes + constants["cuda_context"]
                                               + int(trace.peak_bytes * fragmentation)),
    }


def beside_plan_lines(comparison: dict) -> list[str]:
    """The comparison in words: one line per group, then the totals."""
    lines = ["trace beside the plan (tensors alive at each one's peak moment):"]
    for group in comparison["groups"]:
        lines.append(f"  {group['group']:<38} plan {format_bytes(group['plan_bytes']):>10}   "
                     f"trace {format_bytes(group['trace_bytes']):>10}")
    ratio = comparison["plan_over_trace"]
    lines.append(f"  {'tensors at the peak':<38} plan {format_bytes(comparison['plan_tensor_bytes']):>10}   "
                 f"trace {format_bytes(comparison['trace_peak_bytes']):>10}"
                 + (f"   (plan {100 * (ratio - 1):+.1f}%)" if ratio else ""))
    lines.append(f"  trace + the profile's CUDA context and fragmentation: "
                 f"{format_bytes(comparison['trace_with_profile_constants_bytes'])}")
    return lines


def largest_batch_by_trace(trace_at, budget_bytes: int, overhead_bytes: int = 0, fragmentation_fraction: float = 0.0,
                           limit: int = 4096) -> dict:
    """The largest batch whose traced peak, with the profile's CUDA context and fragmentation added, fits
    ``budget_bytes``: two traces (batch 1 and 2) give the line bytes = fixed + per_row x batch, the line
    gives the batch, and a trace at that batch confirms it (one row less and traced again while it does
    not fit). ``trace_at(batch)`` returns a Trace. ``batch`` 0: not even batch 1 fits."""
    usable = (budget_bytes - overhead_bytes) / (1 + fragmentation_fraction)
    one = trace_at(1)
    traces = 1
    if one.peak_bytes > usable:
        return {"batch": 0, "traces": traces, "fixed_bytes": None, "bytes_per_row": None,
                "confirmed_peak_bytes": one.peak_bytes}
    two = trace_at(2)
    traces += 1
    per_row = two.peak_bytes - one.peak_bytes
    fixed = one.peak_bytes - per_row
    batch = limit if per_row <= 0 else max(1, min(limit, int((usable - fixed) // per_row)))
    confirmed = {1: one, 2: two}.get(batch) or trace_at(batch)
    traces += batch > 2
    while confirmed.peak_bytes > usable and batch > 1:
        batch -= 1
        confirmed = {1: one, 2: two}.get(batch) or trace_at(batch)
        traces += batch > 2
    return {"batch": batch, "traces": traces, "fixed_bytes": fixed, "bytes_per_row": per_row,
            "confirmed_peak_bytes": confirmed.peak_bytes, "confirmed_phase": confirmed.phase}


def traced_plan(profile, plan, auto_batch: bool = False) -> dict:
    """``workbook plan --trace``'s ``trace`` block: the trace of ``plan`` and the two beside each other, or
    ``error`` naming what could not be traced (the plan itself still stands). ``auto_batch``: also the
    largest batch by traces (``largest_batch_by_trace``) against the plan's budget."""
    import dataclasses
    try:
        traced = trace_plan(profile, plan)
        block = {**traced.to_dict(), "beside_plan": beside_plan(plan, traced)}
        if auto_batch:
            block["largest_batch_by_trace"] = largest_batch_by_trace(
                lambda batch: trace_plan(profile, dataclasses.replace(plan, batch_size=batch)), plan.budget_bytes,
                plan.settings.get("overhead_bytes", 0), plan.settings.get("fragmentation_fraction", 0.0))
    except TraceError as error:
        return {"error": str(error)}
    return block


def traced_plan_lines(block: dict) -> list[str]:
    if "error" in block:
        return [f"trace: {block['error']}; the plan above is the analytical one alone"]
    trace = Trace(**{key: value for key, value in block.items() if key in Trace.__dataclass_fields__})
    lines = trace.lines() + beside_plan_lines(block["beside_plan"])
    largest = block.get("largest_batch_by_trace")
    if largest:
        lines.append(f"largest batch by trace: {largest['batch']} ({largest['traces']} traces: batch 1 and 2 give "
                     f"{format_bytes(largest['bytes_per_row'] or 0)} per row; the trace at the chosen batch peaks at "
                     f"{format_bytes(largest['confirmed_peak_bytes'])}, before the profile's CUDA context and "
                     "fragmentation)")
    return lines
