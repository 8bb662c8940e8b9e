"""From a params profile to a memory plan: the memory to plan against, 'auto' batch sizes, the
per-GPU tables, and the plan in words.

``generation.plan_generate`` / ``training.plan_train`` answer for explicit numbers; this module
maps a run's settings onto them once, so the CLI, notebook 01, the widget tuner, the generation
job and the trainer size batches the same way::

    budget = Budget.from_params(params)                 # one GPU of the profile (cpu: this machine's RAM)
    train_plan("llama-3.2-1b", budget, micro_batch_size=8, seq_len=2048, dtype="bf16", ...)
    plan(params, mode="generate")                       # the same from the whole profile, 'auto' resolved
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from workbook import presets
from workbook.params import AUTO, PLAN_MODES, default as _default, settings_of
from workbook.planner.architectures import training_attention
from workbook.planner.generation import plan_generate
from workbook.planner.layout import LayoutError, check_tensor_parallel_size, choose_tensor_parallel_size
from workbook.planner.network import network_traffic, traffic_line
from workbook.planner.paged import continuous_attention, plan_generate_paged
from workbook.planner.plans import DEFAULT_SAFETY_MARGIN, MAX_BATCH_SEARCH_LIMIT, DoesNotFitError, Plan
from workbook.planner.shape import model_shape
from workbook.planner.training import plan_train
from workbook.units import GiB, format_bytes

# Why the continuous backend refuses T > 1: every rank of a tensor-parallel group must run the same
# forward passes, and transformers' continuous-batching scheduler (a thread per process, fed as
# results arrive) would batch differently on each rank, so the group's collectives would not match.
CONTINUOUS_NOT_SHARDED = ("backend continuous runs one whole copy of the model per process and cannot run under "
                          "tensor parallelism (tensor_parallel_size {size}): each rank's scheduler would batch "
                          "differently and the group's collectives would not match. Use backend static (or auto) "
                          "with tensor_parallel_size > 1, or tensor_parallel_size 1 with continuous.")

CURVE_POINTS = 13  # batch sizes per memory-vs-batch curve
LORA_CURVE_RANK = 16  # the "frugal" training setting the curves' x axis is sized by


@dataclass(frozen=True)
class Budget:
    """The memory a plan must fit: one GPU of a profile, or this machine's RAM when gpu_count is 0.

    The fields are the params keys of the same names (``Budget.from_params``; the jobs' key lists name
    them as ``job_settings.BUDGET_KEYS``). Built in code, it is this machine's RAM with no overhead."""

    gpu_count: int = 0
    gpu_memory_gib: float = 0.0
    cuda_overhead_gib: float = 0.0
    safety_margin: float = DEFAULT_SAFETY_MARGIN

    @classmethod
    def from_params(cls, params) -> Budget:
        return settings_of(cls, params)

    @property
    def capacity_bytes(self) -> int:
        """Memory of one GPU of the profile; on the cpu profile, this machine's RAM."""
        if self.gpu_count > 0:
            return int(self.gpu_memory_gib * GiB)
        import psutil  # a dependency of accelerate
        return psutil.virtual_memory().total

    @property
    def overhead_bytes(self) -> int:
        return int(self.cuda_overhead_gib * GiB)

    def place(self, plan: Plan) -> Plan:
        """``plan`` marked as planned against this machine's RAM on the cpu profile (its wording, its advice)."""
        plan.in_ram = self.gpu_count == 0
        return plan


@dataclass(frozen=True)
class PlanSettings:
    """What ``plan`` reads of a profile besides its ``Budget`` (keyword overrides applied), each field
    the params key of the same name; a key the profile does not hold takes the schema's default."""

    profile: str = _default("profile")  # the name the plan's words give
    model: str = _default("model")
    plan_mode: str = _default("plan_mode")
    dtype: str = _default("dtype")
    batch_size: int | str = _default("batch_size")
    micro_batch_size: int | str = _default("micro_batch_size")
    prompt_len: int = _default("prompt_len")
    max_new_tokens: int = _default("max_new_tokens")
    backend: str = _default("backend")
    tensor_parallel_size: int | str = _default("tensor_parallel_size")
    attn_implementation: str = _default("attn_implementation")
    seq_len: int = _default("seq_len")
    padding: str = _default("padding")
    grad_checkpointing: bool = _default("grad_checkpointing")
    lora_rank: int = _default("lora_rank")
    lora_targets: str = _default("lora_targets")
    optimizer: str = _default("optimizer")
    loss_chunk_tokens: int = _default("loss_chunk_tokens")
    precision: str = _default("precision")
    offload_activations: bool = _default("offload_activations")
    gradient_accumulation_steps: int = _default("gradient_accumulation_steps")  # earlier micro-batches' gradients
    num_nodes: int = _default("num_nodes")
    sharding: str = "none"  # no params key: FSDP's, given as an override (the training sweep)
    double_quant: bool = False  # no params key (no profile trains int4): QLoRA's, given as an override

    @classmethod
    def from_params(cls, params) -> PlanSettings:
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})

    def batch(self, mode: str) -> int | str:
        """The batch the profile asks for in ``mode``: sequences (generate) or the micro-batch (train)."""
        return self.batch_size if mode == "generate" else self.micro_batch_size


def capacity_bytes(params) -> int:
    """Memory of one GPU of the profile; on the cpu profile, this machine's RAM."""
    return Budget.from_params(params).capacity_bytes


def generate_plan(model, budget: Budget, *, batch_size: int, prompt_len: int, new_tokens: int,
                  dtype: str, tensor_parallel_size: int = 1, backend: str = "static",
                  attn_implementation: str = "sdpa") -> Plan:
    """Generation plans T x D GPUs: groups of ``tensor_parallel_size`` GPUs each hold one sharded copy
    of the model, and the profile's other GPUs run more such groups (data parallel). T = 1 is plain
    data parallel, every GPU holding the whole model; nothing else is planned, since nothing else runs.
    The continuous backend is planned by its paged cache, at T = 1 only (it does not run sharded)."""
    gpus = max(budget.gpu_count, 1)
    if budget.gpu_count:  # the cpu profile runs its processes on this machine's cores, not on GPUs
        shape = model_shape(model)
        check_tensor_parallel_size(tensor_parallel_size, shape.num_key_value_heads, gpus, model=shape.name)
    if backend == "continuous":
        if tensor_parallel_size > 1:
            raise LayoutError(CONTINUOUS_NOT_SHARDED.format(size=tensor_parallel_size))
        return budget.place(plan_generate_paged(
            model, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
            attn_implementation=continuous_attention(attn_implementation), dtype=dtype,
            gpu_memory_bytes=budget.capacity_bytes, overhead_bytes=budget.overhead_bytes,
            safety_margin=budget.safety_margin, data_parallel_size=gpus))
    return budget.place(plan_generate(
        model, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype, batch_size=batch_size,
        gpu_memory_bytes=budget.capacity_bytes, overhead_bytes=budget.overhead_bytes,
        safety_margin=budget.safety_margin, tensor_parallel_size=tensor_parallel_size,
        attn_implementation=attn_implementation, data_parallel_size=max(gpus // tensor_parallel_size, 1),
        static_cache=backend == "static-compiled"))


def tensor_parallel_size(wanted: int | str, config, budget: Budget,
                         make: Callable[[int, int], Plan]) -> tuple[int, str]:
    """The profile's tensor_parallel_size (``wanted``), or for 'auto' the layout
    ``layout.choose_tensor_parallel_size`` picks (``make(batch, T)`` plans one), and why ('' when given)."""
    if wanted != AUTO:
        return int(wanted), ""
    return choose_tensor_parallel_size(lambda size: make(1, size), model_shape(config).num_key_value_heads,
                                       budget.gpu_count)


def train_plan(model, budget: Budget, *, micro_batch_size: int, seq_len: int, dtype: str, grad_checkpointing: bool,
               lora_rank: int, optimizer: str = "adamw", sharding: str = "none", num_nodes: int = 1,
               lora_targets: str = "", attn_implementation: str = "sdpa", loss_chunk_tokens: int = 0,
               precision: str = "mixed", offload_activations: bool = False,
               gradient_accumulation_steps: int = 1, double_quant: bool = False) -> Plan:
    """Training plans data-parallel replicas (or FSDP shards) over the profile's GPUs on each of
    ``num_nodes`` nodes, with mixed precision (fp32 master weights under autocast) whenever the dtype
    is 16-bit and ``precision`` is 'mixed', pure bf16 weights and states when it is 'bf16': what the
    trainer runs."""
    if precision not in ("mixed", "bf16"):
        raise ValueError(f"precision {precision!r}: expected mixed or bf16")
    if precision == "bf16" and dtype != "bf16":
        raise ValueError(f"precision bf16 trains bf16 weights and needs dtype bf16 (not {dtype}): "
                         "set dtype bf16 (workbook plan: --dtype bf16), or precision mixed")
    if double_quant and dtype != "int4":
        raise ValueError(f"double_quant quantizes 4-bit weights' absmax and needs dtype int4 (not {dtype}): "
                         "set dtype int4 (workbook plan: --dtype int4), or leave double_quant off")
    return budget.place(plan_train(
        model, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
        mixed_precision=dtype != "fp32" and precision == "mixed", grad_checkpointing=grad_checkpointing,
        lora_rank=lora_rank, lora_target_modules=lora_targets, attn_implementation=attn_implementation,
        optimizer=optimizer, sharding=sharding, loss_chunk_tokens=loss_chunk_tokens,
        offload_activations=offload_activations, gradient_accumulation_steps=gradient_accumulation_steps,
        double_quant=double_quant, gpu_count=max(budget.gpu_count, 1) * num_nodes,
        gpu_memory_bytes=budget.capacity_bytes, overhead_bytes=budget.overhead_bytes,
        safety_margin=budget.safety_margin))


def at_largest_batch(make: Callable[[int], Plan]) -> Plan:
    """The plan at the largest batch that fits (at batch 1 when none does, so it says so)."""
    return make(max(make(1).max_batch_size, 1))


def plan(params, *, mode: str | None = None, model: str | None = None, batch_size: int | str | None = None,
         **overrides) -> Plan:
    """The memory plan for the profile's settings; keyword overrides replace profile values.

    A batch of 'auto' (or None with an 'auto' profile) plans at the largest batch that fits. The
    plan's ``network`` says what crosses the network over the profile's ``num_nodes`` nodes.
    """
    profile = {**params, **overrides}
    settings, budget = PlanSettings.from_params(profile), Budget.from_params(profile)  # all the plan reads
    mode = mode or settings.plan_mode
    config = presets.load_config(model or settings.model)
    if mode == "generate":
        def make_at(batch: int, size: int) -> Plan:
            return generate_plan(config, budget, batch_size=batch, prompt_len=settings.prompt_len,
                                 new_tokens=settings.max_new_tokens, dtype=settings.dtype,
                                 tensor_parallel_size=size, backend=settings.backend,
                                 attn_implementation=settings.attn_implementation)
        size, why = tensor_parallel_size(settings.tensor_parallel_size, config, budget, make_at)

        def make(batch: int) -> Plan:
            made = make_at(batch, size)
            made.notes += [why] if why else []
            return made
    elif mode == "train":
        # Packed rows run the attention path the trainer picks for them (no seq x seq mask where it can).
        attention = training_attention(model_shape(config), settings.attn_implementation, settings.padding,
                                       settings.seq_len, on_gpu=budget.gpu_count > 0)

        def make(batch: int) -> Plan:
            return train_plan(config, budget, micro_batch_size=batch, seq_len=settings.seq_len,
                              dtype=settings.dtype, grad_checkpointing=settings.grad_checkpointing,
                              lora_rank=settings.lora_rank, optimizer=settings.optimizer,
                              sharding=settings.sharding, num_nodes=settings.num_nodes,
                              lora_targets=settings.lora_targets, attn_implementation=attention,
                              loss_chunk_tokens=settings.loss_chunk_tokens, precision=settings.precision,
                              offload_activations=settings.offload_activations,
                              gradient_accumulation_steps=settings.gradient_accumulation_steps,
                              double_quant=settings.double_quant)
    else:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(PLAN_MODES)}")
    wanted = settings.batch(mode) if batch_size is None else batch_size
    result = at_largest_batch(make) if wanted == AUTO else make(int(wanted))
    result.network = network_traffic(result, settings.num_nodes, budget.gpu_count)
    return result


def refuse_over_ram(params, mode: str, processes: int = 1) -> None:
    """On the cpu profile, ``check_ram`` before any model loads: the job's plan, ``processes`` of them
    ('auto', the largest batch one process could hold, is judged at batch 1 for several). A model the
    planner cannot plan (GPT-2, ...) is not refused; nor is a GPU profile: there an out-of-memory error
    is raised, and the generation engine splits the batch."""
    if Budget.from_params(params).gpu_count > 0:
        return
    key, asked = batch_key(mode), PlanSettings.from_params(params).batch(mode)
    try:
        planned = plan(params, mode=mode)
        each = plan(params, mode=mode, batch_size=1) if asked == AUTO and processes > 1 else planned
    except ValueError:
        return
    check_ram(planned, key, asked)
    check_ram(each, key, asked, processes)


def batch_key(mode: str) -> str:
    """The params key of ``mode``'s batch."""
    return "batch_size" if mode == "generate" else "micro_batch_size"


def check_ram(planned: Plan, key: str, asked, processes: int = 1) -> None:
    """DoesNotFitError when ``processes`` copies of a plan against this machine's RAM (each process holding
    the model and its batch) are over it: past the RAM the kernel kills a process without a word. Names
    the largest batch, or the most processes, that fit."""
    if not planned.in_ram or planned.total_bytes * processes <= planned.budget_bytes:
        return
    if not planned.fits:
        largest = f" Set {key} to {planned.max_batch_size} or auto." if planned.max_batch_size else ""
        raise DoesNotFitError(f"{key} {asked}: {planned.advice()}{largest}", planned)
    raise DoesNotFitError(
        f"{processes} processes each hold the model and a batch of {planned.batch_size}: {processes} x "
        f"{format_bytes(planned.total_bytes)} is over the {format_bytes(planned.budget_bytes)} of this machine's RAM "
        f"the plan may use; run at most {planned.budget_bytes // planned.total_bytes} process(es), or a smaller "
        f"{key}.", planned)


def resolve_batch_size(params, mode: str, **overrides) -> int:
    """The batch to run with: the profile's number, or for 'auto' the planner's largest that fits.

    Raises DoesNotFitError (with what to change) when not even batch 1 fits.
    """
    value = overrides.pop(batch_key(mode), PlanSettings.from_params(params).batch(mode))
    if value != AUTO:
        return int(value)
    return plan(params, mode=mode, batch_size=1, **overrides).require_fit().max_batch_size


def max_batch_table(profiles: dict, models: list[str], mode: str, **overrides) -> list[dict]:
    """Largest batch per GPU profile x model, computed (the seeds' per-GPU tables, but planned).

    Each GPU profile's own dtype is used (fp16 on a V100); `overrides` (e.g. seq_len) apply to all.
    """
    rows = []
    for model in models:
        row = {"model": model}
        for name, params in profiles.items():
            if not Budget.from_params(params).gpu_count:
                continue
            # Each GPU holds the whole model here; layout_table shows the tensor-parallel alternative.
            whole = {"tensor_parallel_size": 1} if mode == "generate" else {}
            largest = plan(params, mode=mode, model=model, batch_size=1, **{**whole, **overrides}).max_batch_size
            # The search stops at its limit (the tiny model on an H200): more fit, and the table says so.
            row[name] = largest if largest < MAX_BATCH_SEARCH_LIMIT else f">= {largest:,} (the search's limit)"
        rows.append(row)
    return rows


def layout_table(profiles: dict, models: list[str], **overrides) -> list[dict]:
    """Per multi-GPU profile x model, the generation layout 'auto' chooses (T x D), what each GPU
    then holds, its largest batch and why: how a teacher bigger than one GPU is run."""
    rows = []
    for name, params in profiles.items():
        if Budget.from_params(params).gpu_count < 2:
            continue
        for model in models:
            chosen = plan(params, mode="generate", model=model, batch_size=1, tensor_parallel_size=AUTO, **overrides)
            rows.append({"profile": name, "model": model, "layout": f"T={chosen.tensor_parallel_size} x "
                                                                     f"D={chosen.data_parallel_size}",
                         "weights per GPU": format_bytes(chosen.weights_bytes),
                         "largest batch per GPU": chosen.max_batch_size,
                         "why": chosen.notes[-1].split(": ", 1)[1]})
    return rows


def memory_curves(params, plans: dict[str, Plan]) -> dict[str, dict[str, tuple[list[int], list[int]]]]:
    """Predicted peak against batch size, per mode: generation by weights dtype, training full vs
    checkpointed vs LoRA. Each x axis spans twice the largest batch that fits with the most frugal
    setting drawn (int4 weights; LoRA with checkpointing), so the budget line is crossed."""
    frugal = {"generate": plan(params, mode="generate", batch_size=1, dtype="int4"),
              "train": plan(params, mode="train", batch_size=1, grad_checkpointing=True, lora_rank=LORA_CURVE_RANK)}
    top = {mode: 2 * max(frugal[mode].max_batch_size, plans[mode].batch_size, 4) for mode in plans}

    def curve(mode: str, **changes) -> tuple[list[int], list[int]]:
        batches = sorted({max(1, round(top[mode] * i / (CURVE_POINTS - 1))) for i in range(CURVE_POINTS)})
        return batches, [plan(params, mode=mode, batch_size=batch, **changes).total_bytes for batch in batches]

    return {
        # int8/int4 are weight formats (bitsandbytes): compute and the KV cache stay bf16.
        "generate": {label: curve("generate", dtype=dtype) for dtype, label in (
            ("fp32", "fp32 weights and KV cache"), ("bf16", "bf16 weights and KV cache"),
            ("int8", "int8 weights, bf16 KV cache"), ("int4", "int4 weights, bf16 KV cache"))},
        "train": {"full fine-tune": curve("train", grad_checkpointing=False, lora_rank=0),
                  "+ gradient checkpointing": curve("train", grad_checkpointing=True, lora_rank=0),
                  f"LoRA r{LORA_CURVE_RANK} + checkpointing": curve("train", grad_checkpointing=True,
                                                                    lora_rank=LORA_CURVE_RANK)},
    }


# ----------------------------------------------------------------------------------------------
# The plan in words: one table and one verdict for the CLI and notebook 01.


def plan_title(plan: Plan, profile_name: str) -> str:
    lengths = ", ".join(f"{key} {value}" for key, value in plan.lengths.items())
    layout = (f"; tensor parallel {plan.tensor_parallel_size} x data parallel {plan.data_parallel_size}"
              if plan.mode == "generate" else "")
    return (f"{plan.model} ({plan.params:,} parameters), {plan.mode}, {plan.dtype}, batch {plan.batch_size}, "
            f"{lengths}; profile {profile_name}: {format_bytes(plan.capacity_bytes)} "
            f"{plan.per_device if plan.in_ram else f'per GPU x {plan.gpu_count}'}{layout}")


def plan_rows(plan: Plan) -> list[dict]:
    """One row per term, then the total: what each is, its bytes and how it was computed."""
    rows = [{"term": term.name, "bytes": f"{term.bytes:,}", "size": format_bytes(term.bytes),
             "how it was computed": term.explanation} for term in plan.terms]
    rows.append({"term": "total (predicted peak)", "bytes": f"{plan.total_bytes:,}",
                 "size": format_bytes(plan.total_bytes), "how it was computed": "sum of the terms above"})
    return rows


def plan_verdict(plan: Plan) -> list[str]:
    """FITS or DOES NOT FIT against the budget, the largest batch, the KV cache per token, the notes,
    and what to change when it does not fit."""
    lines = [f"{'FITS' if plan.fits else 'DOES NOT FIT'}: budget {format_bytes(plan.budget_bytes)} {plan.per_device} "
             f"({plan.safety_margin:.0%} of {format_bytes(plan.capacity_bytes)} kept free); "
             f"largest batch that fits: {plan.max_batch_size}"]
    if plan.kv_cache_bytes_per_token:
        lines.append(f"KV cache: {plan.kv_cache_bytes_per_token:,} bytes per token")
    lines += [f"note: {note}" for note in plan.notes]
    if plan.network:
        lines.append(traffic_line(plan.network))
    if not plan.fits:
        lines.append(plan.advice())
    return lines


def plan_text(plan: Plan, profile_name: str) -> str:
    """The title, the terms as a fixed-width table, and the verdict (``workbook plan``)."""
    lines = [plan_title(plan, profile_name), f"{'term':<28}{'bytes':>16}  {'':>10}  how it was computed"]
    for row in plan_rows(plan):
        lines.append(f"{row['term']:<28}{row['bytes']:>16}  {row['size']:>10}  {row['how it was computed']}")
    return "\n".join(lines + plan_verdict(plan))
